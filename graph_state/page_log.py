"""Page logs: the versions, event times, modes and rows of every node's embedding, kept as pages of up to
:data:`~gnnstream.graph_state.codecs.PAGE_ROWS` records in a column family, their rows in frames of a row file."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.codecs import PAGE_ROWS, decode_page, encode_pages
from gnnstream.graph_state.idsets import unique_ids
from gnnstream.graph_state.prefixes import grow_columns
from gnnstream.graph_state.row_file import RowFile, RowReaders, row_sums

if TYPE_CHECKING:
    from gnnstream.graph_state.store import GraphStore

__all__ = ["PageLog", "EmbeddingMeta", "FrameReused", "read_final_rows", "layer_logs_from", "SUPERSEDED_SHARE"]

logger = logging.getLogger(__name__)

# compaction keeps the superseded slots of a log within 1 / SUPERSEDED_SHARE of its live records (plus gc_slack):
# the row files then stop growing soon after a backfill, and later rows reuse the frames compaction frees
SUPERSEDED_SHARE = 4


class FrameReused(RuntimeError):
    """A reader found a frame holding other rows than its page names: it must catch up and read again."""


@dataclass(frozen=True, slots=True)
class EmbeddingMeta:
    """A node's stored embedding metadata: its version, the time of the event it reflects, and its mode."""

    version: int
    event_ts: float
    mode: str


def layer_logs_from(store: GraphStore, first: int) -> list[tuple[str, bytes, None]]:
    """Deletions of every record of the hidden-row logs of layers ``first`` and up (``layerpages``), for a
    :class:`~gnnstream.graph_state.transaction.Transaction`: what a model with fewer layers leaves behind."""
    return [("layerpages", key, None) for key in store.column("layerpages").keys(from_key=bytes((first,)))]


