"""Node records and neighbour-list prefixes in memory: the columns the engine reads many nodes at once
from, and the comparison that turns a batch's prefix edits into sample changes."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from graph_state import keys

__all__ = ["Node", "GONE", "Prefix", "PrefixTable", "DenseNodes", "grow_columns", "padded_rows", "prefix_changes"]

@dataclass(slots=True)
class Node:
    degree: int
    flags: int
    last_ts: float

    @classmethod
    def decode(cls, raw: bytes | None) -> "Node | None":
        """The record stored under a node's key (None: the node does not exist)."""
        return None if raw is None else cls(*keys.NODE_RECORD.unpack(raw))


GONE = Node(-1, 0, 0.0)  # stands for a deleted node's record in the columns written at the end of a batch


class Prefix:
    """The first :attr:`GraphStore.top_size` entries of a neighbour list in rank order, as a batch edits them:
    the ranks ``r(v, u)`` and the neighbour ids side by side (the ids of a sample are a slice)."""

    __slots__ = ("ranks", "ids")

    def __init__(self, ranks: list[int] | None = None, ids: list[int] | None = None) -> None:
        self.ranks: list[int] = [] if ranks is None else ranks
        self.ids: list[int] = [] if ids is None else ids


class PrefixTable:
    """The neighbour-list prefixes of every node as two ``[capacity, width]`` matrices by iid.

    ``rank`` holds ``r(v, u)`` and ``ids`` the neighbour ``u`` of the first
    ``length[v]`` entries of ``v``'s list in rank order (``ids`` is -1 past
    them, so the first ``k`` columns of a row are ``S_k(v)`` padded as the
    engine reads it). ``loaded`` says which rows are filled; the rest are read
    from RocksDB when first needed. A batch edits :class:`Prefix` copies of
    the rows it touches and writes them back with :meth:`put_many`.
    """

    def __init__(self, width: int):
        self.width = width
        self.rank = np.zeros((0, width), dtype=np.uint64)
        self.ids = np.full((0, width), -1, dtype=np.int64)
        self.length = np.zeros(0, dtype=np.int32)
        self.loaded = np.zeros(0, dtype=bool)
        self.count = 0  # rows loaded

    def grow(self, size: int) -> None:
        have = len(self.loaded)
        if size <= have:
            return
        new = max(size, have + have // 4, 1024)  # a quarter more: the matrices are the largest per-node state
        rank = np.zeros((new, self.width), dtype=np.uint64)
        rank[:have] = self.rank
        ids = np.full((new, self.width), -1, dtype=np.int64)
        ids[:have] = self.ids
        length = np.zeros(new, dtype=np.int32)
        length[:have] = self.length
        loaded = np.zeros(new, dtype=bool)
        loaded[:have] = self.loaded
        self.rank, self.ids, self.length, self.loaded = rank, ids, length, loaded

    def clear(self) -> None:
        """Forget every row (they are read again when next needed); the memory is kept."""
        self.loaded[:] = False
        self.count = 0

    def get(self, v: int) -> Prefix | None:
        """A copy of ``v``'s row to edit, or None when it is not loaded."""
        if v >= len(self.loaded) or not self.loaded[v]:
            return None
        n = int(self.length[v])
        return Prefix(self.rank[v, :n].tolist(), self.ids[v, :n].tolist())

    def copies(self, iids: np.ndarray) -> tuple[list[int], list[Prefix]]:
        """Copies of the loaded rows among distinct ``iids`` to edit, read with one numpy call per matrix:
        ``(their iids, a Prefix each)``."""
        iids = iids[iids < len(self.loaded)]
        iids = iids[self.loaded[iids]]
        lengths = self.length[iids]
        held = np.arange(self.width) < lengths[:, None]  # only the held entries become Python ints
        ranks, ids = self.rank[iids][held].tolist(), self.ids[iids][held].tolist()
        ends = np.cumsum(lengths).tolist()
        return iids.tolist(), [Prefix(ranks[a:b], ids[a:b]) for a, b in zip([0, *ends[:-1]], ends)]

    def missing(self, iids: np.ndarray) -> np.ndarray:
        """The distinct ``iids`` whose rows are not loaded."""
        if not len(iids):
            return iids
        self.grow(int(iids.max()) + 1)
        return np.unique(iids[~self.loaded[iids]])

    def put_many(self, iids: Sequence[int], tops: Sequence[Prefix]) -> None:
        """Store the prefixes ``tops`` as the rows of distinct ``iids``."""
        if not len(iids):
            return
        idx = np.fromiter(iids, dtype=np.int64, count=len(iids))
        self.grow(int(idx.max()) + 1)
        lengths = [len(top.ids) for top in tops]
        self.count += len(idx) - int(np.count_nonzero(self.loaded[idx]))
        self.ids[idx] = padded_rows(list(itertools.chain.from_iterable(top.ids for top in tops)), lengths,
                                    self.width)
        flat = np.fromiter(itertools.chain.from_iterable(top.ranks for top in tops), dtype=np.uint64,
                           count=sum(lengths))
        ranks = np.zeros((len(idx), self.width), dtype=np.uint64)
        ranks[self.ids[idx] >= 0] = flat  # row-major order of the held entries, as flattened
        self.rank[idx] = ranks
        self.length[idx] = lengths
        self.loaded[idx] = True

    def samples(self, iids: np.ndarray, k: int) -> np.ndarray:
        """``S_k`` of loaded rows: ``[len(iids), k]`` ids in rank order, padded with -1 (a copy)."""
        return self.ids[iids, :k]


def grow_columns(owner: Any, names: Sequence[str], size: int) -> int | None:
    """Grow the equally long 1-D arrays ``owner.<name>`` to hold ``size`` entries (new ones zero).

    Capacity at least doubles. Returns the old length, or None when they were long enough.
    """
    have = len(getattr(owner, names[0]))
    if size <= have:
        return None
    new = max(size, 2 * have, 1024)
    for name in names:
        old = getattr(owner, name)
        arr = np.zeros(new, dtype=old.dtype)
        arr[:have] = old
        setattr(owner, name, arr)
    return have


class DenseNodes:
    """Node records as arrays, for reading thousands of them at once.

    ``degree`` is -1 for an absent node; ``known`` says which entries are filled.
    Entries are written through at the end of every applied batch.
    """

    def __init__(self) -> None:
        self.degree = np.zeros(0, dtype=np.int64)
        self.flags = np.zeros(0, dtype=np.uint8)
        self.last_ts = np.zeros(0, dtype=np.float64)
        self.known = np.zeros(0, dtype=bool)

    def grow(self, size: int) -> None:
        grow_columns(self, ("degree", "flags", "last_ts", "known"), size)

    def set(self, iid: int, node: "Node | None") -> None:
        if iid >= len(self.known):
            self.grow(iid + 1)
        if node is None:
            self.degree[iid], self.flags[iid], self.last_ts[iid] = -1, 0, 0.0
        else:
            self.degree[iid], self.flags[iid], self.last_ts[iid] = node.degree, node.flags, node.last_ts
        self.known[iid] = True

    def set_many(self, iids: Sequence[int], degree: Sequence[int], flags: Sequence[int],
                 last_ts: Sequence[float]) -> None:
        """:meth:`set` for many nodes, given column by column (degree -1 for an absent node), with one numpy
        assignment per column."""
        if not len(iids):
            return
        idx = np.fromiter(iids, dtype=np.int64, count=len(iids))
        self.grow(int(idx.max()) + 1)
        self.degree[idx], self.flags[idx], self.last_ts[idx] = degree, flags, last_ts
        self.known[idx] = True


def padded_rows(flat: list[int], lengths: list[int], width: int) -> np.ndarray:
    """A ``[len(lengths), width]`` matrix of consecutive runs of ``flat``, padded with -1."""
    out = np.full((len(lengths), width), -1, dtype=np.int64)
    if flat:
        counts = np.asarray(lengths, dtype=np.int64)
        row = np.repeat(np.arange(len(counts)), counts)
        col = np.arange(len(flat)) - np.repeat(np.cumsum(counts) - counts, counts)
        out[row, col] = np.asarray(flat, dtype=np.int64)
    return out


def prefix_changes(initial_top: Mapping[int, list[int]], degree0: Mapping[int, int], nodes: Mapping[int, Node | None],
                    tops: Mapping[int, Prefix], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, before, after, moved)``: the nodes whose first ``width`` prefix ids (all that can be sampled)
    differ after the batch, those ids before and after as ``[len(ids), width]`` matrices padded with -1, and
    ``(v, degree before, degree after)`` rows of every node whose degree changed."""
    changed: list[int] = []
    before_ids: list[int] = []  # the first ``width`` neighbour ids of every changed prefix, flattened
    after_ids: list[int] = []
    before_len: list[int] = []
    after_len: list[int] = []
    moved: list[int] = []  # v, degree before, degree after of every node whose degree changed, flattened
    empty = Prefix()
    for v, before_top in initial_top.items():
        node = nodes.get(v)
        deg_before = degree0[v]
        if node is None:
            after_top, deg_after = empty.ids, 0
        else:
            after_top, deg_after = tops.get(v, empty).ids, node.degree
        if deg_before != deg_after:
            moved += v, deg_before, deg_after
        before, after = before_top[:width], after_top[:width]
        if before != after:
            changed.append(v)
            before_ids.extend(before)
            before_len.append(len(before))
            after_ids.extend(after)
            after_len.append(len(after))
    return (np.asarray(changed, dtype=np.int64), padded_rows(before_ids, before_len, width),
            padded_rows(after_ids, after_len, width), np.fromiter(moved, np.int64, len(moved)).reshape(-1, 3))
