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
from graph_state.idsets import unique_ids
from graph_state.store import GraphStore, RowBlock, grow_columns

__all__ = ["EmbeddingTables", "MetaTable", "EmbeddingMeta", "decode_final", "read_final_rows", "OutboxEntry", "encode_outbox", "decode_outbox"]

logger = logging.getLogger(__name__)

_META = keys.EMBMETA_HEAD  # version, event_ts; then the mode's length, the mode (ascii) and the row
_OUTBOX = struct.Struct(">BId")  # format, count, computed_at
_OUTBOX_FORMAT = 3


@dataclass(frozen=True, slots=True)
class EmbeddingMeta:
    version: int
    event_ts: float
    mode: str

    def encode(self, row: np.ndarray | None = None) -> bytes:
        """The ``embmeta`` value: this metadata and the final embedding (none for a withdrawn node)."""
        mode = self.mode.encode()
        tail = b"" if row is None else np.ascontiguousarray(row, dtype="<f4").tobytes()
        return _META.pack(self.version, self.event_ts) + bytes((len(mode),)) + mode + tail

    @classmethod
    def decode(cls, raw: bytes) -> "EmbeddingMeta":
        version, event_ts = _META.unpack_from(raw)
        n = raw[_META.size]
        return cls(version, event_ts, raw[_META.size + 1:_META.size + 1 + n].decode())


def decode_final(raw: bytes) -> tuple[EmbeddingMeta, np.ndarray | None]:
    """An ``embmeta`` value: the metadata and the final embedding (None for a withdrawn node)."""
    meta = EmbeddingMeta.decode(raw)
    at = _META.size + 1 + raw[_META.size]
    return meta, (np.frombuffer(raw, dtype="<f4", offset=at).copy() if len(raw) > at else None)


def read_final_rows(store: GraphStore, iids: Sequence[int] | np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The stored final embeddings of ``iids`` and a mask of which exist (zero rows where none is stored)."""
    out = np.zeros((len(iids), dim), dtype=np.float32)
    present = np.zeros(len(iids), dtype=bool)
    for row, raw in enumerate(store.column("embmeta").get([keys.encode_iid(int(i)) for i in iids])):
        if raw is not None:
            _, vec = decode_final(raw)
            if vec is not None:
                out[row], present[row] = vec, True
    return out, present


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """One embedding update to publish (``embedding`` None = node deleted)."""

    node: str
    version: int
    event_ts: float
    computed_at: float
    mode: str
    embedding: np.ndarray | None


def encode_outbox(iids: np.ndarray, computed_at: float) -> bytes:
    """One outbox record: the interned ids whose final embedding (or deletion) a recompute committed.

    The record names nodes only. The publisher sends each node's state as
    stored when it publishes, which is that commit's or a newer one: every
    message pairs a version with its own vector, and the newest version of a
    node is always among the messages sent. Layout: a header (format byte,
    count, computed_at) and the ids (u64 big-endian).
    """
    iids = np.asarray(iids, dtype=np.int64)
    return _OUTBOX.pack(_OUTBOX_FORMAT, len(iids), computed_at) + iids.astype(">u8").tobytes()


def decode_outbox(raw: bytes) -> tuple[float, np.ndarray]:
    """``(computed_at, iids)`` of one outbox record."""
    fmt, count, computed_at = _OUTBOX.unpack_from(raw)
    if fmt != _OUTBOX_FORMAT:
        raise ValueError(f"Expected outbox record format {_OUTBOX_FORMAT} (got {fmt})")
    return computed_at, np.frombuffer(raw, ">u8", count, _OUTBOX.size).astype(np.int64)


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
        if layer == len(self.dims) - 1:  # final rows live with their metadata
            return read_final_rows(self.store, iids, self.dims[layer])
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
            missing = unique_ids(missing)
            rows, present = self._read(layer, missing)
            self._rows[layer][missing] = rows
            self._present[layer][missing] = present
            self._loaded[layer][missing] = True
        return self._rows[layer][iids], self._present[layer][iids]

    def index(self, layer: int, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(table, positions)`` with ``table[positions[i]]`` the row of ``iids[i]`` (zeros where absent).

        The table is the cache itself when ``iids`` fit in it (no copy), else
        a fresh array of the requested rows.
        """
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids) and self._grow(layer, int(iids.max()) + 1):
            missing = iids[~self._loaded[layer][iids]]
            if len(missing):
                self.get(layer, missing)
            return self._rows[layer], iids
        rows, _ = self.get(layer, iids)
        return rows, np.arange(len(iids), dtype=np.int64)

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

    def invalidate(self, layer: int, iids: Sequence[int] | np.ndarray) -> None:
        """Forget cached rows so the next read goes to RocksDB (after feature writes)."""
        idx = np.asarray(iids, dtype=np.int64)
        if len(idx) and len(self._loaded[layer]):
            self._loaded[layer][idx[idx < len(self._loaded[layer])]] = False



