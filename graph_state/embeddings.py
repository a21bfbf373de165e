"""Per-layer node embeddings: RocksDB-backed tables with a dense in-memory cache.

Layer 0 is the input (node features, zeros for a node without features);
layer ``l >= 1`` is ``h^l``, kept in a page log per layer (:class:`MetaTable`:
page records in RocksDB, rows in frames of a row file). Rows are addressed by
interned node id. The cache is write-through (rows reach the log in the
recompute's WriteBatch) and bounded: past ``max_rows`` nodes it is dropped and
rebuilt lazily from the logs.
"""

from __future__ import annotations

import heapq
import logging
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from gnnstream.graph_state import keys
from gnnstream.graph_state.idsets import unique_ids
from gnnstream.graph_state.prefixes import grow_columns
from gnnstream.graph_state.store import GraphStore

__all__ = ["EmbeddingTables", "MetaTable", "EmbeddingMeta", "FrameReused", "read_final_rows",
           "layer_logs_from", "encode_pages",
           "decode_page", "PAGE_ROWS", "encode_outbox", "decode_outbox"]

logger = logging.getLogger(__name__)

_OUTBOX = struct.Struct(">BId")  # format, count, computed_at
_OUTBOX_FORMAT = 3
_PAGE_HEAD = struct.Struct(">BBIHB")  # format, has rows, count, row width, number of modes
_PAGE_FORMAT = 2  # rows in a frame of the row file, the record names the frame
_FRAME = struct.Struct(">QQ")  # frame, sum of the rows' 32-bit words
_GROWTH_DIVISOR = 4  # a row file grows by at least a quarter of its size at a time
PAGE_ROWS = 128  # records per page of the final-embedding log (64 KB of rows at 128 dims)
# compaction keeps the superseded slots of a log within 1 / SUPERSEDED_SHARE of its live records (plus gc_slack):
# the row files then stop growing soon after a backfill, and later rows reuse the frames compaction frees
SUPERSEDED_SHARE = 4


class FrameReused(RuntimeError):
    """A reader found a frame holding other rows than its page names: it must catch up and read again."""


@dataclass(frozen=True, slots=True)
class EmbeddingMeta:
    version: int
    event_ts: float
    mode: str


def layer_logs_from(store: GraphStore, first: int) -> list[tuple[str, bytes, None]]:
    """Deletions of every record of the hidden-row logs of layers ``first`` and up (``layerpages``), for a
    :class:`~graph_state.transaction.Transaction`: what a model with fewer layers leaves behind."""
    return [("layerpages", key, None) for key in store.column("layerpages").keys(from_key=bytes((first,)))]


