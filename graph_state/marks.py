"""Dirty marks: which nodes' rows a batch left to recompute, per layer, kept in the ``dirty`` family and
mirrored in memory as ``tag << 48 | iid`` marks with OR-combined flags."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.db import Columns

__all__ = ["DirtyMarks", "MarkLog", "DIRTY_INPUT", "DIRTY_SAMPLE", "DIRTY_COUNT", "DIRTY_DEGREE", "combine", "or_reduce",
           "split", "mark_records"]

# Dirty-mark flags. Layer 0 marks say a node's input h^0 changed; layer l >= 1
# marks say the sample S_{k_l} of the node changed (so h^l must be recomputed)
# and whether its size changed (GCN normalisation of its dependents).
DIRTY_INPUT = 1
DIRTY_SAMPLE = 2
DIRTY_COUNT = 4
DIRTY_DEGREE = 8

_TAG_SHIFT = 48  # an in-memory mark is tag << 48 | iid


class DirtyMarks:
    """The ``dirty`` family in memory: marks as ``tag << 48 | iid`` with flags.

    Marks arrive in chunks (one per written block); flags of the same mark are
    OR-combined when read, and the reduced set replaces the chunks.
    """

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, np.ndarray]] = []
        self.next_seq = 0  # the next block key's sequence number
        self._reduced: tuple[np.ndarray, np.ndarray] | None = None

    def add(self, marks: np.ndarray, flags: np.ndarray) -> None:
        if len(marks):
            self.chunks.append((marks.astype(np.uint64, copy=False), flags.astype(np.uint8, copy=False)))
            self._reduced = None

    def add_stored(self, key: bytes, value: bytes) -> None:
        """Take in one record of the ``dirty`` family: a block of packed marks."""
        rec = np.frombuffer(value, dtype=keys.DIRTY_MARK_RECORD)
        self.add(combine(rec["tag"], rec["iid"]), rec["flags"])
        self.next_seq = max(self.next_seq, keys.decode_iid(key[1:]) + 1)

    def clear(self) -> None:
        self.chunks.clear()
        self._reduced = None

    def reduced(self) -> tuple[np.ndarray, np.ndarray]:
        """``(distinct marks in order, their OR-combined flags)``."""
        if self._reduced is None:
            marks, flags = or_reduce(self.chunks)
            self.chunks = [(marks, flags)] if len(marks) else []
            self._reduced = marks, flags
        return self._reduced


class MarkLog:
    """The ``dirty`` family with its in-memory mirror (:class:`DirtyMarks`), read on first use and then kept in
    step by every write of marks."""

    def __init__(self, columns: Columns):
        self._columns = columns
        self._mirror: DirtyMarks | None = None

    def mirror(self) -> DirtyMarks:
        """The mirror, read from the family first if it is not held."""
        if self._mirror is None:
            state = DirtyMarks()
            for key, value in self._columns.families["dirty"].items():
                state.add_stored(key, value)
            self._mirror = state
        return self._mirror

    def block(self, marks: np.ndarray, flags: np.ndarray) -> tuple[bytes, bytes]:
        """``(key, value)`` of a new block holding ``marks`` with ``flags``."""
        state = self.mirror()
        key = keys.dirty_block_key(state.next_seq)
        state.next_seq += 1
        return key, mark_records(marks, flags)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every mark once, in (tag, iid) order: ``(tags, iids, flags)``, flags OR-combined."""
        marks, flags = self.mirror().reduced()
        tags, iids = split(marks)
        return tags.astype(np.int64), iids.astype(np.int64), flags.copy()

    def count(self) -> int:
        """The number of distinct marks."""
        return len(self.mirror().reduced()[0])

    def added(self, marks: np.ndarray, flags: np.ndarray) -> None:
        """Marks were written: add them to the mirror, if it is held."""
        if self._mirror is not None:
            self._mirror.add(marks, flags)

    def written(self, blocks: Sequence[tuple[bytes, bytes]], cleared: bool) -> None:
        """A commit wrote these blocks, after removing every stored mark when ``cleared``: follow it."""
        state = self._mirror
        if state is not None:
            if cleared:
                state.clear()
            for key, value in blocks:
                state.add_stored(key, value)

    def drop(self) -> None:
        """Forget the mirror (after a failed write); the next use reads the family again."""
        self._mirror = None


def combine(tags: np.ndarray, iids: np.ndarray) -> np.ndarray:
    return (np.asarray(tags, dtype=np.uint64) << np.uint64(_TAG_SHIFT)) | np.asarray(iids, dtype=np.uint64)


def or_reduce(chunks: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct marks of the chunks in order, with the OR of each mark's flags."""
    marks = np.concatenate([m for m, _ in chunks]) if chunks else np.zeros(0, dtype=np.uint64)
    flags = np.concatenate([f for _, f in chunks]) if chunks else np.zeros(0, dtype=np.uint8)
    if not len(marks):
        return marks, flags
    order = np.argsort(marks, kind="stable")
    marks, flags = marks[order], flags[order]
    first = np.flatnonzero(np.concatenate(([True], marks[1:] != marks[:-1])))
    return marks[first], np.bitwise_or.reduceat(flags, first)


def split(marks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(tags, iids)`` of combined marks."""
    return marks >> np.uint64(_TAG_SHIFT), marks & np.uint64((1 << _TAG_SHIFT) - 1)


def mark_records(marks: np.ndarray, flags: np.ndarray) -> bytes:
    rec = np.empty(len(marks), dtype=keys.DIRTY_MARK_RECORD)
    (rec["tag"], rec["iid"]), rec["flags"] = split(marks), flags
    return rec.tobytes()
