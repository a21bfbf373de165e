"""Per-layer node embeddings: RocksDB-backed tables with a dense in-memory cache.

Layer 0 is the input (node features, zeros for a node without features);
layer ``l >= 1`` is ``h^l``. Rows are addressed by interned node id. The cache
is write-through (rows reach RocksDB in the recompute WriteBatch) and bounded:
past ``max_rows`` nodes it is dropped and rebuilt lazily from RocksDB.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from graph_state import keys
from graph_state.store import GraphStore

__all__ = ["EmbeddingTables", "EmbeddingMeta", "OutboxEntry", "encode_outbox", "decode_outbox"]

logger = logging.getLogger(__name__)

_META = keys.EMBMETA_HEAD  # version, event_ts; mode (ascii) follows
_OUTBOX = struct.Struct(">BIIdH")  # format, count, dim, computed_at, mode-table length
_OUTBOX_FORMAT = 2


@dataclass(frozen=True, slots=True)
class EmbeddingMeta:
    version: int
    event_ts: float
    mode: str

    def encode(self) -> bytes:
        return _META.pack(self.version, self.event_ts) + self.mode.encode()

    @classmethod
    def decode(cls, raw: bytes) -> "EmbeddingMeta":
        version, event_ts = _META.unpack_from(raw)
        return cls(version, event_ts, raw[_META.size:].decode())


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """One embedding update waiting to be published (``embedding`` None = node deleted)."""

    node: str
    version: int
    event_ts: float
    computed_at: float
    mode: str
    embedding: np.ndarray | None


def encode_outbox(nodes: Sequence[str], versions: Sequence[int], event_ts: Sequence[float], computed_at: float,
                  modes: Sequence[str], rows: np.ndarray | None) -> bytes:
    """One outbox record holding the updates of one recompute (``rows`` None: all deleted).

    Layout: a header (format byte, count, dim, computed_at, mode-table length),
    the mode table (ascii, comma-separated), then per-entry arrays: versions
    (u64 BE), event times (f64 BE), mode indexes (u8), id lengths (u16 BE),
    the ids (utf-8), and the embeddings (float32 LE, ``count x dim``).
    """
    table = sorted(set(modes))
    index = {m: i for i, m in enumerate(table)}
    table_bytes = ",".join(table).encode()
    ids = [n.encode() for n in nodes]
    dim = 0 if rows is None else rows.shape[1]
    parts = [
        _OUTBOX.pack(_OUTBOX_FORMAT, len(ids), dim, computed_at, len(table_bytes)), table_bytes,
        np.asarray(versions, dtype=">u8").tobytes(), np.asarray(event_ts, dtype=">f8").tobytes(),
        np.asarray([index[m] for m in modes], dtype="u1").tobytes(),
        np.asarray([len(b) for b in ids], dtype=">u2").tobytes(), b"".join(ids),
    ]
    if rows is not None:
        parts.append(np.ascontiguousarray(rows, dtype="<f4").tobytes())
    return b"".join(parts)


def decode_outbox(raw: bytes) -> list[OutboxEntry]:
    """The entries of one outbox record, in order."""
    fmt, count, dim, computed_at, table_len = _OUTBOX.unpack_from(raw)
    if fmt != _OUTBOX_FORMAT:
        raise ValueError(f"Expected outbox record format {_OUTBOX_FORMAT} (got {fmt})")
    at = _OUTBOX.size
    table = raw[at:at + table_len].decode().split(",")
    at += table_len
    versions = np.frombuffer(raw, ">u8", count, at).tolist()
    at += 8 * count
    times = np.frombuffer(raw, ">f8", count, at).tolist()
    at += 8 * count
    modes = np.frombuffer(raw, "u1", count, at).tolist()
    at += count
    lengths = np.frombuffer(raw, ">u2", count, at).tolist()
    at += 2 * count
    ids = []
    for n in lengths:
        ids.append(raw[at:at + n].decode())
        at += n
    rows = np.frombuffer(raw, "<f4", count * dim, at).reshape(count, dim).copy() if dim else None
    return [OutboxEntry(ids[i], versions[i], times[i], computed_at, table[modes[i]],
                        None if rows is None else rows[i]) for i in range(count)]


class EmbeddingTables:
    """Rows of ``h^0 … h^L`` by interned id.

    Args:
        store: the graph store (owner of the ``emb`` column family and features).
        dims: the row width of each layer, ``dims[0]`` being the feature dim.
        max_rows: bound on the number of cached rows per layer.
    """

    def __init__(self, store: GraphStore, dims: Sequence[int], max_rows: int = 4_000_000):
        self.store = store
        self.dims = list(dims)
        self.max_rows = max_rows
        self._rows: list[np.ndarray] = [np.zeros((0, d), dtype=np.float32) for d in self.dims]
        self._loaded: list[np.ndarray] = [np.zeros(0, dtype=bool) for _ in self.dims]
        self._present: list[np.ndarray] = [np.zeros(0, dtype=bool) for _ in self.dims]

    def clear(self) -> None:
        self._rows = [np.zeros((0, d), dtype=np.float32) for d in self.dims]
        self._loaded = [np.zeros(0, dtype=bool) for _ in self.dims]
        self._present = [np.zeros(0, dtype=bool) for _ in self.dims]

    def _grow(self, layer: int, size: int) -> bool:
        have = len(self._loaded[layer])
        if size <= have:
            return True
        if size > self.max_rows:
            return False
        new = max(size, min(self.max_rows, 2 * have, size + (1 << 20)))
        rows = np.zeros((new, self.dims[layer]), dtype=np.float32)
        rows[:have] = self._rows[layer]
        loaded = np.zeros(new, dtype=bool)
        loaded[:have] = self._loaded[layer]
        present = np.zeros(new, dtype=bool)
        present[:have] = self._present[layer]
        self._rows[layer], self._loaded[layer], self._present[layer] = rows, loaded, present
        return True

    def _read(self, layer: int, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if layer == 0:
            return self.store.feature_rows(iids.tolist(), self.dims[0])
        out = np.zeros((len(iids), self.dims[layer]), dtype=np.float32)
        present = np.zeros(len(iids), dtype=bool)
        raws = self.store.column("emb").get([keys.layer_key(layer, int(i)) for i in iids])
        for row, raw in enumerate(raws):
            if raw is not None:
                out[row] = np.frombuffer(raw, dtype="<f4")
                present[row] = True
        return out, present

    def get(self, layer: int, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``iids`` at ``layer`` and a mask of which exist (zeros elsewhere)."""
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids) == 0:
            return np.zeros((0, self.dims[layer]), dtype=np.float32), np.zeros(0, dtype=bool)
        if not self._grow(layer, int(iids.max()) + 1):
            self.clear()
            return self._read(layer, iids)
        missing = iids[~self._loaded[layer][iids]]
        if len(missing):
            missing = np.unique(missing)
            rows, present = self._read(layer, missing)
            self._rows[layer][missing] = rows
            self._present[layer][missing] = present
            self._loaded[layer][missing] = True
        return self._rows[layer][iids], self._present[layer][iids]

    def set(self, layer: int, iids: np.ndarray, rows: np.ndarray | None) -> None:
        """Update cached rows (``rows`` None removes them); the caller writes RocksDB."""
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids) == 0 or not self._grow(layer, int(iids.max()) + 1):
            return
        if rows is None:
            self._rows[layer][iids] = 0
            self._present[layer][iids] = False
        else:
            self._rows[layer][iids] = rows
            self._present[layer][iids] = True
        self._loaded[layer][iids] = True

    def invalidate(self, layer: int, iids: Sequence[int]) -> None:
        """Forget cached rows so the next read goes to RocksDB (after feature writes)."""
        if len(iids) and len(self._loaded[layer]):
            idx = np.asarray([i for i in iids if i < len(self._loaded[layer])], dtype=np.int64)
            self._loaded[layer][idx] = False