class MetaTable:
    """Versions, event times and modes of the final embeddings, as arrays.

    A write-through cache of the ``embmeta`` column family for reading and
    updating thousands of nodes at once; unknown entries are read from
    RocksDB on first use. A node without stored metadata has version 0 and
    mode code -1.
    """

    def __init__(self, store: GraphStore):
        self.store = store
        self.names: list[str] = []
        self._codes: dict[str, int] = {}
        self.clear()

    def clear(self) -> None:
        self.version = np.zeros(0, dtype=np.int64)
        self.event_ts = np.zeros(0, dtype=np.float64)
        self.mode = np.zeros(0, dtype=np.int16)
        self.known = np.zeros(0, dtype=bool)

    def code(self, mode: str) -> int:
        """The small integer standing for ``mode`` in :attr:`mode`."""
        c = self._codes.get(mode)
        if c is None:
            c = self._codes[mode] = len(self.names)
            self.names.append(mode)
        return c

    def _grow(self, size: int) -> None:
        have = grow_columns(self, ("version", "event_ts", "mode", "known"), size)
        if have is not None:
            self.mode[have:] = -1

    def get(self, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(version, event_ts, mode code)`` of ``iids``."""
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids) == 0:
            return self.version[:0].copy(), self.event_ts[:0].copy(), self.mode[:0].copy()
        self._grow(int(iids.max()) + 1)
        missing = unique_ids(iids[~self.known[iids]])
        if len(missing):
            raws = self.store.column("embmeta").get([keys.encode_iid(i) for i in missing.tolist()])
            for iid, raw in zip(missing.tolist(), raws):
                if raw is None:
                    self.version[iid], self.event_ts[iid], self.mode[iid] = 0, 0.0, -1
                else:
                    meta = EmbeddingMeta.decode(raw)
                    self.version[iid], self.event_ts[iid] = meta.version, meta.event_ts
                    self.mode[iid] = self.code(meta.mode)
            self.known[missing] = True
        return self.version[iids], self.event_ts[iids], self.mode[iids]

    def set(self, iids: np.ndarray, version: np.ndarray, event_ts: np.ndarray, mode: np.ndarray) -> None:
        """Record new metadata (the caller writes RocksDB)."""
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids) == 0:
            return
        self._grow(int(iids.max()) + 1)
        self.version[iids], self.event_ts[iids], self.mode[iids] = version, event_ts, mode
        self.known[iids] = True

    def encode(self, iids: np.ndarray, rows: np.ndarray | None) -> list[RowBlock]:
        """The ``embmeta`` writes of ``iids``: metadata as currently held plus the final rows (None: withdrawn)."""
        iids = np.asarray(iids, dtype=np.int64)
        codes = self.mode[iids]
        blocks = []
        for code in unique_ids(codes).tolist():
            pick = codes == code
            ids = iids[pick]
            tail = self.names[code].encode()
            fields = [("v", ">u8"), ("t", ">f8"), ("n", "u1"), ("m", f"S{len(tail)}")]
            if rows is not None:
                fields.append(("r", "<f4", (rows.shape[1],)))
            rec = np.empty(len(ids), dtype=fields)
            rec["v"], rec["t"], rec["n"], rec["m"] = self.version[ids], self.event_ts[ids], len(tail), tail
            if rows is not None:
                rec["r"] = rows[pick]
            blocks.append(RowBlock("embmeta", ids.astype(">u8"), 8, rec, rec.dtype.itemsize))
        return blocks
