"""The sampled-by relation in memory: for each fanout ``k``, which nodes ``v`` hold ``u`` in ``S_k(v)``, as
sorted ``u << 32 | v`` pairs with small pending change sets."""

from __future__ import annotations

import numpy as np

from gnnstream.graph_state.idsets import unique_ids

__all__ = ["SampledIndex", "PAIR_BITS", "MAX_INDEXED_IDS", "SNAPSHOT_PAIRS", "FOLD_PAIRS", "member", "sample_pairs"]

PAIR_BITS = 32  # (u, v) packs as u << 32 | v
MAX_INDEXED_IDS = 1 << (PAIR_BITS - 1)  # u << 32 | v must stay a non-negative int64
SNAPSHOT_PAIRS = 1 << 20  # pairs per sampled-by snapshot record
FOLD_PAIRS = 1 << 20  # changes replayed at load before they are folded into a new snapshot

def member(sorted_arr: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Which entries of ``x`` are in the sorted array ``sorted_arr``."""
    if not len(sorted_arr) or not len(x):
        return np.zeros(len(x), dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_arr, x), len(sorted_arr) - 1)
    return sorted_arr[pos] == x


def _merge(sorted_arr: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The sorted union of ``sorted_arr`` and the sorted ``x`` (disjoint from it), in linear time."""
    return np.insert(sorted_arr, np.searchsorted(sorted_arr, x), x) if len(x) else sorted_arr


def _slices(arr: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The entries of ``arr`` in the slices ``[lo, hi)``, concatenated."""
    counts = hi - lo
    total = int(counts.sum())
    if total == 0:
        return arr[:0]
    starts = np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return arr[starts + np.arange(total)]


class SampledIndex:
    """The sampled-by relation of one fanout in memory: sorted ``u << 32 | v`` pairs.

    ``sampled_by_k(u)`` is one contiguous slice, found by binary search, and
    its size is known without reading it (a hub costs the same as a leaf).
    Changes collect in two small sorted arrays (added, removed) that are
    merged into the base every few tens of thousands of changes, so a batch
    does not rewrite millions of pairs.
    """

    compact_at = 1 << 16  # pending changes merged once above this (or 1/32 of the base)

    def __init__(self, pairs: np.ndarray):
        self.base = pairs
        self.added = pairs[:0]
        self.removed = pairs[:0]

    def update(self, removed: np.ndarray, added: np.ndarray) -> None:
        removed, added = unique_ids(removed), unique_ids(added)
        if len(removed):
            pending = member(self.added, removed)
            self.added = self.added[~member(removed, self.added)]
            drop = removed[~pending]
            self.removed = _merge(self.removed, drop[member(self.base, drop) & ~member(self.removed, drop)])
        if len(added):
            back = member(self.removed, added)
            self.removed = self.removed[~member(added, self.removed)]
            new = added[~back]
            self.added = _merge(self.added, new[~member(self.base, new) & ~member(self.added, new)])
        if len(self.added) + len(self.removed) > max(self.compact_at, len(self.base) >> 5):
            self.base = self.pairs()
            self.added, self.removed = self.base[:0], self.base[:0]

    def pairs(self) -> np.ndarray:
        """Every pair of the relation, sorted."""
        return _merge(np.delete(self.base, np.searchsorted(self.base, self.removed)), self.added)

    def lookup(self, sources: np.ndarray, bound: int | None) -> tuple[np.ndarray, np.ndarray]:
        """``(v of every pair of sources with at most bound dependents, sources with more)``."""
        lo_key, hi_key = sources << PAIR_BITS, (sources + 1) << PAIR_BITS
        ranges = [(arr, np.searchsorted(arr, lo_key), np.searchsorted(arr, hi_key))
                  for arr in (self.base, self.removed, self.added)]
        (base, blo, bhi), (_, rlo, rhi), (added, alo, ahi) = ranges
        keep = np.ones(len(sources), dtype=bool)
        if bound is not None:
            keep = (bhi - blo) - (rhi - rlo) + (ahi - alo) <= bound
        pairs = _slices(base, blo[keep], bhi[keep])
        if len(self.removed):
            pairs = pairs[~member(self.removed, pairs)]
        pairs = np.concatenate([pairs, _slices(added, alo[keep], ahi[keep])])
        return pairs & ((1 << PAIR_BITS) - 1), sources[~keep]


def sample_pairs(ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The sorted ``u << 32 | v`` pairs of sample rows (``rows[i]`` holds ``S_k(ids[i])``, padded with -1)."""
    valid = rows >= 0
    pairs = (rows[valid] << PAIR_BITS) | np.broadcast_to(ids[:, None], rows.shape)[valid]
    pairs.sort()
    return pairs
