"""The sampled-by relation: for each fanout ``k``, which nodes ``v`` hold ``u`` in ``S_k(v)``; in memory as
sorted ``u << 32 | v`` pairs with small pending change sets, stored in the ``sampled`` family as a snapshot
plus the changes of each batch since."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Callable

import numpy as np
from rocksdict import WriteBatch

from gnnstream.graph_state import keys
from gnnstream.graph_state.batch import Batch
from gnnstream.graph_state.db import Columns, check_iterator
from gnnstream.graph_state.exceptions import StoreConfigError
from gnnstream.graph_state.idsets import unique_ids

__all__ = ["SampledIndex", "SampledBy", "PAIR_BITS", "MAX_INDEXED_IDS", "SNAPSHOT_PAIRS", "FOLD_PAIRS", "member",
           "sample_pairs", "check_indexable"]

logger = logging.getLogger(__name__)

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


def check_indexable(next_iid: int) -> None:
    """Refuse more interned ids than the pairs can hold.

    Raises:
        StoreConfigError: ``next_iid`` is past :data:`MAX_INDEXED_IDS`.
    """
    if next_iid > MAX_INDEXED_IDS:
        raise StoreConfigError(f"the sampled-by index holds at most {MAX_INDEXED_IDS} nodes "
                               f"(this store has interned {next_iid})")


class SampledBy:
    """The sampled-by relation of every fanout of a store: a :class:`SampledIndex` each, loaded on first use,
    and its records in the ``sampled`` family.

    Loading reads the snapshot, then replays the stored changes of each batch
    since, in order; once more than :data:`FOLD_PAIRS` changes wait, the
    relation is folded into a new snapshot.

    Args:
        columns: the open state.
        fold: how the relation is folded (the store's :meth:`GraphStore._fold_sampled`, which a read-only
            store leaves to the writer).
    """

    def __init__(self, columns: Columns, fold: Callable[[], None]):
        self._columns = columns
        self._fold = fold
        self.fanouts: tuple[int, ...] = ()
        self.indexes: dict[int, SampledIndex] = {}  # empty until loaded
        self._delta_seq: int | None = None  # key of the next batch's changes
        self._delta_pairs = 0  # changes stored since the snapshot (known once the indexes are loaded)

    def index(self, k: int) -> SampledIndex | None:
        """The index of fanout ``k`` (None when ``k`` is not one of the fanouts), loading them all first."""
        if k not in self.fanouts:
            return None
        if not self.indexes:
            self._load()
        return self.indexes[k]

    def lookup(self, k: int, sources: np.ndarray, bound: int | None) -> tuple[np.ndarray, np.ndarray]:
        """``(dependents with repeats, sources left out for having more than bound)`` over ``sources``."""
        index = self.index(k)
        if index is None:  # not one of the store's fanouts: no sample of that size is kept
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return index.lookup(sources, bound)

    def _load(self) -> None:
        snapshot: dict[int, list[np.ndarray]] = defaultdict(list)
        deltas: list[np.ndarray] = []  # in key order, which is batch order
        seq = -1
        for key, value in self._columns.families["sampled"].items():
            if key.startswith(keys.SAMPLED_SNAPSHOT_PREFIX):
                snapshot[int.from_bytes(key[2:4], "big")].append(np.frombuffer(value, dtype="<i8"))
            else:
                deltas.append(np.frombuffer(value, dtype=keys.SAMPLED_DELTA_RECORD))
                seq = keys.decode_iid(key[2:])
        indexes = {k: SampledIndex(np.concatenate(snapshot[k]).astype(np.int64) if snapshot.get(k)
                                   else np.zeros(0, dtype=np.int64)) for k in self.fanouts}
        for rec in deltas:
            for k, index in indexes.items():
                mine = rec[rec["k"] == k]
                index.update(mine["pair"][mine["added"] == 0], mine["pair"][mine["added"] == 1])
        pending = sum(len(rec) for rec in deltas)
        self.indexes = indexes
        self._delta_seq, self._delta_pairs = seq + 1, pending
        if pending > FOLD_PAIRS:
            self._fold()

    def fold(self) -> None:
        """Replace the stored relation with a snapshot of the in-memory one (one WriteBatch)."""
        wb = WriteBatch(raw_mode=True)
        handle = self._columns.handles["sampled"]
        wb.delete_range(b"", b"\xff" * 20, handle)
        for k, index in self.indexes.items():
            pairs = index.pairs().astype("<i8")
            for chunk, start in enumerate(range(0, len(pairs), SNAPSHOT_PAIRS)):
                wb.put(keys.sampled_snapshot_key(k, chunk), pairs[start:start + SNAPSHOT_PAIRS].tobytes(), handle)
        self._columns.write(wb)
        self._delta_pairs = 0

    def rebuild(self, pairs: dict[int, list[int]]) -> None:
        """Hold ``pairs`` (by fanout) as the whole relation and store it as the snapshot."""
        self.indexes = {k: SampledIndex(np.sort(np.asarray(p, dtype=np.int64))) for k, p in pairs.items()}
        self._fold()

    def _next_delta(self) -> int:
        """The key number for the next batch's changes (one past the newest stored)."""
        if self._delta_seq is None:
            it = self._columns.views["sampled"].iter()
            it.seek_for_prev(keys.SAMPLED_DELTA_PREFIX + b"\xff" * 8)
            if it.valid():
                last = it.key()
            else:
                last = None
                check_iterator(it, self._columns.path)
            del it
            self._delta_seq = (keys.decode_iid(last[2:]) + 1 if last is not None and len(last) == 10
                               and last.startswith(keys.SAMPLED_DELTA_PREFIX) else 0)
        return self._delta_seq

    def put_changes(self, batch: Batch, changes: np.ndarray, next_iid: int) -> None:
        """Write a batch's changes (:data:`keys.SAMPLED_DELTA_RECORD` records) as its one change record."""
        check_indexable(next_iid)
        batch.put("sampled", keys.sampled_delta_key(self._next_delta()), changes.tobytes())
        batch.sampled_changes = len(changes)

    def committed(self, batch: Batch) -> None:
        """The batch is written: apply its changes to the loaded indexes, and fold once enough wait."""
        for k, index in self.indexes.items():
            index.update(np.asarray(batch.sampled_removed.get(k, ()), dtype=np.int64),
                         np.asarray(batch.sampled_added.get(k, ()), dtype=np.int64))
        if batch.sampled_changes:
            self._delta_seq = (self._delta_seq or 0) + 1
            self._delta_pairs += batch.sampled_changes
            if self.indexes and self._delta_pairs > FOLD_PAIRS:
                self._fold()

    def clear(self) -> None:
        """Forget the loaded indexes; the next use reads the family again."""
        self.indexes.clear()
        self._delta_seq, self._delta_pairs = None, 0
