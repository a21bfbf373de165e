"""Row files: float32 rows of a page log in fixed-size frames of a file beside the database, written with
``pwrite`` or through a shared mapping, read with ``pread``."""

from __future__ import annotations

import heapq
import mmap
import os

import numpy as np

from gnnstream.graph_state.codecs import PAGE_ROWS

__all__ = ["RowFile", "RowReaders", "row_sums"]

_GROWTH_DIVISOR = 4  # a row file grows by at least a quarter of its size at a time


class RowReaders:
    """Read-only descriptors of row files, each opened on first use; all closed on exit."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def __enter__(self) -> "RowReaders":
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)


class RowFile:
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

    def read(self, frame: int, count: int, files: "RowReaders") -> np.ndarray:
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