def read_final_rows(store: GraphStore, iids: Sequence[int] | np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The stored final embeddings of ``iids`` (from the page log and its row file) and a mask of which exist
    (zero rows elsewhere)."""
    return PageLog(store).rows(np.asarray(iids, dtype=np.int64), dim)


class PageLog:
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
        keep_rows: a reader's bound on the rows of the frames :meth:`row` keeps in memory (0: none).
    """

    def __init__(self, store: GraphStore, gc_slack: int = 1 << 16, *, family: str = "embpages", prefix: bytes = b"",
                 rows_name: str = "final-rows", keep_rows: int = 0, frame_ids: bool = False):
        self.store = store
        self.frame_ids = frame_ids  # keep each page's iids, which rows(others=...) needs (a writer's cache)
        self.gc_slack = gc_slack
        self.family = family
        self.prefix = prefix
        self.rows_name = rows_name
        self.keep_rows = keep_rows
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
        self._ids_of: dict[int, np.ndarray] = {}  # page -> the iids of its records, by slot, of pages with rows
        self._unreadable: set[int] = set()  # pages damaged() could not read: rows() holds none for them
        for file in getattr(self, "_files", {}).values():
            file.close()
        self._files: dict[int, RowFile] = {}  # by row width
        self._recent: set[int] = set()  # pages written since the last compact, and their records
        self._recent_rows = 0
        self._loaded = False
        self._kept: dict[int, np.ndarray] = {}  # page -> its rows, as row() read and checked them

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
            if self.frame_ids:
                self._ids_of[seq] = ids
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
        before = []
        for key, raw in self.store.column(self.family).items(from_key=self._key(self._next_page)):
            if not key.startswith(self.prefix):
                break
            seq = keys.decode_iid(key[at:])
            before.append(self._take(seq, raw))
            self._live[seq] = self._size[seq]
        if before:
            for page in self._superseded(np.concatenate(before)):  # the writer deleted it: forget it here too
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
        with RowReaders() as files:
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

        The scan is the store's checked one (:class:`gnnstream.graph_state.db.Family`): a damaged block of the
        page records raises :class:`~gnnstream.graph_state.exceptions.StateCorrupted` instead of ending the log
        early, which would leave every later node without its embedding.
        """
        at = len(self.prefix)
        for key, raw in self.store.column(self.family).items(from_key=self.prefix):
            if not key.startswith(self.prefix):
                break
            yield keys.decode_iid(key[at:]), raw

    def _file(self, width: int) -> RowFile:
        file = self._files.get(width)
        if file is None:
            file = self._files[width] = RowFile(os.path.join(self.store.path, f"{self.rows_name}-{width}.f32"),
                                                   width)
        return file

    def _forget_page(self, seq: int) -> tuple[int, int] | None:
        """Drop a page from the index; the ``(row width, frame)`` it held rows in, if any."""
        self._slots -= self._size.pop(seq)
        self._sum_of.pop(seq, None)
        self._ids_of.pop(seq, None)
        self._kept.pop(seq, None)
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
                if self.frame_ids:
                    self._ids_of[seq] = np.array(ids, dtype=np.int64)
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
    def rows(self, iids: np.ndarray, dim: int, *, checked: bool = False,
             others: Callable[[np.ndarray, np.ndarray], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The rows (``dim`` wide) of ``iids`` as held now, encoded but not yet written ones included, and a
        mask of which exist (zeros where none is held).

        ``checked``: compare each frame read with the sum its page records, and raise
        :class:`FrameReused` where they differ (a reader behind the writer, which reused the frame since).
        ``others``: given, once, ``(iids, rows)`` of the other current records of the frames read (a frame
        is read whole whichever of its rows are asked for: a cache keeps them all); a log made with
        ``frame_ids`` only.
        """
        self._load()
        iids = np.asarray(iids, dtype=np.int64)
        out = np.zeros((len(iids), dim), dtype=np.float32)
        present = np.zeros(len(iids), dtype=bool)
        if not len(iids):
            return out, present
        self._grow(int(iids.max()) + 1)
        pages = np.where(self.has_row[iids], self.page[iids], -1)
        more_ids: list[np.ndarray] = []
        more_rows: list[np.ndarray] = []
        with RowReaders() as files:
            order = np.argsort(pages, kind="stable")
            sorted_pages = pages[order]
            seqs = unique_ids(sorted_pages[sorted_pages >= 0])
            bounds = np.searchsorted(sorted_pages, seqs, side="left")
            ends = np.searchsorted(sorted_pages, seqs, side="right")
            for lo, hi, seq in zip(bounds.tolist(), ends.tolist(), seqs.tolist()):
                if seq in self._unreadable:  # damaged, to be rewritten: none held
                    continue
                at = order[lo:hi]
                slots = self.slot[iids[at]]
                block = self._frame(seq, dim, checked, files)
                out[at] = block[slots]
                present[at] = True
                if others is not None:
                    ids = self._ids_of[seq]
                    rest = (self.page[ids] == seq) & self.has_row[ids]  # current rows of this frame only
                    rest[slots] = False
                    if rest.any():
                        more_ids.append(ids[rest])
                        more_rows.append(block[rest])
        if more_ids:
            others(np.concatenate(more_ids), np.concatenate(more_rows))
        return out, present

    def _frame(self, seq: int, dim: int, checked: bool, files: RowReaders) -> np.ndarray:
        """The rows of page ``seq``, read from its frame (``checked``: see :meth:`rows`)."""
        width, frame = self._frame_of[seq]
        self._check_width(seq, width, dim)
        block = self._file(width).read(frame, self._size[seq], files)
        if checked and int(row_sums(block)[0]) != self._sum_of[seq]:
            raise FrameReused(f"frame {frame} of page {seq} was written again since this reader's view")
        return block

    def row(self, iid: int, dim: int) -> np.ndarray | None:
        """A reader's row (``dim`` wide) of one node as of its last :meth:`follow`, read-only; None when it has
        none.

        The page's frame is read and checked as by ``rows(checked=True)``,
        raising :class:`FrameReused` likewise. A page's rows never change, so
        the frames read are kept (up to ``keep_rows`` rows) while their pages
        are stored: the next row of the same page is read from memory, and a
        node the writer rewrote since is read from its new page.
        """
        self._load()
        if iid >= len(self.page) or not self.has_row.item(iid):
            return None
        seq = self.page.item(iid)
        block = self._kept.get(seq)
        if block is None:
            if seq < 0 or seq in self._unreadable:
                return None
            with RowReaders() as files:
                block = self._frame(seq, dim, True, files)
            if self.keep_rows:
                if (len(self._kept) + 1) * PAGE_ROWS > self.keep_rows:
                    self._kept.clear()
                self._kept[seq] = block
        return block[self.slot.item(iid)]  # a view of the frame's bytes, as read (never written)

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

    def _page_rows(self, rec: dict[str, np.ndarray], files: RowReaders) -> np.ndarray:
        """The rows of a decoded page with rows (read from its frame, the file opened once per ``files``)."""
        return self._file(int(rec["width"])).read(int(rec["frame"]), len(rec["iid"]), files)

    def items(self) -> Iterator[tuple[int, EmbeddingMeta, np.ndarray | None]]:
        """Every stored node in page order: ``(iid, metadata, final row or None once withdrawn)``."""
        self._load()
        with RowReaders() as files:
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


def _counts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a 1-D int array (sorted) and how often each occurs."""
    s = np.sort(np.asarray(values, dtype=np.int64))
    if not len(s):
        return s, s
    starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
    return s[starts], np.diff(np.append(starts, len(s)))
