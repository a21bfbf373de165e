"""Node records and neighbour-list prefixes in memory: the columns the engine reads many nodes at once
from, and the comparison that turns a batch's prefix edits into sample changes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from graph_state import keys

__all__ = ["Node", "GONE", "Prefix", "DenseSamples", "DenseNodes", "grow_columns", "padded_rows", "prefix_changes"]

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
    """The first :attr:`GraphStore.top_size` entries of a neighbour list in rank order: the index keys and
    the neighbour ids side by side (the ids of a sample are a slice, without unpacking entries)."""

    __slots__ = ("keys", "ids")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.ids: list[int] = []


class DenseSamples:
    """``S_k`` of many nodes as a padded iid matrix (-1 where the sample is short).

    Rows are filled on first read and dropped whenever the node's rank-ordered
    prefix changes, so a valid row always equals :meth:`GraphStore.sample_iids`.
    """

    def __init__(self, k: int):
        self.k = k
        self.mat = np.full((0, k), -1, dtype=np.int64)
        self.valid = np.zeros(0, dtype=bool)

    def grow(self, size: int) -> None:
        have = len(self.valid)
        if size <= have:
            return
        new = max(size, 2 * have, 1024)
        mat = np.full((new, self.k), -1, dtype=np.int64)
        mat[:have] = self.mat
        valid = np.zeros(new, dtype=bool)
        valid[:have] = self.valid
        self.mat, self.valid = mat, valid


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
