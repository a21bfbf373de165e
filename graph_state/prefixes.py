"""Node records and neighbour-list prefixes in memory: the columns the engine reads many nodes at once
from, and the merge that applies a batch's neighbour changes to many prefixes at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from gnnstream.graph_state import keys

__all__ = ["Node", "GONE", "PrefixTable", "DenseNodes", "grow_columns", "merge_rows"]

@dataclass(slots=True)
class Node:
    degree: int
    flags: int
    last_ts: float
    first_ts: float  # first(v): the smallest ts of the upserts naming the node since it was created

    @classmethod
    def decode(cls, raw: bytes | None) -> "Node | None":
        """The record stored under a node's key (None: the node does not exist)."""
        return None if raw is None else cls(*keys.NODE_RECORD.unpack(raw))


GONE = Node(-1, 0, 0.0, 0.0)  # stands for a deleted node's record in the columns written at the end of a batch


class PrefixTable:
    """The neighbour-list prefixes of every node as two ``[capacity, width]`` matrices by iid.

    ``rank`` holds ``r(v, u)`` and ``ids`` the neighbour ``u`` of the first
    ``length[v]`` entries of ``v``'s list in rank order (``ids`` is -1 past
    them). A row is read with ``width`` entries and may lose some to removals
    down to ``need`` (or the whole list, when shorter) before it is read again,
    so the first ``k <= need`` columns of a row are ``S_k(v)`` padded as the
    engine reads it, and a stream that removes edges (deletes, an edge window)
    reads a list again only once per ``width - need`` removals from its
    prefix. ``loaded`` says which rows are filled; the rest are read from
    RocksDB when first needed. A batch reads the rows of the nodes whose lists
    it changed, merges its changes into them with :func:`merge_rows` and writes
    them back with :meth:`put_rows`.
    """

    def __init__(self, need: int, width: int | None = None, iid_bound: Callable[[], int] = lambda: 0):
        self.need = need
        self._iid_bound = iid_bound  # how many iids the store has handed out
        self.width = need if width is None else width
        width = self.width
        self.rank = np.zeros((0, width), dtype=np.uint64)
        self.ids = np.full((0, width), -1, dtype=np.int64)
        self.length = np.zeros(0, dtype=np.int32)
        self.loaded = np.zeros(0, dtype=bool)
        self.count = 0  # rows loaded

    def grow(self, size: int) -> None:
        have = len(self.loaded)
        if size <= have:
            return
        # a quarter more (the matrices are the largest per-node state), and at least room for all the store's
        # nodes and an eighth more
        bound = self._iid_bound()
        new = max(size, have + have // 4, 1024, bound + bound // 8)
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

    def row(self, v: int) -> list[int] | None:
        """The neighbour ids of ``v``'s row, or None when it is not loaded."""
        if v >= len(self.loaded) or not self.loaded[v]:
            return None
        return self.ids[v, :self.length[v]].tolist()

    def missing(self, iids: np.ndarray) -> np.ndarray:
        """The distinct ``iids`` whose rows are not loaded."""
        if not len(iids):
            return iids
        self.grow(int(iids.max()) + 1)
        return np.unique(iids[~self.loaded[iids]])

    def put_rows(self, iids: np.ndarray, rank: np.ndarray, ids: np.ndarray, length: np.ndarray) -> None:
        """Store ``[len(iids), width]`` rows (ids -1 past ``length``) as the rows of distinct ``iids``."""
        if not len(iids):
            return
        self.grow(int(iids.max()) + 1)
        self.count += len(iids) - int(np.count_nonzero(self.loaded[iids]))
        self.rank[iids], self.ids[iids], self.length[iids] = rank, ids, length
        self.loaded[iids] = True

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
        self.first_ts = np.zeros(0, dtype=np.float64)
        self.known = np.zeros(0, dtype=bool)

    def grow(self, size: int) -> None:
        grow_columns(self, ("degree", "flags", "last_ts", "first_ts", "known"), size)

    def set_many(self, iids: Sequence[int], degree: Sequence[int], flags: Sequence[int],
                 last_ts: Sequence[float], first_ts: Sequence[float]) -> None:
        """Fill the entries of many nodes, given column by column (degree -1 for an absent node), with one numpy
        assignment per column."""
        if not len(iids):
            return
        idx = np.fromiter(iids, dtype=np.int64, count=len(iids))
        self.grow(int(idx.max()) + 1)
        self.degree[idx], self.flags[idx], self.last_ts[idx] = degree, flags, last_ts
        self.first_ts[idx] = first_ts
        self.known[idx] = True


def merge_rows(rank: np.ndarray, ids: np.ndarray, length: np.ndarray, truncated: np.ndarray,
               degree: np.ndarray, added: tuple[np.ndarray, np.ndarray, np.ndarray],
               removed: tuple[np.ndarray, np.ndarray], need: int | None = None,
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The prefixes of ``n`` neighbour lists after a batch's changes, for all of them at once.

    Args:
        rank, ids, length: the rows before (``[n, width]``, ids -1 past ``length``).
        truncated: per row, whether the list held entries past the row before.
        degree: per row, the list's length after.
        added: ``(row, rank, id)`` of the entries added (none of them held before).
        removed: ``(row, id)`` of the entries removed (held or not).
        need: the fewest entries a row of a longer list may keep (default: the width).

    Returns:
        ``(rank, ids, length, exact)``: the rows after. A row with ``exact``
        False cannot be told from what was held: removals left fewer than
        ``need`` entries known to come before the first one not held, or an
        added entry shares a rank with another entry (the ids decide then).
        Its caller reads it again. Nothing is sorted but the added entries.
    """
    n, width = ids.shape
    cols = np.arange(width)
    held = cols < length[:, None]
    gone = np.zeros((n, width), dtype=bool)
    if len(removed[0]):  # ids are -1 past a row's length, so only held entries match
        match = ids[removed[0]] == removed[1][:, None]
        hit = match.any(axis=1)
        gone[removed[0][hit], match[hit].argmax(axis=1)] = True
    add_row, add_rank, add_id = added
    order = np.lexsort((add_rank, add_row))
    add_row, add_rank, add_id = add_row[order], add_rank[order], add_id[order]
    # where each added entry goes among its row's held ones (ranks ascend along a row)
    at = ((rank[add_row] < add_rank[:, None]) & held[add_row]).sum(axis=1)
    exact = np.ones(n, dtype=bool)
    tie = (at < length[add_row]) & (rank[add_row, np.minimum(at, width - 1)] == add_rank)
    exact[add_row[tie]] = False
    exact[add_row[1:][(add_row[1:] == add_row[:-1]) & (add_rank[1:] == add_rank[:-1])]] = False
    # a truncated row knows its list only up to its last held entry: later ones may follow entries not held
    known = ~(truncated[add_row] & (at >= length[add_row]))
    add_row, add_rank, add_id, at = add_row[known], add_rank[known], add_id[known], at[known]
    added_in = np.bincount(add_row, minlength=n)
    ahead = np.arange(len(add_row)) - (np.cumsum(added_in) - added_in)[add_row]  # added ones before it in its row
    gone_before = np.zeros((n, width + 1), dtype=np.int64)
    np.cumsum(gone, axis=1, out=gone_before[:, 1:])
    inserted = np.bincount(add_row * (width + 1) + at, minlength=n * (width + 1)).reshape(n, width + 1)
    keep = held & ~gone
    pos = cols - gone_before[:, :width] + np.cumsum(inserted, axis=1)[:, :width]  # of each held entry, after
    fit = keep & (pos < width)
    target = (np.arange(n)[:, None] * width + pos)[fit]
    add_pos = at - gone_before[add_row, at] + ahead
    new_rank = np.zeros((n, width), dtype=np.uint64)
    new_ids = np.full((n, width), -1, dtype=np.int64)
    new_rank.ravel()[target] = rank[fit]
    new_ids.ravel()[target] = ids[fit]
    fit = add_pos < width
    new_rank[add_row[fit], add_pos[fit]] = add_rank[fit]
    new_ids[add_row[fit], add_pos[fit]] = add_id[fit]
    count = keep.sum(axis=1) + added_in
    exact &= ~(truncated & (count < np.minimum(degree, width if need is None else need)))
    return new_rank, new_ids, np.minimum(count, width).astype(np.int32), exact