def read_final_rows(store: GraphStore, iids: Sequence[int] | np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The stored final embeddings of ``iids`` (from the page log and its row file) and a mask of which exist
    (zero rows elsewhere)."""
    return MetaTable(store).rows(np.asarray(iids, dtype=np.int64), dim)


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
        store: the graph store (owner of the features).
        dims: the row width of each layer, ``dims[0]`` being the feature dim.
        logs: where the rows of layers ``1 … L`` are stored, by layer (the engine's
            :class:`MetaTable` s; the last one also holds versions and modes).
        max_rows: bound on the number of cached rows per layer.
    """

    def __init__(self, store: GraphStore, dims: Sequence[int], logs: "dict[int, MetaTable]", max_rows: int = 4_000_000):
        self.store = store
        self.logs = logs
        self.dims = list(dims)
        self.max_rows = max_rows
        self._rows: list[np.ndarray] = [np.zeros((0, d), dtype=np.float32) for d in self.dims]
        self._loaded: list[np.ndarray] = [np.zeros(0, dtype=bool) for _ in self.dims]
        self._present: list[np.ndarray] = [np.zeros(0, dtype=bool) for _ in self.dims]
        # by layer, projections of the cached rows (:meth:`projected`): (first and second stacked, which are current)
        self._proj: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def clear(self) -> None:
        self._rows = [np.zeros((0, d), dtype=np.float32) for d in self.dims]
        self._loaded = [np.zeros(0, dtype=bool) for _ in self.dims]
        self._present = [np.zeros(0, dtype=bool) for _ in self.dims]
        self._proj.clear()

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
        self._proj.pop(layer, None)
        return True

    def _read(self, layer: int, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if layer == 0:
            return self.store.feature_rows(iids.tolist(), self.dims[0])
        return self.logs[layer].rows(iids, self.dims[layer])

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
            self._stale(layer, missing)
        return self._rows[layer][iids], self._present[layer][iids]

    def cached(self, layer: int, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``iids`` held in memory and a mask of which are (nothing is read)."""
        iids = np.asarray(iids, dtype=np.int64)
        have = len(self._loaded[layer])
        inside = iids < have
        held = np.zeros(len(iids), dtype=bool)
        held[inside] = self._loaded[layer][iids[inside]] & self._present[layer][iids[inside]]
        rows = np.zeros((len(iids), self.dims[layer]), dtype=np.float32)
        rows[held] = self._rows[layer][iids[held]]
        return rows, held

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

    def held(self, layer: int, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`index` and a mask of which rows exist: ``(table, positions, present)``."""
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids) and self._grow(layer, int(iids.max()) + 1):
            table, pos = self.index(layer, iids)  # the cache itself
            return table, pos, self._present[layer][iids]
        rows, present = self.get(layer, iids)
        return rows, np.arange(len(iids), dtype=np.int64), present

    def projected(self, layer: int, iids: np.ndarray, project: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
                  ) -> tuple[np.ndarray, np.ndarray, int]:
        """``(table, positions, half)``: ``project``'s two outputs for the rows of ``iids`` at ``layer``,
        stacked in one table: ``table[positions[i]]`` is the first of ``iids[i]``, ``table[half + positions[i]]``
        its second.

        Projections are kept beside the cache and computed again only for
        rows set, loaded or invalidated since, so a layer whose inputs barely
        change costs no matrix product per target (``project`` must map each
        row on its own, like a linear layer).
        """
        table, pos = self.index(layer, iids)
        if table is not self._rows[layer]:  # beyond the bound: nothing is kept
            return np.concatenate(project(table)), pos, len(table)
        held = self._proj.get(layer)
        stale = unique_ids(pos[~held[1][pos]]) if held is not None else unique_ids(pos)
        if len(stale):
            first, second = project(table[stale])
            held = self._held_projections(layer, first.shape[1])
            held[0][stale], held[0][len(table) + stale] = first, second
            held[1][stale] = True
        return held[0], pos, len(table)

    def _held_projections(self, layer: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        held = self._proj.get(layer)
        if held is None:
            size = len(self._rows[layer])
            held = self._proj[layer] = (np.zeros((2 * size, width), dtype=np.float32), np.zeros(size, dtype=bool))
        return held

    def _stale(self, layer: int, iids: np.ndarray) -> None:
        held = self._proj.get(layer)
        if held is not None:
            held[1][iids] = False

    def set(self, layer: int, iids: np.ndarray, rows: np.ndarray | None) -> None:
        """Update cached rows of distinct ``iids`` (``rows`` None removes them); the caller writes RocksDB."""
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids) == 0 or not self._grow(layer, int(iids.max()) + 1):
            return
        self._stale(layer, iids)
        if rows is None:
            self._rows[layer][iids] = 0
            self._present[layer][iids] = False
        else:  # torch's row copy runs on both cores; it reads rows while it writes, so never from the table itself
            table = self._rows[layer]
            rows = np.ascontiguousarray(rows, dtype=np.float32)
            if np.may_share_memory(rows, table):
                rows = rows.copy()
            torch.from_numpy(table).index_copy_(0, torch.from_numpy(iids), torch.from_numpy(rows))
            self._present[layer][iids] = True
        self._loaded[layer][iids] = True

    def invalidate(self, layer: int, iids: Sequence[int] | np.ndarray) -> None:
        """Forget cached rows so the next read goes to RocksDB (after feature writes)."""
        idx = np.asarray(iids, dtype=np.int64)
        if len(idx) and len(self._loaded[layer]):
            idx = idx[idx < len(self._loaded[layer])]
            self._loaded[layer][idx] = False
            self._stale(layer, idx)



class MetaTable:
    """Versions, event times, modes and final rows of every node, kept in a page log.

    A recompute changes the final embedding of tens of thousands of nodes;
    one RocksDB record per node made the write cost about 2 µs a node. The
    final rows are therefore stored in *pages* (``embpages``: page sequence
    number -> up to :data:`PAGE_ROWS` records of iid, version, event time
    and mode, and the frame holding their rows), written in the recompute's
    WriteBatch. The newest page holding a node is its current state; an
    in-memory index (page, slot per node) and the metadata arrays are
    rebuilt from one scan of the log on first use. A page whose records
    were all superseded is deleted in the batch that supersedes the last
    one, and when superseded slots exceed a :data:`SUPERSEDED_SHARE` of the
    live ones (plus ``gc_slack``), :meth:`compact` moves the sparsest pages'
    live records into new pages, so the log stays within about 1.25 times
    the live size.

    The rows of a page sit in a fixed-size *frame* of the row file
    (``final-rows-<width>.f32`` in the store's directory), not in RocksDB:
    they are most of a recompute's bytes, and RocksDB checksums every byte
    of its log, flushes and compactions in software. A frame is written
    (into the OS page cache, like RocksDB's log) before the WriteBatch
    that points a page at it, and only while no stored page points at it:
    a new frame, or one whose page's deletion has been written (the caller
    reports each written batch with :meth:`committed`). A process killed
    at any moment therefore leaves every stored page pointing at the rows
    it was written with, and frames written for a batch that never landed
    are free again on the next load.

    A node without stored metadata has version 0 and mode code -1.

    The same log keeps the rows of an intermediate layer (``layerpages``,
    keys prefixed with the layer; its metadata columns are left unused):
    see :meth:`put_rows`.

    Args:
        store: the graph store (owner of the ``embpages`` column family).
        gc_slack: superseded slots tolerated beyond the live count.
        family: the column family of the page records.
        prefix: the key prefix of this log's pages in ``family``.
        rows_name: the row files' name, ``<rows_name>-<width>.f32``.
    """

    def __init__(self, store: GraphStore, gc_slack: int = 1 << 16, *, family: str = "embpages", prefix: bytes = b"",
                 rows_name: str = "final-rows"):
        self.store = store
        self.gc_slack = gc_slack
        self.family = family
        self.prefix = prefix
        self.rows_name = rows_name
        # final rows held in memory, ``(rows, held mask) = row_cache(iids)``: records moved out of sparse
        # pages take their rows from here instead of reading the pages
        self.row_cache: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None
        self.names: list[str] = []
        self._codes: dict[str, int] = {}
        self.clear()

    def clear(self) -> None:
        """Forget everything held; the next use reads the log again."""
        self.version = np.zeros(0, dtype=np.int64)
        self.event_ts = np.zeros(0, dtype=np.float64)
        self.mode = np.zeros(0, dtype=np.int16)
        self.page = np.zeros(0, dtype=np.int64)
        self.slot = np.zeros(0, dtype=np.int32)
        self.has_row = np.zeros(0, dtype=bool)
        self._size: dict[int, int] = {}  # slots of every stored page
        self._live: dict[int, int] = {}  # current records of every stored page
        self._slots = 0
        self._next_page = 0
        self._dim = 0  # width of the stored rows
        self._dead: list[int] = []
        self._frame_of: dict[int, tuple[int, int]] = {}  # page -> (row width, frame) of pages with framed rows
        self._sum_of: dict[int, int] = {}  # page -> the sum its record holds of its rows (row_sums)
        self._unreadable: set[int] = set()  # pages damaged() could not read: rows() holds none for them
        for file in getattr(self, "_files", {}).values():
            file.close()
        self._files: dict[int, _FrameFile] = {}  # by row width
        self._recent: set[int] = set()  # pages written since the last compact, and their records
        self._recent_rows = 0
        self._loaded = False

    def code(self, mode: str) -> int:
        """The small integer standing for ``mode`` in :attr:`mode`."""
        c = self._codes.get(mode)
        if c is None:
            c = self._codes[mode] = len(self.names)
            self.names.append(mode)
        return c

    def _grow(self, size: int) -> None:
        have = grow_columns(self, ("version", "event_ts", "mode", "page", "slot", "has_row"), size)
        if have is not None:
            self.mode[have:] = -1
            self.page[have:] = -1

    # ------------------------------------------------------------------ the log
    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for seq, raw in self._pages():
            self._take(seq, raw)
        seqs, counts = _counts(self.page[self.page >= 0])
        self._live = dict(zip(seqs.tolist(), counts.tolist()))
        self._dead = [seq for seq in self._size if seq not in self._live]  # deleted with the next write
        used: dict[int, list[int]] = {}
        for width, frame in self._frame_of.values():
            used.setdefault(width, []).append(frame)
        for width, frames in used.items():
            self._file(width).start(frames)

    def _take(self, seq: int, raw: bytes) -> np.ndarray:
        """Index a stored page: its records become the current state of their nodes; returns the pages that
        held them before (-1: none)."""
        rec, modes, has_rows = decode_page(raw)
        ids = rec["iid"].astype(np.int64)
        self._size[seq] = len(ids)
        self._slots += len(ids)
        if has_rows:
            self._dim = int(rec["width"])
            self._frame_of[seq] = (self._dim, int(rec["frame"]))
            self._sum_of[seq] = int(rec["sum"])
        self._next_page = seq + 1
        if not len(ids):
            return ids
        self._grow(int(ids.max()) + 1)
        before = self.page[ids]
        codes = np.asarray([self.code(m) for m in modes], dtype=np.int16)
        self.version[ids], self.event_ts[ids], self.mode[ids] = rec["version"], rec["event_ts"], codes[rec["mode"]]
        self.page[ids], self.slot[ids], self.has_row[ids] = seq, np.arange(len(ids), dtype=np.int32), has_rows
        return before

    def follow(self) -> None:
        """A reader of a log another process writes: index the pages it added since the last call.

        Pages are numbered in the order they were written and the newest page
        holding a node is its current state, so the new pages alone bring
        every node up to date; a page left without current records is
        forgotten, as the writer deleted it.
        """
        if not self._loaded:
            self._load()
            return
        at = len(self.prefix)
        for key, raw in self.store.column(self.family).items(from_key=self._key(self._next_page)):
            if not key.startswith(self.prefix):
                break
            seq = keys.decode_iid(key[at:])
            old = self._take(seq, raw)
            self._live[seq] = self._size[seq]
            for page in self._superseded(old):  # the writer deleted it: forget it here too
                self._forget_page(page)

    def damaged(self) -> np.ndarray:
        """The iids whose current page's frame no longer holds the rows the page was written with; recompute
        them. Reads every live frame.

        A killed process leaves the frames right (they are in the page
        cache); an operating-system crash or power loss may not, since the
        row files are not synced with RocksDB's log: a frame can still hold
        zeros or the rows of the page that used it before. The sums catch
        that.
        """
        self._load()
        bad: list[int] = []
        with _Readers() as files:
            for seq in self._live:
                framed = self._frame_of.get(seq)
                if framed is None:  # a page without rows
                    continue
                try:
                    rows = self._file(framed[0]).read(framed[1], self._size[seq], files)
                except OSError:  # a row file shorter than its pages need, or gone (a copy made files first)
                    bad.append(seq)
                    self._unreadable.add(seq)
                    continue
                if int(row_sums(rows)[0]) != self._sum_of[seq]:
                    bad.append(seq)
        if not bad:
            return np.zeros(0, dtype=np.int64)
        logger.warning("%s%s: %d pages whose rows do not match their records (an operating-system crash?)",
                       self.family, self.prefix.hex(), len(bad))
        return np.flatnonzero(np.isin(self.page, np.asarray(bad, dtype=np.int64)) & self.has_row).astype(np.int64)

    def _key(self, seq: int) -> bytes:
        return self.prefix + keys.encode_iid(seq)

    def _pages(self) -> Iterator[tuple[int, bytes]]:
        """``(seq, value)`` of every stored page of this log, in page order.

        The scan is the store's checked one (:class:`graph_state.db.Family`): a damaged block of the
        page records raises :class:`~graph_state.exceptions.StateCorrupted` instead of ending the log
        early, which would leave every later node without its embedding.
        """
        at = len(self.prefix)
        for key, raw in self.store.column(self.family).items(from_key=self.prefix):
            if not key.startswith(self.prefix):
                break
            yield keys.decode_iid(key[at:]), raw

    def _file(self, width: int) -> "_FrameFile":
        file = self._files.get(width)
        if file is None:
            file = self._files[width] = _FrameFile(os.path.join(self.store.path, f"{self.rows_name}-{width}.f32"),
                                                   width)
        return file

    def _forget_page(self, seq: int) -> tuple[int, int] | None:
        """Drop a page from the index; the ``(row width, frame)`` it held rows in, if any."""
        self._slots -= self._size.pop(seq)
        self._sum_of.pop(seq, None)
        self._unreadable.discard(seq)
        return self._frame_of.pop(seq, None)

    def _drop_page(self, seq: int, puts: list) -> None:
        """Delete a stored page; its frame is free once that deletion is written."""
        puts.append((self.family, self._key(seq), None))
        framed = self._forget_page(seq)
        if framed is not None:
            self._file(framed[0]).release(framed[1])

    def committed(self) -> None:
        """The writes returned so far are stored: frames of the pages they deleted may be reused."""
        for file in self._files.values():
            file.committed()

    def live(self) -> int:
        """Nodes with stored metadata (withdrawn ones included)."""
        self._load()
        return sum(self._live.values())

    def stored_slots(self) -> int:
        """Records in the log, superseded ones included."""
        self._load()
        return self._slots

    def get(self, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(version, event_ts, mode code)`` of ``iids``."""
        self._load()
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids):
            self._grow(int(iids.max()) + 1)
        return self.version[iids], self.event_ts[iids], self.mode[iids]

    def set(self, iids: np.ndarray, version: np.ndarray, event_ts: np.ndarray, mode: np.ndarray) -> None:
        """Record new metadata; :meth:`encode` then writes it."""
        self._load()
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids) == 0:
            return
        self._grow(int(iids.max()) + 1)
        self.version[iids], self.event_ts[iids], self.mode[iids] = version, event_ts, mode

    def encode(self, iids: np.ndarray, rows: np.ndarray | None) -> list[tuple[str, bytes, bytes | None]]:
        """The log writes storing ``iids`` (distinct) as currently held, with their final rows (None: withdrawn).

        The index moves to the new pages at once: if the caller's write
        fails, it must :meth:`clear` this table.
        """
        self._load()
        iids = np.asarray(iids, dtype=np.int64)
        puts: list[tuple[str, bytes, bytes | None]] = []
        if not len(iids):
            return puts
        for seq in self._dead:
            self._drop_page(seq, puts)
        self._dead = []
        old = self.page[iids]
        self._append(puts, iids, self.version[iids], self.event_ts[iids], self.mode[iids], rows)
        self._release(old, puts)
        return puts

    def put_rows(self, iids: np.ndarray, rows: np.ndarray | None) -> list[tuple[str, bytes, bytes | None]]:
        """:meth:`encode` for a log of rows alone (an intermediate layer): ``rows`` None removes them."""
        iids = np.asarray(iids, dtype=np.int64)
        if not len(iids):
            return []
        self.set(iids, np.zeros(len(iids), dtype=np.int64), np.zeros(len(iids)), np.full(len(iids), self.code(""),
                                                                                            dtype=np.int16))
        return self.encode(iids, rows)

    def compact(self) -> list[tuple[str, bytes, bytes | None]]:
        """The log writes moving the live records of the sparsest pages into new pages, while superseded
        slots exceed a :data:`SUPERSEDED_SHARE` of the live ones plus ``gc_slack``; at most as many records
        as were encoded since the last call (at least a page's worth) move.

        Call it after the last :meth:`encode` of a WriteBatch: moved records
        are written as held in memory (rows from :attr:`row_cache` where it
        has them), so no node may have metadata set but not yet encoded.
        """
        self._load()
        puts: list[tuple[str, bytes, bytes | None]] = []
        recent, self._recent = self._recent, set()
        budget, self._recent_rows = max(self._recent_rows, PAGE_ROWS), 0
        live = sum(self._live.values())
        excess = self._slots - live - live // SUPERSEDED_SHARE - self.gc_slack
        if excess <= 0:
            return puts
        # the sparsest pages first (then the oldest), while the moves fit the budget and until enough is freed
        n = len(self._live)
        seqs = np.fromiter(self._live.keys(), np.int64, n)
        live = np.fromiter(self._live.values(), np.int64, n)
        size = np.fromiter(map(self._size.__getitem__, self._live.keys()), np.int64, n)
        old = ~np.isin(seqs, np.fromiter(recent, np.int64, len(recent)))
        seqs, live, size = seqs[old], live[old], size[old]
        order = np.lexsort((seqs, live / size))
        moved, freed = np.cumsum(live[order]), np.cumsum(size[order] - live[order])
        freed_before = np.concatenate([[0], freed[:-1]])
        stop = np.flatnonzero((freed_before >= excess) | (moved > budget))
        chosen = seqs[order[:stop[0] if len(stop) else len(order)]]
        if not len(chosen):
            return puts
        chosen = chosen.tolist()
        picked = np.zeros(self._next_page + 1, dtype=bool)  # by page; the last entry stands for "no page" (-1)
        picked[chosen] = True
        ids = np.flatnonzero(picked[self.page])
        with_rows = self.has_row[ids]
        for has_rows in (False, True):  # the moved records fill new pages
            part = ids[with_rows == has_rows]
            if not len(part):
                continue
            rows = None
            if has_rows:
                rows, cached = self.row_cache(part) if self.row_cache else (None, np.zeros(len(part), dtype=bool))
                if not cached.all():
                    stored, _ = self.rows(part[~cached], self._dim)
                    rows = stored if rows is None else rows
                    rows[~cached] = stored
            self._append(puts, part, self.version[part], self.event_ts[part], self.mode[part], rows)
        for seq in chosen:
            del self._live[seq]
            self._drop_page(seq, puts)
        self._recent, self._recent_rows = set(), 0
        return puts

    def _append(self, puts: list, iids: np.ndarray, version: np.ndarray, event_ts: np.ndarray, codes: np.ndarray,
                rows: np.ndarray | None) -> None:
        frames = sums = None
        if rows is not None:
            self._dim = rows.shape[1]
            rows = np.ascontiguousarray(rows, dtype="<f4")
            frames = self._file(self._dim).write(rows)
            sums = row_sums(rows)
        first = self._next_page
        position = np.arange(len(iids), dtype=np.int64)
        self.page[iids] = first + position // PAGE_ROWS
        self.slot[iids] = (position % PAGE_ROWS).astype(np.int32)
        self.has_row[iids] = rows is not None
        for n, (ids, value) in enumerate(zip(*encode_pages(iids, version, event_ts, codes, self.names,
                                                           0 if rows is None else self._dim, frames,
                                                           sums if frames is not None else None))):
            seq = first + n
            puts.append((self.family, self._key(seq), value))
            if frames is not None:
                self._frame_of[seq] = (self._dim, frames[n])
                self._sum_of[seq] = sums[n]
            self._size[seq] = self._live[seq] = len(ids)
            self._recent.add(seq)
        self._slots += len(iids)
        self._next_page = first + -(-len(iids) // PAGE_ROWS)
        self._recent_rows += len(iids)

    def _release(self, pages: np.ndarray, puts: list) -> None:
        """Records of ``pages`` were superseded: delete the pages left without a current record."""
        for seq in self._superseded(pages):
            self._drop_page(seq, puts)

    def _superseded(self, pages: np.ndarray) -> list[int]:
        """One record of each of ``pages`` (-1: none) was superseded: the pages left without a current record
        (no longer counted live)."""
        seqs, counts = _counts(pages[pages >= 0])
        if not len(seqs):
            return []
        seqs_list = seqs.tolist()
        left = np.fromiter(map(self._live.__getitem__, seqs_list), np.int64, len(seqs_list)) - counts
        self._live.update(zip(seqs_list, left.tolist()))
        empty = seqs[left == 0].tolist()
        for seq in empty:
            del self._live[seq]
        return empty

    # ------------------------------------------------------------------ reading rows
    def rows(self, iids: np.ndarray, dim: int, *, checked: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The rows (``dim`` wide) of ``iids`` as held now, encoded but not yet written ones included, and a
        mask of which exist (zeros where none is held).

        ``checked``: compare each frame read with the sum its page records, and raise
        :class:`FrameReused` where they differ (a reader behind the writer, which reused the frame since).
        """
        self._load()
        iids = np.asarray(iids, dtype=np.int64)
        out = np.zeros((len(iids), dim), dtype=np.float32)
        present = np.zeros(len(iids), dtype=bool)
        if not len(iids):
            return out, present
        self._grow(int(iids.max()) + 1)
        pages = np.where(self.has_row[iids], self.page[iids], -1)
        order = np.argsort(pages, kind="stable")
        sorted_pages = pages[order]
        seqs = unique_ids(sorted_pages[sorted_pages >= 0])
        bounds = np.searchsorted(sorted_pages, seqs, side="left")
        ends = np.searchsorted(sorted_pages, seqs, side="right")
        with _Readers() as files:
            for lo, hi, seq in zip(bounds.tolist(), ends.tolist(), seqs.tolist()):
                framed = self._frame_of[seq]
                if seq in self._unreadable:  # damaged, to be rewritten: none held
                    continue
                self._check_width(seq, framed[0], dim)
                at = order[lo:hi]
                block = self._file(framed[0]).read(framed[1], self._size[seq], files)
                if checked and int(row_sums(block)[0]) != self._sum_of[seq]:
                    raise FrameReused(f"frame {framed[1]} of page {seq} was written again since this reader's view")
                out[at] = block[self.slot[iids[at]]]
                present[at] = True
        return out, present

    def _check_width(self, seq: int, width: int, dim: int) -> None:
        if width != dim:
            raise ValueError(f"page {seq} of {self.family!r} holds rows {width} wide, not {dim}: the store was "
                             f"written by another model; run a backfill")

    def held(self, iids: np.ndarray) -> np.ndarray:
        """Which of ``iids`` have a row here (written or encoded)."""
        self._load()
        iids = np.asarray(iids, dtype=np.int64)
        inside = iids < len(self.page)
        out = np.zeros(len(iids), dtype=bool)
        out[inside] = self.has_row[iids[inside]] & (self.page[iids[inside]] >= 0)
        return out

    def held_iids(self) -> np.ndarray:
        """Every iid with a row here."""
        self._load()
        return np.flatnonzero(self.has_row & (self.page >= 0)).astype(np.int64)

    def files_in_use(self) -> set[str]:
        """Paths of the row files that pages of this table point into."""
        self._load()
        widths = {width for width, _ in self._frame_of.values()}
        return {self._file(width).path for width in widths}

    def _page_rows(self, rec: dict[str, np.ndarray], files: "_Readers") -> np.ndarray:
        """The rows of a decoded page with rows (read from its frame, the file opened once per ``files``)."""
        return self._file(int(rec["width"])).read(int(rec["frame"]), len(rec["iid"]), files)

    def items(self) -> Iterator[tuple[int, EmbeddingMeta, np.ndarray | None]]:
        """Every stored node in page order: ``(iid, metadata, final row or None once withdrawn)``."""
        self._load()
        with _Readers() as files:
            for seq, raw in self._pages():
                if seq not in self._live:
                    continue
                rec, modes, has_rows = decode_page(raw)
                ids = rec["iid"].astype(np.int64)
                rows = self._page_rows(rec, files) if has_rows else None
                for slot in np.flatnonzero((self.page[ids] == seq) & (self.slot[ids] == np.arange(len(ids)))).tolist():
                    meta = EmbeddingMeta(int(rec["version"][slot]), float(rec["event_ts"][slot]),
                                         modes[int(rec["mode"][slot])])
                    yield int(ids[slot]), meta, (rows[slot].copy() if rows is not None else None)


class _Readers:
    """Read-only descriptors of row files, each opened on first use; all closed on exit."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def __enter__(self) -> "_Readers":
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)


class _FrameFile:
    """Fixed-size frames of float32 rows (:data:`PAGE_ROWS` rows of one width) in one file.

    Frames are handed out lowest first among the free ones, so the frames
    in use stay about as many as the pages that point into them. The file
    grows by at least a fraction (1 / :data:`_GROWTH_DIVISOR`) of its size
    at a time, so it is mapped again only that often, and holds at most
    that fraction more than the frames in use. Which frames are in use is
    known from the page records alone (:meth:`start`).
    """

    def __init__(self, path: str, width: int):
        self.path = path
        self.row_bytes = width * 4
        self.frame_bytes = PAGE_ROWS * self.row_bytes
        self._free: list[int] = []  # a heap
        self._pending: list[int] = []  # released by writes not yet reported stored
        self._next = 0
        self._map: mmap.mmap | None = None
        self._fd: int | None = None
        self._frames: np.ndarray | None = None  # the mapped file, [frame, row, column]
        self._mapped = np.zeros(0, dtype=bool)  # by frame: written (either way) since the file was first mapped

    def start(self, used: list[int]) -> None:
        """The frames stored pages point at; every other one below the highest is free."""
        self._next = max(used) + 1 if used else 0
        taken = np.zeros(self._next, dtype=bool)
        taken[used] = True
        self._free = np.flatnonzero(~taken).tolist()  # ascending: already a heap
        self._pending = []

    def release(self, frame: int) -> None:
        self._pending.append(frame)

    def committed(self) -> None:
        for frame in self._pending:
            heapq.heappush(self._free, frame)
        self._pending = []

    def write(self, rows: np.ndarray) -> list[int]:
        """Store ``rows`` :data:`PAGE_ROWS` to a frame; return the frames used.

        A frame already written since the file was first mapped (growing
        the file maps it again and keeps that record) is written through
        the shared mapping: its pages are in the page cache, so the copy
        costs no system call. Any other frame is written with ``pwrite``,
        which is cheaper than faulting in pages of a fresh (or evicted)
        part of the file one by one. Either way the rows are in the OS page
        cache, where RocksDB's log is too.
        """
        full, rest = divmod(len(rows), PAGE_ROWS)
        count = full + bool(rest)
        view = self._view(self._next + max(0, count - len(self._free)))  # may fail: nothing is taken yet
        frames = [heapq.heappop(self._free) if self._free else self._new() for _ in range(count)]
        chunks = np.asarray(frames, dtype=np.int64)
        mapped = self._mapped[chunks]
        for i in np.flatnonzero(mapped[:full]).tolist():  # frame by frame: no temporary copy of the rows
            view[frames[i]] = rows[i * PAGE_ROWS:(i + 1) * PAGE_ROWS]
        for i in np.flatnonzero(~mapped).tolist():
            chunk = rows[i * PAGE_ROWS:(i + 1) * PAGE_ROWS]
            if os.pwrite(self._fd, chunk, frames[i] * self.frame_bytes) != chunk.nbytes:
                raise OSError(f"short write to row file {self.path!r} (frame {frames[i]})")
        if rest and mapped[-1]:
            view[frames[-1], :rest] = rows[full * PAGE_ROWS:]
        self._mapped[chunks[~mapped]] = True  # pwrite left them in the page cache: the mapping takes them over
        return frames

    def _new(self) -> int:
        self._next += 1
        return self._next - 1

    def _view(self, frames: int) -> np.ndarray:
        """The file as ``[frame, row, column]`` float32, mapped and grown to hold at least ``frames`` frames."""
        if self._frames is None or len(self._frames) < frames:
            held = len(self._frames) if self._frames is not None else 0  # read before close() drops it
            written = self._mapped[:held]
            self.close()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                have = os.fstat(fd).st_size // self.frame_bytes
                size = max(have, frames, held + held // _GROWTH_DIVISOR, 16)
                if size > have:  # blocks reserved now: a full disk is an OSError here, not a SIGBUS on a later write
                    os.posix_fallocate(fd, 0, size * self.frame_bytes)
                self._map = mmap.mmap(fd, size * self.frame_bytes)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            self._frames = np.frombuffer(self._map, dtype="<f4").reshape(size, PAGE_ROWS, self.row_bytes // 4)
            self._mapped = np.zeros(size, dtype=bool)
            kept = min(held, size)
            self._mapped[:kept] = written[:kept]  # grown, not reopened: what was written is in the page cache still
        return self._frames

    def close(self) -> None:
        """Unmap the file (written rows stay in the page cache and reach the file)."""
        self._frames = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a failed write's frame (in its traceback) still holds a view: unmapped when freed
                pass
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read(self, frame: int, count: int, files: "_Readers") -> np.ndarray:
        """The first ``count`` rows of ``frame``."""
        size = count * self.row_bytes
        data = os.pread(files.fd(self.path), size, frame * self.frame_bytes)
        if len(data) != size:
            raise OSError(f"row file {self.path!r} ends inside frame {frame} (a page points at rows it does not hold)")
        return np.frombuffer(data, dtype="<f4").reshape(count, -1)


def row_sums(rows: np.ndarray) -> list[int]:
    """The sum of the 32-bit words of each :data:`PAGE_ROWS` rows (a page's frame), modulo 2^64."""
    words = np.ascontiguousarray(rows, dtype="<f4").view("<u4")
    full = len(words) // PAGE_ROWS
    sums = words[:full * PAGE_ROWS].reshape(full, -1).sum(axis=1, dtype=np.uint64).tolist() if full else []
    if len(words) > full * PAGE_ROWS:
        sums.append(int(words[full * PAGE_ROWS:].sum(dtype=np.uint64)))
    return sums


def _counts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a 1-D int array (sorted) and how often each occurs."""
    s = np.sort(np.asarray(values, dtype=np.int64))
    if not len(s):
        return s, s
    starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
    return s[starts], np.diff(np.append(starts, len(s)))


_COLUMNS = (("iid", ">u8"), ("version", ">u8"), ("event_ts", ">f8"), ("mode", "u1"))


def encode_pages(iids: np.ndarray, version: np.ndarray, event_ts: np.ndarray, codes: np.ndarray,
                 names: Sequence[str], width: int, frames: Sequence[int] | None,
                 sums: Sequence[int] | None = None) -> tuple[list[np.ndarray], list[bytes]]:
    """``embpages`` values for these records, :data:`PAGE_ROWS` a page: ``(iids of each page, values)``.

    A value is a header, the modes it uses, then its records column by
    column. Header: format >B, has rows >B, count >I, row width >H, number
    of modes >B, each mode as length >B + ascii. Columns: iid >Q, version >Q,
    event_ts >d, mode (index into the page's modes) >B; when the page has
    rows (``frames`` given, one per page), the frame of the row file holding
    them >Q (float32[count, width] little-endian at the frame's start) and
    the sum of those rows' 32-bit words modulo 2^64 >Q (``sums``,
    :func:`row_sums`).
    """
    used = unique_ids(codes)
    modes = b"".join(bytes((len(m),)) + m for m in (names[c].encode() for c in used.tolist()))
    columns = [np.asarray(iids).astype(">u8"), np.asarray(version).astype(">u8"), np.asarray(event_ts).astype(">f8"),
               np.searchsorted(used, codes).astype("u1")]
    pages, values = [], []

    def header(count: int) -> bytes:
        return _PAGE_HEAD.pack(_PAGE_FORMAT, frames is not None, count, width if frames is not None else 0, len(used))

    full, rest = divmod(len(iids), PAGE_ROWS)
    if full:  # the full pages share one layout: build them as the rows of one byte matrix
        head = header(PAGE_ROWS)
        parts = [np.broadcast_to(np.frombuffer(head + modes, np.uint8), (full, len(head) + len(modes)))]
        parts += [c[:full * PAGE_ROWS].reshape(full, PAGE_ROWS).view(np.uint8) for c in columns]
        if frames is not None:
            tail = np.empty((full, 2), dtype=">u8")
            tail[:, 0], tail[:, 1] = frames[:full], sums[:full]
            parts.append(tail.view(np.uint8))
        block = np.concatenate(parts, axis=1).tobytes()
        size = len(block) // full
        values = [block[at:at + size] for at in range(0, len(block), size)]
        pages = list(np.asarray(iids)[:full * PAGE_ROWS].reshape(full, PAGE_ROWS))
    if rest:  # the last page, shorter
        start = full * PAGE_ROWS
        tail = _FRAME.pack(frames[full], sums[full]) if frames is not None else b""
        pages.append(iids[start:])
        values.append(b"".join([header(rest), modes, *(memoryview(c[start:]) for c in columns), tail]))
    return pages, values


def decode_page(raw: bytes) -> tuple[dict[str, np.ndarray], list[str], bool]:
    """``(columns, modes, has rows)`` of an ``embpages`` value.

    The columns (``iid``, ``version``, ``event_ts``, ``mode``) are read-only
    views, plus for a page with rows its row ``width`` and either ``frame``
    (the frame of the row file) and ``sum``.
    """
    fmt, has_rows, count, width, n_modes = _PAGE_HEAD.unpack_from(raw)
    if fmt != _PAGE_FORMAT:
        raise ValueError(f"Expected embedding page format {_PAGE_FORMAT} (got {fmt})")
    at = _PAGE_HEAD.size
    modes = []
    for _ in range(n_modes):
        n = raw[at]
        modes.append(raw[at + 1:at + 1 + n].decode())
        at += 1 + n
    columns = {}
    for name, dtype in _COLUMNS:
        columns[name] = np.frombuffer(raw, dtype, count, at)
        at += count * np.dtype(dtype).itemsize
    if has_rows:
        columns["width"] = np.asarray(width)
        frame, total = _FRAME.unpack_from(raw, at)
        columns["frame"], columns["sum"] = np.asarray(frame), np.asarray(total, dtype=np.uint64)
    return columns, modes, bool(has_rows)
