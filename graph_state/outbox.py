"""The outbox: the nodes whose final embeddings a recompute committed, until they are published.

A record names nodes only (their interned ids) and when they were computed.
It is written in the WriteBatch of the rows it names, under the next
sequence number (``outbox`` family, ``>Q``: the order of the commits). The
publisher reads the records in order, sends each node's state as stored
when it sends (that commit's or a newer one: every message pairs a version
with its own vector, and a node's newest version is always among those
sent), and removes the records once the producer's flush succeeded, so
delivery is at least once. This module is the one that encodes, appends,
reads and removes them.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.transaction import Transaction

if TYPE_CHECKING:
    from gnnstream.graph_state.store import GraphStore

__all__ = ["Outbox", "encode_record", "decode_record"]

_RECORD = struct.Struct(">BId")  # format, count, computed_at
_FORMAT = 3


def encode_record(iids: np.ndarray, computed_at: float) -> bytes:
    """One outbox record: a header (format byte, count, computed_at) and the ids (u64 big-endian)."""
    iids = np.asarray(iids, dtype=np.int64)
    return _RECORD.pack(_FORMAT, len(iids), computed_at) + iids.astype(">u8").tobytes()


def decode_record(raw: bytes) -> tuple[float, np.ndarray]:
    """``(computed_at, iids)`` of one outbox record."""
    fmt, count, computed_at = _RECORD.unpack_from(raw)
    if fmt != _FORMAT:
        raise ValueError(f"Expected outbox record format {_FORMAT} (got {fmt})")
    return computed_at, np.frombuffer(raw, ">u8", count, _RECORD.size).astype(np.int64)


class Outbox:
    """The outbox of a graph store.

    Args:
        store: the graph store (owner of the ``outbox`` family and of the next sequence number).
    """

    def __init__(self, store: GraphStore):
        self.store = store
        self._seq = 0
        self.reload()

    def reload(self) -> None:
        """Read the next sequence number as stored (after a write that failed, what was counted is not)."""
        raw = self.store.column("meta").get(keys.META_OUTBOX_SEQ)
        self._seq = 0 if raw is None else keys.U64.unpack(raw)[0]

    def append(self, tx: Transaction, iids: np.ndarray, computed_at: float) -> None:
        """Add a record naming ``iids`` to ``tx``, with the next sequence number (also stored in ``tx``)."""
        tx.put_outbox(self._seq, encode_record(iids, computed_at))
        self._seq += 1
        tx.set_meta(keys.META_OUTBOX_SEQ, keys.U64.pack(self._seq))

    def records(self, after: bytes | None = None) -> Iterator[tuple[bytes, float, np.ndarray]]:
        """``(key, computed_at, iids)`` of the stored records in order, from the one after key ``after``."""
        for key, raw in self.store.column("outbox").items(from_key=after):
            if key == after:
                continue
            computed_at, iids = decode_record(raw)
            yield key, computed_at, iids

    def pending(self) -> int:
        """Records stored, published or not."""
        return sum(1 for _ in self.store.column("outbox").keys())

    def confirm(self, stored_keys: Iterable[bytes]) -> None:
        """Remove the records of ``stored_keys`` (their updates were delivered)."""
        stored_keys = list(stored_keys)
        if stored_keys:
            tx = Transaction()
            tx.remove_outbox(stored_keys)
            self.store.commit(tx)
