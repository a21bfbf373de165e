"""The RocksDB graph store: edges, neighbour samples, features and offsets.

One :meth:`GraphStore.apply` call turns a batch of events into one RocksDB
``WriteBatch`` holding the graph changes, the sampled-by index, the dirty marks
and the consumed offsets, so a crash leaves the store at a whole batch
boundary. Neighbours are kept ordered by sampling rank, so ``S_k(v)`` is the
first ``k`` entries of ``v``'s neighbour index and costs O(k) to read whatever
the degree.

Hot structures (interned ids, node records, the rank-ordered prefix of each
neighbour list) are cached in memory, write-through and bounded; the cache is
rebuilt lazily after a restart.
"""

from __future__ import annotations

import bisect
import gc
import json
import logging
import math
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
from rocksdict import AccessType, BlockBasedOptions, Cache, DBCompressionType, Options, Rdict, WriteBatch, WriteOptions

from graph_state import keys
from graph_state.idsets import unique_ids
from graph_state.exceptions import OffsetRegressionError, StateCorrupted, StoreConfigError, StoreLockedError
from graph_state.sampler import check_fanout, seeded_rank_bytes


__all__ = ["GraphStore", "ApplyResult", "Family", "grow_columns", "check_iterator", "state_corrupted", "is_corruption",
           "REMEDY", "MANIFEST_RECORD", "DIRTY_INPUT", "DIRTY_SAMPLE", "DIRTY_COUNT", "DIRTY_DEGREE"]

logger = logging.getLogger(__name__)

_FLOAT_FAMILIES = ("feats", "emb", "embmeta", "embpages")

# Dirty-mark flags. Layer 0 marks say a node's input h^0 changed; layer l >= 1
# marks say the sample S_{k_l} of the node changed (so h^l must be recomputed)
# and whether its size changed (GCN normalisation of its dependents).
DIRTY_INPUT = 1
DIRTY_SAMPLE = 2
DIRTY_COUNT = 4
DIRTY_DEGREE = 8

_MIN_TOP = 32
_BLOCK_CACHE_BYTES = 256 << 20
_PAIR_BITS = 32  # the in-memory sampled-by index packs (u, v) as u << 32 | v
_SAMPLED_KEY = keys.SAMPLED_KEY_RECORD
_SAMPLED_DELTA = keys.SAMPLED_DELTA_RECORD
_SNAPSHOT_PAIRS = 1 << 20  # pairs per sampled-by snapshot record
_MAX_INDEXED_IDS = 1 << (_PAIR_BITS - 1)  # u << 32 | v must stay a non-negative int64
_FOLD_PAIRS = 1 << 20  # sampled-by changes replayed at load before they are folded into a new snapshot
_F32_MAX = float(np.finfo(np.float32).max)
_PLAIN_NUMBERS = {float, int}
_PACK_U64 = keys.U64.pack
_UNREAD = object()  # a node record not read yet (``_nodes`` holds None for an absent node)


# ---------------------------------------------------------------------- damage
REMEDY = ("restore a snapshot of the state directory, or rebuild it with `gnnstream graph load` and "
          "`gnnstream backfill`")
"""What to do about a damaged state, as every :class:`StateCorrupted` message says."""
MANIFEST_RECORD = "gnnstream-manifest.json"
"""The file in a state directory recording the name and size of the MANIFEST a clean close left."""
_DAMAGED_FILE = re.compile(r"[^\s:'\"()]*(?:\d+\.(?:sst|log|blob)|MANIFEST-\d+|CURRENT)")


def state_corrupted(path: str, error: BaseException | str) -> StateCorrupted:
    """The one-line error for the damaged state ``path``, naming the file RocksDB's ``error`` names."""
    detail = " ".join(str(error).split())
    found = _DAMAGED_FILE.search(detail)
    where = f": {found.group(0)} is damaged" if found else " is damaged"
    return StateCorrupted(f"state {path!r}{where} (RocksDB: {detail}); {REMEDY}")


def is_corruption(error: BaseException) -> bool:
    """Whether a rocksdict error (a plain ``Exception``) is RocksDB's report of damaged files."""
    return str(error).startswith("Corruption")


def check_iterator(it: Any, path: str) -> None:
    """Raise :class:`StateCorrupted` if the RocksDB iterator ``it`` stopped on an error (call it once
    ``it.valid()`` is False: an iterator that meets a damaged block just becomes invalid)."""
    try:
        it.status()
    except Exception as exc:  # rocksdict raises plain Exception
        raise state_corrupted(path, exc) from exc


def _positioned(view: Rdict, from_key: bytes | None, backwards: bool, read_opt: Any) -> Any:
    it = view.iter() if read_opt is None else view.iter(read_opt)
    if from_key is None:
        it.seek_to_last() if backwards else it.seek_to_first()
    elif backwards:
        it.seek_for_prev(from_key)
    else:
        it.seek(from_key)
    return it


def _scan_items(it: Any, backwards: bool, path: str) -> Iterator[tuple[bytes, bytes]]:
    valid, key, value, step = it.valid, it.key, it.value, it.prev if backwards else it.next
    while valid():
        yield key(), value()
        step()
    check_iterator(it, path)


def _scan_keys(it: Any, backwards: bool, path: str) -> Iterator[bytes]:
    valid, key, step = it.valid, it.key, it.prev if backwards else it.next
    while valid():
        yield key()
        step()
    check_iterator(it, path)


def _scan_values(it: Any, backwards: bool, path: str) -> Iterator[bytes]:
    valid, value, step = it.valid, it.value, it.prev if backwards else it.next
    while valid():
        yield value()
        step()
    check_iterator(it, path)


class Family:
    """One column family of a :class:`GraphStore`, as :meth:`GraphStore.column` hands it out.

    Scans (:meth:`items`, :meth:`keys`, :meth:`values`, with rocksdict's
    arguments) check the iterator's status when it runs out, so a damaged
    block raises :class:`StateCorrupted` instead of ending the scan early.
    Point reads and writes (``get``, ``put``, ``delete``, ``delete_range``)
    are the rocksdict view's own methods, with no call in between (a point
    read of a damaged block raises by itself); ``iter()`` is the view's raw
    iterator, which its user checks with :func:`check_iterator`. Anything
    else goes to the view.
    """

    def __init__(self, view: Rdict, path: str):
        self.view = view
        self.path = path
        self.get, self.put, self.delete, self.delete_range = view.get, view.put, view.delete, view.delete_range

    def __getattr__(self, name: str) -> Any:
        if name == "view":  # not set yet (or any more): no recursion
            raise AttributeError(name)
        return getattr(self.view, name)

    def __getitem__(self, key: bytes) -> Any:
        return self.view[key]

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.view[key] = value

    def __delitem__(self, key: bytes) -> None:
        del self.view[key]

    def __contains__(self, key: bytes) -> bool:
        return key in self.view

    def items(self, backwards: bool = False, from_key: bytes | None = None,
              read_opt: Any = None) -> Iterator[tuple[bytes, bytes]]:
        """``(key, value)`` in key order (reversed with ``backwards``), from ``from_key`` when given."""
        return _scan_items(_positioned(self.view, from_key, backwards, read_opt), backwards, self.path)

    def keys(self, backwards: bool = False, from_key: bytes | None = None, read_opt: Any = None) -> Iterator[bytes]:
        """The keys, as :meth:`items`."""
        return _scan_keys(_positioned(self.view, from_key, backwards, read_opt), backwards, self.path)

    def values(self, backwards: bool = False, from_key: bytes | None = None,
               read_opt: Any = None) -> Iterator[bytes]:
        """The values, as :meth:`items`."""
        return _scan_values(_positioned(self.view, from_key, backwards, read_opt), backwards, self.path)

    def __iter__(self) -> Iterator[bytes]:
        return self.keys()


def _check_manifest(path: str) -> None:
    """Refuse a state whose MANIFEST is shorter than its last clean close left it (:data:`MANIFEST_RECORD`),
    or whose table files are there without the CURRENT file naming their MANIFEST, before RocksDB opens it
    (and deletes the table files it no longer knows)."""
    try:
        with open(os.path.join(path, "CURRENT")) as fh:
            current = fh.read().strip()
    except FileNotFoundError:
        try:
            entries = list(os.scandir(path))
        except OSError:
            return  # a new state (or not a directory: RocksDB says so)
        # RocksDB writes CURRENT before any table file or write-ahead log record: without it, it would start
        # an empty state here and delete these
        if any(e.name.endswith(".sst") or (e.name.endswith(".log") and e.stat().st_size) for e in entries):
            raise StateCorrupted(f"state {path!r}: {os.path.join(path, 'CURRENT')} is missing, beside the "
                                 f"state's table files; {REMEDY}") from None
        return
    except OSError:
        return  # RocksDB reports what it cannot read
    try:
        with open(os.path.join(path, MANIFEST_RECORD)) as fh:
            record = json.load(fh)
        name, size = record["manifest"], int(record["bytes"])
        now = os.path.getsize(os.path.join(path, name))
    except (OSError, ValueError, KeyError, TypeError):
        return  # no record (an older state, or a crash before the last close), or another MANIFEST by now
    if name == current and now < size:
        raise StateCorrupted(f"state {path!r}: {os.path.join(path, name)} is damaged (cut to {now} bytes; the "
                             f"state's last close left {size}); {REMEDY}")


def _record_manifest(path: str) -> None:
    """Write :data:`MANIFEST_RECORD` for the MANIFEST a close left (only when it changed, so a session that
    wrote nothing leaves the directory as it was)."""
    target = os.path.join(path, MANIFEST_RECORD)
    try:
        with open(os.path.join(path, "CURRENT")) as fh:
            current = fh.read().strip()
        record = {"manifest": current, "bytes": os.path.getsize(os.path.join(path, current))}
        try:
            with open(target) as fh:
                if json.load(fh) == record:
                    return
        except (OSError, ValueError):
            pass
        tmp = target + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, target)
    except OSError as exc:
        logger.warning("state %s: could not record the size of its MANIFEST (%s); a MANIFEST cut short "
                       "later will not be noticed at open", path, exc)


def _finite_features(feats: Sequence[Any]) -> bool:
    """Every entry a real number (not a bool) within float32 range."""
    if not set(map(type, feats)) <= _PLAIN_NUMBERS:
        if not all(_is_finite_number(x) for x in feats):
            return False
    arr = np.fromiter(feats, dtype=np.float64, count=len(feats))
    return not len(arr) or bool(np.abs(arr).max() <= _F32_MAX)  # NaN compares false


def _is_finite_number(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float, np.floating, np.integer)) and math.isfinite(x)


@dataclass(slots=True)
class _Node:
    degree: int
    flags: int
    last_ts: float

    @classmethod
    def decode(cls, raw: bytes | None) -> "_Node | None":
        """The record stored under a node's key (None: the node does not exist)."""
        return None if raw is None else cls(*keys.NODE_RECORD.unpack(raw))


_GONE = _Node(-1, 0, 0.0)  # stands for a deleted node's record in the columns written at the end of a batch


class _Prefix:
    """The first :attr:`GraphStore.top_size` entries of a neighbour list in rank order: the index keys and
    the neighbour ids side by side (the ids of a sample are a slice, without unpacking entries)."""

    __slots__ = ("keys", "ids")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.ids: list[int] = []


@dataclass
class ApplyResult:
    """What one applied batch changed.

    Attributes:
        fanouts: the fanouts the sample changes are reported for.
        event_touches: per event, ``(iid, position)`` pairs: the node whose
            neighbour list changed and the rank position the change hit.
        sample_changed: per fanout, the iids whose ``S_k`` differs before and
            after the batch.
        count_changed: per fanout, the iids whose ``|S_k|`` changed.
        features_changed: iids whose input features changed (set, cleared,
            created or deleted).
        degree_changed: iids whose neighbour count changed.
        created / deleted: iids of nodes that came into / went out of existence.
        max_ts: the latest event time in the batch (0 for an empty batch).
        phases: seconds spent per phase (validate, prefetch, events, finish, write, caches).
    """

    fanouts: tuple[int, ...]
    event_touches: list[list[tuple[int, int]]] = field(default_factory=list)
    sample_changed: dict[int, set[int]] = field(default_factory=dict)
    count_changed: dict[int, set[int]] = field(default_factory=dict)
    features_changed: set[int] = field(default_factory=set)
    degree_changed: set[int] = field(default_factory=set)
    created: set[int] = field(default_factory=set)
    deleted: set[int] = field(default_factory=set)
    max_ts: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    rows_written: int = 0  # puts and deletes in the batch's WriteBatch

    def lap(self, phase: str, since: float) -> float:
        """Add the time from ``since`` to now to ``phase`` (seconds); return now."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - since
        return now

    def event_sample_changes(self, index: int, k: int) -> set[int]:
        """The iids whose ``S_k`` was changed by event ``index`` of the batch."""
        return {iid for iid, pos in self.event_touches[index] if pos < k}


class _DenseSamples:
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


def _member(sorted_arr: np.ndarray, x: np.ndarray) -> np.ndarray:
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


class _SampledIndex:
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
            pending = _member(self.added, removed)
            self.added = self.added[~_member(removed, self.added)]
            drop = removed[~pending]
            self.removed = _merge(self.removed, drop[_member(self.base, drop) & ~_member(self.removed, drop)])
        if len(added):
            back = _member(self.removed, added)
            self.removed = self.removed[~_member(added, self.removed)]
            new = added[~back]
            self.added = _merge(self.added, new[~_member(self.base, new) & ~_member(self.added, new)])
        if len(self.added) + len(self.removed) > max(self.compact_at, len(self.base) >> 5):
            self.base = self.pairs()
            self.added, self.removed = self.base[:0], self.base[:0]

    def pairs(self) -> np.ndarray:
        """Every pair of the relation, sorted."""
        return _merge(np.delete(self.base, np.searchsorted(self.base, self.removed)), self.added)

    def lookup(self, sources: np.ndarray, bound: int | None) -> tuple[np.ndarray, np.ndarray]:
        """``(v of every pair of sources with at most bound dependents, sources with more)``."""
        lo_key, hi_key = sources << _PAIR_BITS, (sources + 1) << _PAIR_BITS
        ranges = [(arr, np.searchsorted(arr, lo_key), np.searchsorted(arr, hi_key))
                  for arr in (self.base, self.removed, self.added)]
        (base, blo, bhi), (_, rlo, rhi), (added, alo, ahi) = ranges
        keep = np.ones(len(sources), dtype=bool)
        if bound is not None:
            keep = (bhi - blo) - (rhi - rlo) + (ahi - alo) <= bound
        pairs = _slices(base, blo[keep], bhi[keep])
        if len(self.removed):
            pairs = pairs[~_member(self.removed, pairs)]
        pairs = np.concatenate([pairs, _slices(added, alo[keep], ahi[keep])])
        return pairs & ((1 << _PAIR_BITS) - 1), sources[~keep]


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


class _DenseNodes:
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

    def set(self, iid: int, node: "_Node | None") -> None:
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


_TAG_SHIFT = 48  # an in-memory mark is tag << 48 | iid


class _Marks:
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
        """Take in one record of the ``dirty`` family: a block of packed marks or a single mark."""
        if len(key) == 1 + keys.U64.size:
            rec = np.frombuffer(value, dtype=keys.DIRTY_MARK_RECORD)
            self.add(_combine(rec["tag"], rec["iid"]), rec["flags"])
            self.next_seq = max(self.next_seq, keys.decode_iid(key[1:]) + 1)
        else:
            k, iid = keys.decode_dirty_key(key)
            self.add(_combine([k], [iid]), np.asarray([value[0]], dtype=np.uint8))

    def clear(self) -> None:
        self.chunks.clear()
        self._reduced = None

    def reduced(self) -> tuple[np.ndarray, np.ndarray]:
        """``(distinct marks in order, their OR-combined flags)``."""
        if self._reduced is None:
            marks, flags = _or_reduce(self.chunks)
            self.chunks = [(marks, flags)] if len(marks) else []
            self._reduced = marks, flags
        return self._reduced


def _combine(tags: np.ndarray, iids: np.ndarray) -> np.ndarray:
    return (np.asarray(tags, dtype=np.uint64) << np.uint64(_TAG_SHIFT)) | np.asarray(iids, dtype=np.uint64)


def _or_reduce(chunks: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct marks of the chunks in order, with the OR of each mark's flags."""
    marks = np.concatenate([m for m, _ in chunks]) if chunks else np.zeros(0, dtype=np.uint64)
    flags = np.concatenate([f for _, f in chunks]) if chunks else np.zeros(0, dtype=np.uint8)
    if not len(marks):
        return marks, flags
    order = np.argsort(marks, kind="stable")
    marks, flags = marks[order], flags[order]
    first = np.flatnonzero(np.concatenate(([True], marks[1:] != marks[:-1])))
    return marks[first], np.bitwise_or.reduceat(flags, first)


def _pairs_of(chunks: list[np.ndarray] | None, legacy: list[bytes], k: int) -> np.ndarray:
    """The stored sampled-by pairs of fanout ``k``: its snapshot, else its keys in the per-pair layout."""
    if chunks:
        return np.concatenate(chunks).astype(np.int64)
    prefix = k.to_bytes(2, "big")
    rec = np.frombuffer(b"".join(key for key in legacy if len(key) == _SAMPLED_KEY.itemsize and key[:2] == prefix),
                        dtype=_SAMPLED_KEY)
    return (rec["u"].astype(np.int64) << _PAIR_BITS) | rec["v"].astype(np.int64)  # keys sort as (u, v)


def _sample_pairs(ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The sorted ``u << 32 | v`` pairs of sample rows (``rows[i]`` holds ``S_k(ids[i])``, padded with -1)."""
    valid = rows >= 0
    pairs = (rows[valid] << _PAIR_BITS) | np.broadcast_to(ids[:, None], rows.shape)[valid]
    pairs.sort()
    return pairs


def _padded_rows(flat: list[int], lengths: list[int], width: int) -> np.ndarray:
    """A ``[len(lengths), width]`` matrix of consecutive runs of ``flat``, padded with -1."""
    out = np.full((len(lengths), width), -1, dtype=np.int64)
    if flat:
        counts = np.asarray(lengths, dtype=np.int64)
        row = np.repeat(np.arange(len(counts)), counts)
        col = np.arange(len(flat)) - np.repeat(np.cumsum(counts) - counts, counts)
        out[row, col] = np.asarray(flat, dtype=np.int64)
    return out


def _split(marks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(tags, iids)`` of combined marks."""
    return marks >> np.uint64(_TAG_SHIFT), marks & np.uint64((1 << _TAG_SHIFT) - 1)


def _mark_records(marks: np.ndarray, flags: np.ndarray) -> bytes:
    rec = np.empty(len(marks), dtype=keys.DIRTY_MARK_RECORD)
    (rec["tag"], rec["iid"]), rec["flags"] = _split(marks), flags
    return rec.tobytes()


class _Batch:
    """Writes of one batch plus the overlay needed to read them back."""

    def __init__(self, handles: Mapping[str, Any]):
        self.wb = WriteBatch(raw_mode=True)
        self.handles = handles
        self.nbrs_family = handles["nbrs"]
        self.pending_nbr: dict[int, dict[bytes, int | None]] = defaultdict(dict)
        self.initial_top: dict[int, list[int]] = {}  # the neighbour ids of the cached prefixes, as they were
        self.initial_degree: dict[int, int] = {}
        self.edges: dict[bytes, bool] = {}
        self.stored_edges: dict[bytes, bool] = {}  # prefetched: does the edge exist before the batch
        self.marks: tuple[np.ndarray, np.ndarray] | None = None  # dirty marks written, for the in-memory mirror
        self.nodes: set[int] = set()
        # the records of ``nodes`` as written, column by column (iid, degree or -1, flags, last ts)
        self.node_columns: tuple[list[int], list[int], list[int], list[float]] = ([], [], [], [])
        self.sampled_removed: dict[int, np.ndarray] = {}  # u << 32 | v pairs per fanout
        self.sampled_added: dict[int, np.ndarray] = {}
        self.sampled_changes = 0  # records of the batch's sampled-by delta

    def put(self, cf: str, key: bytes, value: bytes) -> None:
        self.wb.put(key, value, self.handles[cf])

    def delete(self, cf: str, key: bytes) -> None:
        self.wb.delete(key, self.handles[cf])


_CALLER_META = "caller:"  # meta records of callers (apply(meta=...)), apart from the store's own


class GraphStore:
    """A directed graph with rank-ordered neighbour lists in RocksDB.

    Args:
        path: the database directory (created if missing).
        seed: the sampling seed; fixed when the store is created (default 0).
        feature_dim: the node feature length; fixed when first known.
        cache_nodes: bound on the number of nodes held in the in-memory caches.
        lock_timeout: seconds to keep retrying when another process holds the
            database lock.
        follow: a directory of this reader's own: open the store read-only
            beside the process that writes it (a RocksDB secondary instance,
            which needs no lock), seeing its writes as of the last
            :meth:`catch_up`. Nothing is ever written to ``path``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        seed: int | None = None,
        feature_dim: int | None = None,
        cache_nodes: int = 2_000_000,
        lock_timeout: float = 10.0,
        follow: str | os.PathLike[str] | None = None,
    ):
        self.path = os.fspath(path)
        self.following = follow is not None
        self._db = self._open_follower(self.path, os.fspath(follow)) if follow is not None else \
            self._open(self.path, lock_timeout)
        self._cf = {name: self._db.get_column_family(name) for name in keys.COLUMN_FAMILIES}
        self._families = {name: Family(view, self.path) for name, view in self._cf.items()}  # checked scans
        self._handles = {name: self._db.get_column_family_handle(name) for name in keys.COLUMN_FAMILIES}
        self._write_opts = WriteOptions()
        self._cache_nodes = cache_nodes
        try:
            self.seed = self._init_meta_int("seed", seed, default=0)
            self._rank = seeded_rank_bytes(self.seed)
            self.feature_dim = self._init_meta_int("feature_dim", feature_dim, default=None)
        except BaseException:
            self.close()  # release the lock so a corrected retry can open it
            raise
        stored = self._meta_get("fanouts")
        self.fanouts = tuple(stored) if stored else ()
        self._next_iid = self._meta_get("next_iid") or 0
        self._iid: dict[str, int] = {}
        self._name: dict[int, str] = {}
        self._nodes: dict[int, _Node | None] = {}
        self._top: dict[int, _Prefix] = {}
        self._samples: dict[int, dict[int, list[int]]] = {}  # memo of S_k as iids, dropped when the prefix changes
        self._sampled: dict[int, _SampledIndex] = {}  # the sampled-by index in memory, loaded on first use
        self._delta_seq: int | None = None  # key of the next batch's sampled-by changes
        self._delta_pairs = 0  # sampled-by changes stored since the snapshot (known once the index is loaded)
        self._dense_samples: dict[int, _DenseSamples] = {}  # S_k of many nodes at once, for the engine
        self._dense_nodes = _DenseNodes()
        self._marks: _Marks | None = None  # mirror of the dirty family, loaded on first use
        self._batch: _Batch | None = None

    # ------------------------------------------------------------------ open/close
    @staticmethod
    def _open(path: str, lock_timeout: float) -> Rdict:
        """Open (or create) the database, waiting up to ``lock_timeout`` for another process's lock.

        Raises:
            StateCorrupted: RocksDB finds the MANIFEST (or a table file it names) damaged or missing, or
                the MANIFEST is shorter than the last close left it.
            StoreLockedError: the lock was not released in time.
        """
        _check_manifest(path)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_paranoid_checks(True)  # RocksDB's default, relied on: damage found at open or in the background is an error
        cache = Cache(_BLOCK_CACHE_BYTES)
        cfs = {name: GraphStore._family_options(cache, name) for name in keys.COLUMN_FAMILIES}
        deadline = time.monotonic() + lock_timeout
        while True:
            try:
                return Rdict(path, options=opts, column_families=cfs)
            except Exception as exc:  # rocksdict raises plain Exception
                message = str(exc)
                if is_corruption(exc) or ("No such file" in message and "MANIFEST-" in message):
                    raise state_corrupted(path, exc) from exc
                if "lock" not in message.lower():
                    raise
                if time.monotonic() >= deadline:
                    raise StoreLockedError(
                        f"graph store {path!r} is locked by another process; stop the other "
                        f"gnnstream process using it (one process per store)"
                    ) from exc
                time.sleep(0.1)

    @staticmethod
    def _open_follower(path: str, own_dir: str) -> Rdict:
        """Open ``path`` as a RocksDB secondary instance keeping its own files in ``own_dir``.

        Raises:
            StateCorrupted: as :meth:`_open`.
            FileNotFoundError: there is no state at ``path``.
        """
        if not os.path.isfile(os.path.join(path, "CURRENT")):
            raise FileNotFoundError(f"no graph store at {path!r} (start the worker on it first)")
        _check_manifest(path)
        os.makedirs(own_dir, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.set_max_open_files(-1)  # a secondary must keep table files open: the writer deletes compacted ones
        opts.set_max_file_opening_threads(1)  # else every catch-up starts threads to open files: 10-15 ms each
        cache = Cache(_BLOCK_CACHE_BYTES)
        cfs = {name: GraphStore._family_options(cache, name) for name in keys.COLUMN_FAMILIES}
        try:
            return Rdict(path, options=opts, column_families=cfs, access_type=AccessType.secondary(own_dir))
        except Exception as exc:  # rocksdict raises plain Exception
            if is_corruption(exc):
                raise state_corrupted(path, exc) from exc
            raise

    def catch_up(self) -> None:
        """A follower (``follow=``): see every write the writer made so far, whole batches only."""
        if not self.following:
            raise StoreConfigError(f"store {self.path!r} was not opened as a follower")
        try:
            self._db.try_catch_up_with_primary()
        except Exception as exc:  # rocksdict raises plain Exception
            if is_corruption(exc):
                raise state_corrupted(self.path, exc) from exc
            raise
        interned = self._iid, self._name  # an interned id never changes: only those survive
        self._invalidate_caches()
        self._iid, self._name = interned
        stored = self._meta_get("fanouts")
        self.fanouts = tuple(stored) if stored else ()

    @staticmethod
    def _family_options(cache: Cache, name: str) -> Options:
        """Bloom filters (most edge and id lookups are for keys that do not exist) and a shared block cache.

        Float rows (features, embeddings) do not compress: those families are
        stored uncompressed, which saves flush and compaction CPU.
        """
        table = BlockBasedOptions()
        table.set_bloom_filter(10, False)
        table.set_block_cache(cache)
        opts = Options(raw_mode=True)
        opts.set_block_based_table_factory(table)
        opts.set_memtable_prefix_bloom_ratio(0.05)
        opts.set_memtable_whole_key_filtering(True)
        if name in _FLOAT_FAMILIES:
            opts.set_compression_type(DBCompressionType.none())
        return opts

    def close(self) -> None:
        """Flush and close the database (safe to call twice)."""
        if self._db is None:
            return
        for view in self._cf.values():
            view.close()
        self._db.close()
        # Column-family handles and views keep the native database (and its
        # lock) alive until they are dropped.
        self._cf.clear()
        self._families.clear()
        self._handles.clear()
        self._db = None
        gc.collect()
        if not self.following:
            _record_manifest(self.path)

    def __enter__(self) -> "GraphStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ meta
    def meta(self, name: str) -> Any:
        """A record stored with :meth:`apply`'s ``meta`` (``None`` if there is none)."""
        return self._meta_get(f"{_CALLER_META}{name}")

    def _meta_get(self, name: str) -> Any:
        raw = self._cf["meta"].get(name.encode())
        return None if raw is None else json.loads(raw)

    def _meta_put(self, name: str, value: Any, batch: _Batch | None = None) -> None:
        data = json.dumps(value).encode()
        if batch is None:
            self._cf["meta"].put(name.encode(), data)
        else:
            batch.put("meta", name.encode(), data)

    def _init_meta_int(self, name: str, value: int | None, default: int | None) -> int | None:
        stored = self._meta_get(name)
        if stored is not None:
            if value is not None and value != stored:
                raise StoreConfigError(
                    f"store {self.path!r} was created with {name}={stored}, not {value}; "
                    f"use a new --state directory or pass {name}={stored}"
                )
            return stored
        chosen = default if value is None else value
        if chosen is not None and not self.following:
            if isinstance(chosen, bool) or not isinstance(chosen, int) or chosen < 0:
                raise ValueError(f"Expected a non-negative integer {name} (got {chosen!r})")
            self._meta_put(name, chosen)
        return chosen

    def set_feature_dim(self, dim: int) -> None:
        """Fix the feature length (a model's input width) before any features arrive.

        Raises:
            StoreConfigError: if the store already holds features of another length.
        """
        if self.feature_dim is None:
            self.feature_dim = self._init_meta_int("feature_dim", dim, default=None)
        elif self.feature_dim != dim:
            raise StoreConfigError(
                f"store {self.path!r} holds {self.feature_dim}-dim features, not {dim}; "
                f"use a model with in_dim {self.feature_dim} or a new --state directory"
            )

    def set_fanouts(self, fanouts: Sequence[int]) -> None:
        """Choose the fanouts whose sampled-by index and dirty marks the store keeps.

        Rebuilds the sampled-by index for every node when the fanouts change.
        """
        ks = tuple(sorted({check_fanout(k) for k in fanouts}))
        if ks == self.fanouts:
            return
        # Step 1 drops the index and the stored fanouts together, so a crash
        # part-way leaves fanouts () and the next call rebuilds from scratch.
        batch = _Batch(self._handles)
        batch.wb.delete_range(b"", b"\xff" * 20, self._handles["sampled"])
        self._meta_put("fanouts", [], batch)
        self._db.write(batch.wb, self._write_opts)
        old_size = self.top_size
        self.fanouts = ks
        if self.top_size > old_size:
            self._top.clear()  # cached prefixes are shorter than the new largest fanout
        self._samples.clear()
        self._sampled.clear()
        self._check_indexable()
        pairs: dict[int, list[int]] = {k: [] for k in ks}
        for iid in self.node_iids():
            top = self._top_of(iid).ids
            for k in ks:
                pairs[k].extend((u << _PAIR_BITS) | iid for u in top[:k])
            if len(self._top) > self._cache_nodes:
                self._trim_caches()
        self._sampled = {k: _SampledIndex(np.sort(np.asarray(p, dtype=np.int64))) for k, p in pairs.items()}
        self._fold_sampled()  # the snapshot, written before the fanouts that make it current
        batch = _Batch(self._handles)
        self._meta_put("fanouts", list(ks), batch)
        self._db.write(batch.wb, self._write_opts)
        self._trim_caches()

    @property
    def top_size(self) -> int:
        """How many rank-ordered neighbours are cached per node."""
        return self._top_size

    @property
    def fanouts(self) -> tuple[int, ...]:
        """The fanouts whose sampled-by index and dirty marks the store keeps (:meth:`set_fanouts`)."""
        return self._fanouts

    @fanouts.setter
    def fanouts(self, ks: tuple[int, ...]) -> None:
        self._fanouts = ks
        self._top_size = max(_MIN_TOP, max(ks, default=0))

    # ------------------------------------------------------------------ ids
    def warm_ids(self) -> int:
        """Read the name <-> iid map into memory, up to the node cache bound; return how many were read.

        A long-running worker holds the ids of the nodes it sees anyway; a
        fresh process would otherwise look up each new name of its first
        batches in RocksDB, over a thousand a batch on a large graph.
        """
        room = self._cache_nodes - len(self._iid)
        read = 0
        if room <= 0:
            return read
        known, names, decode = self._iid, self._name, keys.decode_iid
        for key, raw in self._families["ids"].items():
            name = key.decode()
            if name not in known:
                iid = decode(raw)
                known[name] = iid
                names[iid] = name
                read += 1
                if read >= room:
                    break
        return read

    def iid(self, name: str) -> int | None:
        """The interned id of node ``name``, or None if it was never seen."""
        iid = self._iid.get(name)
        if iid is None:
            raw = self._cf["ids"].get(name.encode())
            if raw is None:
                return None
            iid = keys.decode_iid(raw)
            self._iid[name] = iid
            self._name[iid] = name
        return iid

    def name(self, iid: int) -> str:
        """The node id string of interned id ``iid``."""
        name = self._name.get(iid)
        if name is None:
            raw = self._cf["names"].get(keys.encode_iid(iid))
            if raw is None:
                raise KeyError(f"no node with internal id {iid}")
            name = raw.decode()
            self._name[iid] = name
            self._iid[name] = iid
        return name

    def _intern(self, name: str, batch: _Batch) -> int:
        iid = self._iid.get(name)  # the common case, without a call
        if iid is None:
            iid = self.iid(name)
        if iid is None:
            iid = self._next_iid
            self._next_iid += 1
            self._iid[name] = iid
            self._name[iid] = name
            batch.put("ids", name.encode(), keys.encode_iid(iid))
            batch.put("names", keys.encode_iid(iid), name.encode())
        return iid

    # ------------------------------------------------------------------ node records
    def _node(self, iid: int) -> _Node | None:
        node = self._nodes.get(iid, _UNREAD)  # one lookup; None is an absent node
        if node is not _UNREAD:
            return node
        node = _Node.decode(self._cf["nodes"].get(keys.encode_iid(iid)))
        self._nodes[iid] = node
        return node

    def _put_node(self, iid: int, node: _Node | None, batch: _Batch) -> None:
        # Records are mutated in place during the batch and encoded once at its end.
        self._nodes[iid] = node
        batch.nodes.add(iid)

    # ------------------------------------------------------------------ neighbour lists
    def _iter_nbrs(self, v: int, after: bytes | None = None) -> Iterator[tuple[bytes, int]]:
        """Neighbour entries of ``v`` in rank order, merging the open batch."""
        prefix = keys.nbr_prefix(v)
        pending = self._batch.pending_nbr.get(v, {}) if self._batch is not None else {}
        added = sorted((k, u) for k, u in pending.items() if u is not None and (after is None or k > after))
        ai = 0
        it = self._cf["nbrs"].iter()
        it.seek(after + b"\x00" if after is not None else prefix)
        try:
            while it.valid():
                key = it.key()
                if not key.startswith(prefix):
                    break
                if key not in pending:
                    while ai < len(added) and added[ai][0] < key:
                        yield added[ai]
                        ai += 1
                    yield key, keys.decode_iid(it.value())
                it.next()
            else:  # the end of the family, or a read error
                check_iterator(it, self.path)
        finally:
            del it
        yield from added[ai:]

    def _top_of(self, v: int) -> _Prefix:
        top = self._top.get(v)
        if top is None:
            top = _Prefix()
            self._refill(v, top, self.top_size)
            self._top[v] = top
        batch = self._batch
        if batch is not None and v not in batch.initial_top:
            batch.initial_top[v] = top.ids[:]
            node = self._node(v)
            batch.initial_degree[v] = node.degree if node else 0
        return top

    def _refill(self, v: int, top: _Prefix, degree: int) -> None:
        """Read entries after the last one held until ``top`` holds ``min(degree, top_size)``."""
        want = min(degree, self.top_size)
        held, ids = top.keys, top.ids
        if len(held) >= want:
            return
        for key, u in self._iter_nbrs(v, held[-1] if held else None):
            held.append(key)
            ids.append(u)
            if len(held) >= want:
                break

    def _add_nbr(self, v: int, v_name: str, u: int, u_name: str, node: _Node, batch: _Batch) -> int:
        """Add ``u`` to ``N(v)``; return the rank position it took (or a large number)."""
        top = self._top.get(v)
        if top is None:
            top = self._top_of(v)
        elif v not in batch.initial_top:  # _top_of's snapshot, with the record at hand
            batch.initial_top[v] = top.ids[:]
            batch.initial_degree[v] = node.degree
        held = top.keys
        key = keys.nbr_key(v, self._rank(v_name, u_name), u_name)
        truncated = len(held) < node.degree
        node.degree += 1
        batch.wb.put(key, _PACK_U64(u), batch.nbrs_family)
        batch.pending_nbr[v][key] = u
        if truncated and key > held[-1]:
            return 1 << 62
        pos = bisect.bisect_left(held, key)
        self._samples.pop(v, None)  # the memoised samples of v are out of date
        held.insert(pos, key)
        top.ids.insert(pos, u)
        if len(held) > self._top_size:
            held.pop()
            top.ids.pop()
        return pos

    def _remove_nbr(self, v: int, v_name: str, u: int, u_name: str, node: _Node, batch: _Batch) -> int:
        top = self._top_of(v)
        key = keys.nbr_key(v, self._rank(v_name, u_name), u_name)
        node.degree -= 1
        batch.delete("nbrs", key)
        batch.pending_nbr[v][key] = None
        pos = bisect.bisect_left(top.keys, key)
        if pos < len(top.keys) and top.keys[pos] == key:
            self._forget_sample(v)
            del top.keys[pos]
            del top.ids[pos]
            self._refill(v, top, node.degree)
            return pos
        return 1 << 62

    # ------------------------------------------------------------------ validation
    def _validate(self, events: Sequence[Any]) -> int | None:
        dim = self.feature_dim
        for i, ev in enumerate(events):
            op = getattr(ev, "op", None)
            if op in ("edge_upsert", "edge_delete"):
                ids = (ev.src, ev.dst)
            elif op in ("node_upsert", "node_delete"):
                ids = (ev.id,)
            else:
                raise ValueError(f"Expected a graph event with op edge_upsert|edge_delete|node_upsert|node_delete (got {ev!r} at index {i})")
            for node_id in ids:
                if not isinstance(node_id, str) or not node_id:
                    raise ValueError(f"Expected a non-empty string node id (got {node_id!r} in event {i})")
            ts = ev.ts
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
                raise ValueError(f"Expected a finite ts (got {ts!r} in event {i})")
            if op == "edge_upsert" and not _is_finite_number(ev.weight):
                raise ValueError(f"Expected a finite weight (a number, got {ev.weight!r} in event {i})")
            if op == "node_upsert":
                feats = ev.features
                if dim is None:
                    dim = len(feats)
                if len(feats) != dim or dim == 0:
                    raise ValueError(f"Expected {dim} features for node {ev.id!r} (got {len(feats)} in event {i})")
                if not _finite_features(feats):
                    raise ValueError(f"Expected finite features (numbers within float32 range) for node {ev.id!r} "
                                     f"(got {list(feats)[:8]!r} in event {i})")
        return dim

    # ------------------------------------------------------------------ apply
    def apply(
        self,
        events: Sequence[Any],
        offsets: Mapping[tuple[str, int], int] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> ApplyResult:
        """Apply a batch of events and consumed offsets atomically.

        Args:
            events: graph events (objects with ``op`` and the schema's fields).
            offsets: ``{(topic, partition): next_offset}`` consumed by this batch.
            meta: JSON-ready records the caller keeps with its offsets (read
                back with :meth:`meta`), written in the same batch.

        Returns:
            What changed, with sample changes for the store's fanouts.

        Raises:
            ValueError: on an invalid event or an offset moving backwards; nothing
                is written then.
        """
        t = time.perf_counter()
        dim = self._validate(events)
        current = self.offsets()
        for tp, off in (offsets or {}).items():
            if isinstance(off, bool) or not isinstance(off, int) or off < 0:
                raise ValueError(f"Expected a non-negative integer offset for {tp} (got {off!r})")
            if off < current.get(tp, 0):
                raise OffsetRegressionError(f"offset of {tp[0]}[{tp[1]}] would move back from {current[tp]} to {off}")
        batch = _Batch(self._handles)
        self._batch = batch
        result = ApplyResult(self.fanouts)
        t = result.lap("validate", t)
        try:
            if dim != self.feature_dim:
                self.feature_dim = dim
                self._meta_put("feature_dim", dim, batch)
            self._prefetch(events, batch)
            t = result.lap("prefetch", t)
            self._run_events(events, batch, result)
            t = result.lap("events", t)
            self._finish(batch, result)
            for (topic, partition), off in (offsets or {}).items():
                batch.put("offsets", keys.offset_key(topic, partition), keys.U64.pack(off))
            for name, value in (meta or {}).items():
                self._meta_put(f"{_CALLER_META}{name}", value, batch)
            self._meta_put("next_iid", self._next_iid, batch)
            t = result.lap("finish", t)
            result.rows_written = batch.wb.len()
            self._db.write(batch.wb, self._write_opts)
            t = result.lap("write", t)
        except BaseException as exc:
            self._invalidate_caches()
            if is_corruption(exc):  # a read of a damaged block, or RocksDB refusing writes after one
                raise state_corrupted(self.path, exc) from exc
            raise
        finally:
            self._batch = None
        self._dense_nodes.set_many(*batch.node_columns)
        if self._marks is not None and batch.marks is not None:
            self._marks.add(*batch.marks)
        for k, index in self._sampled.items():
            index.update(np.asarray(batch.sampled_removed.get(k, ()), dtype=np.int64),
                         np.asarray(batch.sampled_added.get(k, ()), dtype=np.int64))
        if batch.sampled_changes:
            self._delta_seq = (self._delta_seq or 0) + 1
            self._delta_pairs += batch.sampled_changes
            if self._sampled and self._delta_pairs > _FOLD_PAIRS:
                self._fold_sampled()
        self._trim_caches()
        result.lap("caches", t)
        return result

    def _prefetch(self, events: Sequence[Any], batch: _Batch) -> None:
        """Read the ids, node records and edges a batch will look at with one multi-get each."""
        names: dict[str, None] = {}
        for ev in events:
            if ev.op in ("edge_upsert", "edge_delete"):
                names[ev.src] = names[ev.dst] = None
            else:
                names[ev.id] = None
        unknown = [n for n in names if n not in self._iid]
        if unknown:
            for name, raw in zip(unknown, self._cf["ids"].get([n.encode() for n in unknown])):
                if raw is not None:
                    iid = keys.decode_iid(raw)
                    self._iid[name] = iid
                    self._name[iid] = name
        known = self._iid
        cold = [known[n] for n in names if n in known and known[n] not in self._nodes]
        if cold:  # from the in-memory mirror where it has them (it holds what is stored), else one multi-get
            ids = np.fromiter(cold, np.int64, len(cold))
            dense = self._dense_nodes
            mirrored = np.zeros(len(ids), dtype=bool)
            inside = ids < len(dense.known)
            mirrored[inside] = dense.known[ids[inside]]
            hit = ids[mirrored]
            for iid, degree, flags, last_ts in zip(hit.tolist(), dense.degree[hit].tolist(), dense.flags[hit].tolist(),
                                                   dense.last_ts[hit].tolist()):
                self._nodes[iid] = None if degree < 0 else _Node(degree, flags, last_ts)
            cold = ids[~mirrored].tolist()
            if cold:
                for iid, raw in zip(cold, self._cf["nodes"].get([keys.encode_iid(i) for i in cold])):
                    self._nodes[iid] = _Node.decode(raw)
        pairs: dict[bytes, None] = {}
        for ev in events:
            if ev.op in ("edge_upsert", "edge_delete"):
                s, d = known.get(ev.src), known.get(ev.dst)
                if s is not None and d is not None:
                    pairs[keys.edge_key(s, d)] = pairs[keys.edge_key(d, s)] = None
        if pairs:
            wanted = list(pairs)
            batch.stored_edges = {k: raw is not None for k, raw in zip(wanted, self._cf["edges"].get(wanted))}

    def _touch(self, name: str, ts: float, batch: _Batch, result: ApplyResult) -> tuple[int, _Node]:
        iid = self._intern(name, batch)
        node = self._node(iid)
        if node is None:
            node = _Node(0, 0, ts)
            result.created.add(iid)
            result.features_changed.add(iid)
            result.deleted.discard(iid)
            if iid not in self._top:  # a new or deleted node has no neighbour entries
                self._top[iid] = _Prefix()
            self._top_of(iid)
        if ts > node.last_ts:
            node.last_ts = float(ts)
        self._put_node(iid, node, batch)
        return iid, node

    def _edge_exists(self, key: bytes) -> bool:
        """Whether the edge of ``key`` (:func:`keys.edge_key`) is present, this batch's writes included."""
        batch = self._batch
        assert batch is not None
        if key in batch.edges:
            return batch.edges[key]
        stored = batch.stored_edges.get(key)
        return self._cf["edges"].get(key) is not None if stored is None else stored

    def _set_edge(self, batch: _Batch, key: bytes, record: bytes | None) -> None:
        if record is None:
            batch.delete("edges", key)
        else:
            batch.put("edges", key, record)
        batch.edges[key] = record is not None

    def _link(self, a: int, a_name: str, an: _Node, b: int, b_name: str, bn: _Node,
              batch: _Batch, result: ApplyResult, touches: list, add: bool) -> None:
        change = self._add_nbr if add else self._remove_nbr
        touches.append((a, change(a, a_name, b, b_name, an, batch)))
        touches.append((b, change(b, b_name, a, a_name, bn, batch)))
        result.degree_changed.update((a, b))

    def _run_events(self, events: Sequence[Any], batch: _Batch, result: ApplyResult) -> None:
        """Apply each event of a validated batch in order.

        An edge upsert between two nodes already read (the common case after
        :meth:`_prefetch`) runs inline with its lookups bound once a batch;
        anything else goes through the ``_apply_<op>`` handlers.
        """
        handlers = {op: getattr(self, "_apply_" + op) for op in ("edge_upsert", "edge_delete", "node_upsert", "node_delete")}
        append = result.event_touches.append
        iid_of, node_of, put_node = self._iid.get, self._nodes.get, batch.nodes.add
        edges, stored = batch.edges, batch.stored_edges.get
        put, family, pack_edge, edge_key = batch.wb.put, batch.handles["edges"], keys.EDGE_RECORD.pack, keys.edge_key
        add_nbr, degree_changed = self._add_nbr, result.degree_changed
        max_ts = result.max_ts

        def exists(key: bytes) -> bool:  # _edge_exists with the batch's tables bound (a method call costs more)
            known = edges.get(key)
            if known is None:
                known = stored(key)
            return self._edge_exists(key) if known is None else known

        for ev in events:
            touches: list[tuple[int, int]] = []
            append(touches)
            ts = ev.ts
            if ts > max_ts:
                max_ts = float(ts)
            if ev.op != "edge_upsert" or (s := iid_of(ev.src)) is None or (d := iid_of(ev.dst)) is None \
                    or (sn := node_of(s)) is None or (dn := node_of(d)) is None:
                handlers[ev.op](ev, batch, result, touches)
                continue
            # both endpoints exist and are read: _touch without the lookups it would repeat
            if ts > sn.last_ts:
                sn.last_ts = float(ts)
            if ts > dn.last_ts:
                dn.last_ts = float(ts)
            put_node(s)
            put_node(d)
            key = edge_key(s, d)
            existed = exists(key)
            put(key, pack_edge(float(ev.weight), float(ts)), family)
            edges[key] = True
            if not existed and s != d and not exists(edge_key(d, s)):
                touches.append((s, add_nbr(s, ev.src, d, ev.dst, sn, batch)))
                touches.append((d, add_nbr(d, ev.dst, s, ev.src, dn, batch)))
                degree_changed.add(s)
                degree_changed.add(d)
        result.max_ts = max_ts

    def _apply_edge_upsert(self, ev: Any, batch: _Batch, result: ApplyResult, touches: list) -> None:
        s, sn = self._touch(ev.src, ev.ts, batch, result)
        d, dn = self._touch(ev.dst, ev.ts, batch, result)
        key = keys.edge_key(s, d)
        existed = self._edge_exists(key)
        self._set_edge(batch, key, keys.EDGE_RECORD.pack(float(ev.weight), float(ev.ts)))
        if not existed and s != d and not self._edge_exists(keys.edge_key(d, s)):
            self._link(s, ev.src, sn, d, ev.dst, dn, batch, result, touches, add=True)

    def _apply_edge_delete(self, ev: Any, batch: _Batch, result: ApplyResult, touches: list) -> None:
        s, d = self.iid(ev.src), self.iid(ev.dst)
        key = None if s is None or d is None else keys.edge_key(s, d)
        if key is None or not self._edge_exists(key):
            return
        self._set_edge(batch, key, None)
        if s != d and not self._edge_exists(keys.edge_key(d, s)):
            sn, dn = self._node(s), self._node(d)
            self._put_node(s, sn, batch)
            self._put_node(d, dn, batch)
            self._link(s, ev.src, sn, d, ev.dst, dn, batch, result, touches, add=False)

    def _apply_node_upsert(self, ev: Any, batch: _Batch, result: ApplyResult, touches: list) -> None:
        iid, node = self._touch(ev.id, ev.ts, batch, result)
        node.flags |= keys.FLAG_HAS_FEATURES
        self._put_node(iid, node, batch)
        batch.put("feats", keys.encode_iid(iid), np.asarray(ev.features, dtype="<f4").tobytes())
        result.features_changed.add(iid)

    def _apply_node_delete(self, ev: Any, batch: _Batch, result: ApplyResult, touches: list) -> None:
        v = self.iid(ev.id)
        node = None if v is None else self._node(v)
        if node is None:
            return
        self._top_of(v)  # snapshot the sample before the delete
        entries = list(self._iter_nbrs(v))
        for key, u in entries:
            u_name = key[16:].decode()
            for a, b in ((v, u), (u, v)):
                edge = keys.edge_key(a, b)
                if self._edge_exists(edge):
                    self._set_edge(batch, edge, None)
            un = self._node(u)
            self._put_node(u, un, batch)
            touches.append((u, self._remove_nbr(u, u_name, v, ev.id, un, batch)))
            result.degree_changed.add(u)
        # v's own neighbour list goes in one range delete (linear in the degree overall)
        batch.wb.delete_range(keys.nbr_prefix(v), keys.nbr_prefix(v + 1), self._handles["nbrs"])
        pending = batch.pending_nbr[v]
        for key, _ in entries:
            pending[key] = None
        self._top[v] = _Prefix()
        self._forget_sample(v)
        if entries:
            touches.append((v, 0))
            result.degree_changed.add(v)
        node.degree = 0
        loop = keys.edge_key(v, v)
        if self._edge_exists(loop):
            self._set_edge(batch, loop, None)
        self._put_node(v, None, batch)
        batch.delete("feats", keys.encode_iid(v))
        result.features_changed.add(v)
        result.deleted.add(v)
        result.created.discard(v)

    def _finish(self, batch: _Batch, result: ApplyResult) -> None:
        """Node records, net sample changes, the sampled-by index and dirty marks."""
        put, delete, family = batch.wb.put, batch.wb.delete, batch.handles["nodes"]
        pack_key, pack_node, nodes = keys.U64.pack, keys.NODE_RECORD.pack, self._nodes
        touched = list(batch.nodes)
        records = [nodes[iid] for iid in touched]
        gone = [i for i, node in enumerate(records) if node is None]
        for i in gone:
            delete(pack_key(touched[i]), family)
            records[i] = _GONE
        degree = [node.degree for node in records]
        flags = [node.flags for node in records]
        last_ts = [node.last_ts for node in records]
        columns = zip(touched, degree, flags, last_ts)
        if gone:  # the deleted ones were deleted above
            columns = (column for column, node in zip(columns, records) if node is not _GONE)
        for iid, deg, flag, ts in columns:
            put(pack_key(iid), pack_node(deg, flag, ts), family)
        batch.node_columns = touched, degree, flags, last_ts
        # every node whose cached prefix may have changed: compare before and after, vectorised over nodes
        width = max((*self.fanouts, *(d.k for d in self._dense_samples.values())), default=0)
        ids, before_m, after_m, deg = self._prefix_changes(batch, width)
        for d in self._dense_samples.values():  # write-through: the new S_k rows replace the old ones
            d.grow(self._next_iid)
            d.mat[ids] = after_m[:, :d.k]
            d.valid[ids] = True
        delta: list[np.ndarray] = []  # this batch's sampled-by changes: one record
        mark_parts: list[tuple[int, np.ndarray, int]] = [
            (0, np.fromiter(result.features_changed, np.int64, len(result.features_changed)), DIRTY_INPUT),
            (0, np.fromiter(result.degree_changed, np.int64, len(result.degree_changed)), DIRTY_DEGREE),
        ]
        for k in self.fanouts:
            old, new = before_m[:, :k], after_m[:, :k]
            rows = (old != new).any(axis=1)
            ids_k, old, new = ids[rows], old[rows], new[rows]
            old_pairs, new_pairs = _sample_pairs(ids_k, old), _sample_pairs(ids_k, new)
            removed = old_pairs[~_member(new_pairs, old_pairs)]
            added = new_pairs[~_member(old_pairs, new_pairs)]
            for pairs, sink, flag in ((removed, batch.sampled_removed, 0), (added, batch.sampled_added, 1)):
                rec = np.empty(len(pairs), dtype=_SAMPLED_DELTA)
                rec["k"], rec["added"], rec["pair"] = k, flag, pairs
                delta.append(rec)
                sink[k] = pairs
            counted = deg[np.minimum(deg[:, 1], k) != np.minimum(deg[:, 2], k), 0]
            result.sample_changed[k] = set(ids_k.tolist())
            result.count_changed[k] = set(counted.tolist())
            mark_parts += [(k, ids_k, DIRTY_SAMPLE), (k, counted, DIRTY_COUNT)]
        if not self.fanouts:
            return
        changes = np.concatenate(delta)
        if len(changes):
            self._check_indexable()
            batch.put("sampled", keys.sampled_delta_key(self._next_delta()), changes.tobytes())
            batch.sampled_changes = len(changes)
        marks, flags = _or_reduce([(_combine(np.full(len(a), t), a), np.full(len(a), f, dtype=np.uint8))
                                   for t, a, f in mark_parts])
        if len(marks):  # one packed block: flags of marks already stored are OR-combined when read
            key, value = self._mark_block(marks, flags)
            batch.put("dirty", key, value)
            batch.marks = marks, flags

    def _prefix_changes(self, batch: _Batch, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(ids, before, after, moved)``: the nodes whose first ``width`` prefix ids (all that can be sampled)
        differ after the batch, those ids before and after as ``[len(ids), width]`` matrices padded with -1, and
        ``(v, degree before, degree after)`` rows of every node whose degree changed."""
        nodes, tops, degree0 = self._nodes, self._top, batch.initial_degree
        changed: list[int] = []
        before_ids: list[int] = []  # the first ``width`` neighbour ids of every changed prefix, flattened
        after_ids: list[int] = []
        before_len: list[int] = []
        after_len: list[int] = []
        moved: list[int] = []  # v, degree before, degree after of every node whose degree changed, flattened
        empty = _Prefix()
        for v, before_top in batch.initial_top.items():
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
        return (np.asarray(changed, dtype=np.int64), _padded_rows(before_ids, before_len, width),
                _padded_rows(after_ids, after_len, width), np.fromiter(moved, np.int64, len(moved)).reshape(-1, 3))

    # ------------------------------------------------------------------ caches
    def _forget_sample(self, v: int) -> None:
        """Drop the memoised samples of ``v`` (its rank-ordered prefix changed; dense rows are rewritten at the end of the batch)."""
        self._samples.pop(v, None)

    def _invalidate_caches(self) -> None:
        self._iid.clear()
        self._name.clear()
        self._nodes.clear()
        self._top.clear()
        self._samples.clear()
        self._sampled.clear()
        self._delta_seq, self._delta_pairs = None, 0
        self._dense_samples.clear()
        self._dense_nodes = _DenseNodes()
        self._marks = None
        self._next_iid = self._meta_get("next_iid") or 0
        self.feature_dim = self._meta_get("feature_dim")

    def _trim_caches(self) -> None:
        if len(self._top) > self._cache_nodes:
            self._top.clear()
            self._samples.clear()
        if len(self._nodes) > self._cache_nodes:
            self._nodes.clear()
        if len(self._iid) > 2 * self._cache_nodes:
            self._iid.clear()
            self._name.clear()

    # ------------------------------------------------------------------ reads by iid
    def node_iids(self) -> Iterator[int]:
        """Interned ids of every existing node, in id order."""
        for key in self._families["nodes"].keys():
            yield keys.decode_iid(key)

    def exists_iid(self, iid: int) -> bool:
        return self._node(iid) is not None

    def node_info_iid(self, iid: int) -> tuple[int, bool, float]:
        """``(degree, has_features, last event ts)`` of a node (zeros when absent)."""
        node = self._node(iid)
        if node is None:
            return 0, False, 0.0
        return node.degree, bool(node.flags & keys.FLAG_HAS_FEATURES), node.last_ts

    def degree_iid(self, iid: int) -> int:
        node = self._node(iid)
        return 0 if node is None else node.degree

    def has_features_iid(self, iid: int) -> bool:
        node = self._node(iid)
        return bool(node and node.flags & keys.FLAG_HAS_FEATURES)

    def sample_iids(self, iid: int, k: int) -> list[int]:
        """``S_k`` of node ``iid`` as interned ids in rank order; O(k) reads.

        The list may be shared with the store's memo: do not modify it.
        """
        memo = self._samples.get(iid)
        if memo is not None and k in memo:
            return memo[k]
        return self._read_sample(iid, k, remember=self._batch is None)

    def _read_sample(self, iid: int, k: int, remember: bool) -> list[int]:
        """``S_k`` of ``iid`` from its neighbour-list prefix (or index); ``remember`` keeps it in the memo."""
        if self._node(iid) is None:
            return []
        if k <= self.top_size:
            out = self._top_of(iid).ids[:k]
            if remember:
                self._samples.setdefault(iid, {})[k] = out
            return out
        out = []
        for _, u in self._iter_nbrs(iid):
            if len(out) >= k:
                break
            out.append(u)
        return out

    def ranked_neighbours(self, iid: int) -> Iterator[tuple[bytes, int]]:
        """``N(v)`` of node ``iid`` in sampling order, read lazily: ``(order key, u iid)`` pairs, the order key
        being ``r(v, u)`` as 8 big-endian bytes followed by ``u``'s id in UTF-8 (empty for an absent node)."""
        if self._node(iid) is None:
            return
        for key, u in self._iter_nbrs(iid):
            yield key[8:], u

    def node_arrays(self, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(degree, flags, last_ts)`` of many nodes as arrays; degree is -1 where a node is absent."""
        iids = np.asarray(iids, dtype=np.int64)
        dense = self._dense_nodes
        if len(iids) == 0:
            return dense.degree[:0].copy(), dense.flags[:0].copy(), dense.last_ts[:0].copy()
        dense.grow(int(iids.max()) + 1)
        missing = iids[~dense.known[iids]]
        if len(missing):
            for iid in unique_ids(missing).tolist():
                dense.set(iid, self._node(iid))
        return dense.degree[iids], dense.flags[iids], dense.last_ts[iids]

    def sample_matrix(self, k: int, iids: np.ndarray) -> np.ndarray:
        """``S_k`` of many nodes: an ``[len(iids), k]`` iid matrix in rank order, padded with -1.

        Rows are cached (write-through: a row is dropped when the node's
        sample changes), so a node read again costs no RocksDB read.
        """
        iids = np.asarray(iids, dtype=np.int64)
        if self._batch is not None or k > self.top_size:
            out = np.full((len(iids), k), -1, dtype=np.int64)
            for row, v in enumerate(iids.tolist()):
                s = self.sample_iids(v, k)
                out[row, :len(s)] = s
            return out
        dense = self._dense_samples.get(k)
        if dense is None:
            dense = self._dense_samples[k] = _DenseSamples(k)
        if len(iids):
            dense.grow(int(iids.max()) + 1)
            missing = iids[~dense.valid[iids]]
            if len(missing):
                mat = dense.mat
                for v in unique_ids(missing).tolist():  # the rows are the cache: no memo besides
                    s = self._read_sample(v, k, remember=False)
                    mat[v, :len(s)] = s
                    mat[v, len(s):] = -1
                dense.valid[missing] = True
        return dense.mat[iids]

    def _check_indexable(self) -> None:
        if self._next_iid > _MAX_INDEXED_IDS:
            raise StoreConfigError(f"the sampled-by index holds at most {_MAX_INDEXED_IDS} nodes "
                                   f"(this store has interned {self._next_iid})")

    def _next_delta(self) -> int:
        """The key number for the next batch's sampled-by changes (one past the newest stored)."""
        if self._delta_seq is None:
            it = self._cf["sampled"].iter()
            it.seek_for_prev(keys.SAMPLED_DELTA_PREFIX + b"\xff" * 8)
            if it.valid():
                last = it.key()
            else:
                last = None
                check_iterator(it, self.path)
            del it
            self._delta_seq = (keys.decode_iid(last[2:]) + 1
                               if last is not None and len(last) == 10 and last.startswith(keys.SAMPLED_DELTA_PREFIX) else 0)
        return self._delta_seq

    def _sampled_index(self, k: int) -> _SampledIndex | None:
        """The in-memory sampled-by index of fanout ``k`` (None when ``k`` is not one of the fanouts).

        The first call loads every fanout's index: the snapshot, then the
        stored changes of each batch since, in order. A store with the
        per-pair layout of older versions, or with more changes than
        :data:`_FOLD_PAIRS` waiting, gets a new snapshot at once.
        """
        if k not in self.fanouts:
            return None
        if not self._sampled:
            self._load_sampled()
        return self._sampled[k]

    def _load_sampled(self) -> None:
        snapshot: dict[int, list[np.ndarray]] = defaultdict(list)
        legacy: list[bytes] = []
        deltas: list[np.ndarray] = []  # in key order, which is batch order
        seq = -1
        for key, value in self._families["sampled"].items():
            if len(key) == 8 and key.startswith(keys.SAMPLED_SNAPSHOT_PREFIX):
                snapshot[int.from_bytes(key[2:4], "big")].append(np.frombuffer(value, dtype="<i8"))
            elif len(key) == 10 and key.startswith(keys.SAMPLED_DELTA_PREFIX):
                deltas.append(np.frombuffer(value, dtype=_SAMPLED_DELTA))
                seq = keys.decode_iid(key[2:])
            else:
                legacy.append(key)
        indexes = {k: _SampledIndex(_pairs_of(snapshot.get(k), legacy, k)) for k in self.fanouts}
        for rec in deltas:
            for k, index in indexes.items():
                mine = rec[rec["k"] == k]
                index.update(mine["pair"][mine["added"] == 0], mine["pair"][mine["added"] == 1])
        pending = sum(len(rec) for rec in deltas)
        self._sampled = indexes
        self._delta_seq, self._delta_pairs = seq + 1, pending
        if legacy or pending > _FOLD_PAIRS:
            self._fold_sampled()

    def _fold_sampled(self) -> None:
        """Replace the stored sampled-by relation with a snapshot of the in-memory one (one WriteBatch)."""
        wb = WriteBatch(raw_mode=True)
        handle = self._handles["sampled"]
        wb.delete_range(b"", b"\xff" * 20, handle)
        for k, index in self._sampled.items():
            pairs = index.pairs().astype("<i8")
            for chunk, start in enumerate(range(0, len(pairs), _SNAPSHOT_PAIRS)):
                wb.put(keys.sampled_snapshot_key(k, chunk), pairs[start:start + _SNAPSHOT_PAIRS].tobytes(), handle)
        self._db.write(wb, self._write_opts)
        self._delta_pairs = 0

    def sampled_by(self, k: int, u: int, limit: int | None = None) -> list[int]:
        """Nodes ``v`` with ``u`` in ``S_k(v)`` in id order (k must be one of the store's fanouts).

        Args:
            limit: return at most this many.
        """
        deps, _ = self.sampled_by_many(k, np.asarray([u], dtype=np.int64), None)
        return deps[:limit].tolist() if limit is not None else deps.tolist()

    def sampled_by_many(self, k: int, sources: np.ndarray, bound: int | None) -> tuple[np.ndarray, np.ndarray]:
        """The union of ``sampled_by(k, u)`` over ``sources``, leaving out sources with more than ``bound``.

        Returns:
            ``(dependents, over)``: the dependents (with repeats) and the sources
            left out for having more than ``bound`` dependents.
        """
        sources = np.asarray(sources, dtype=np.int64)
        index = self._sampled_index(k)
        if index is None:  # not one of the store's fanouts: no sample of that size is kept
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return index.lookup(sources, bound)

    def feature_rows(self, iids: Sequence[int], dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Features of ``iids`` as a float32 matrix and a has-features mask (zeros where absent).

        Args:
            dim: the row width to return while the store has no features yet.
        """
        dim = self.feature_dim or dim or 0
        out = np.zeros((len(iids), dim), dtype=np.float32)
        has = np.zeros(len(iids), dtype=bool)
        if not iids or not dim:
            return out, has
        raws = self._cf["feats"].get([keys.encode_iid(i) for i in iids])
        for row, raw in enumerate(raws):
            if raw is not None:
                out[row] = np.frombuffer(raw, dtype="<f4")
                has[row] = True
        return out, has

    # ------------------------------------------------------------------ reads by name
    def exists(self, name: str) -> bool:
        iid = self.iid(name)
        return iid is not None and self._node(iid) is not None

    def degree(self, name: str) -> int:
        iid = self.iid(name)
        return 0 if iid is None else self.degree_iid(iid)

    def neighbors(self, name: str) -> list[str]:
        """``N(v)`` in rank order (O(degree))."""
        iid = self.iid(name)
        if iid is None or self._node(iid) is None:
            return []
        return [self.name(u) for _, u in self._iter_nbrs(iid)]

    def sample(self, name: str, k: int) -> list[str]:
        """``S_k(v)`` in rank order: O(k) reads, never O(degree)."""
        check_fanout(k)
        iid = self.iid(name)
        if iid is None or self._node(iid) is None:
            return []
        top = self._top.get(iid)
        if top is not None and k <= self.top_size:
            held = top.keys[:k]
        else:
            held = []
            for key, _ in self._iter_nbrs(iid):
                if len(held) >= k:
                    break
                held.append(key)
        return [key[16:].decode() for key in held]

    def features(self, name: str) -> np.ndarray | None:
        iid = self.iid(name)
        if iid is None or not self.has_features_iid(iid):
            return None
        rows, _ = self.feature_rows([iid])
        return rows[0]

    def edge(self, src: str, dst: str) -> tuple[float, float] | None:
        """``(weight, ts)`` of edge ``src -> dst`` or None."""
        s, d = self.iid(src), self.iid(dst)
        if s is None or d is None:
            return None
        raw = self._cf["edges"].get(keys.edge_key(s, d))
        return None if raw is None else keys.EDGE_RECORD.unpack(raw)

    def nodes(self) -> Iterator[str]:
        for iid in self.node_iids():
            yield self.name(iid)

    def edges(self) -> Iterator[tuple[str, str, float, float]]:
        for key, raw in self._families["edges"].items():
            s, d = keys.decode_edge_key(key)
            w, ts = keys.EDGE_RECORD.unpack(raw)
            yield self.name(s), self.name(d), w, ts

    def num_nodes(self) -> int:
        return sum(1 for _ in self._families["nodes"].keys())

    def offsets(self) -> dict[tuple[str, int], int]:
        """Stored next offsets per ``(topic, partition)``."""
        return {keys.decode_offset_key(k): keys.U64.unpack(v)[0] for k, v in self._families["offsets"].items()}

    # ------------------------------------------------------------------ raw access for the engine
    def _mark_state(self) -> _Marks:
        """The in-memory mirror of the ``dirty`` family (read once, then kept in step by
        :meth:`apply` and :meth:`write`)."""
        if self._marks is None:
            state = _Marks()
            for key, value in self._families["dirty"].items():
                state.add_stored(key, value)
            self._marks = state
        return self._marks

    def _mark_block(self, marks: np.ndarray, flags: np.ndarray) -> tuple[bytes, bytes]:
        state = self._mark_state()
        key = keys.dirty_block_key(state.next_seq)
        state.next_seq += 1
        return key, _mark_records(marks, flags)

    def dirty_mark_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every dirty mark once, in (tag, iid) order: ``(tags, iids, flags)``, flags OR-combined."""
        marks, flags = self._mark_state().reduced()
        tags, iids = _split(marks)
        return tags.astype(np.int64), iids.astype(np.int64), flags.copy()

    def dirty_count(self) -> int:
        """The number of distinct dirty marks."""
        return len(self._mark_state().reduced()[0])

    def mark_put(self, tags: np.ndarray, iids: np.ndarray, flags: np.ndarray) -> tuple[str, bytes, bytes]:
        """A :meth:`write` item that stores these dirty marks as one block."""
        key, value = self._mark_block(_combine(tags, iids), np.asarray(flags, dtype=np.uint8))
        return "dirty", key, value

    def column(self, name: str) -> Family:
        """The column family ``name`` (engine-owned families: dirty, emb, embmeta, embpages, layerpages, outbox),
        with scans that raise :class:`StateCorrupted` on a read error (:class:`Family`)."""
        return self._families[name]

    def write(self, puts: Iterable[tuple[str, bytes, bytes | None]], clear: Sequence[str] = ()) -> int:
        """Write ``(family, key, value-or-None-to-delete)`` triples in one WriteBatch.

        Args:
            clear: families emptied first in the same batch, with one range
                delete (cheap to iterate past, unlike a tombstone per key).

        Returns:
            The number of records in the WriteBatch.
        """
        wb = WriteBatch(raw_mode=True)
        handles = self._handles
        for cf in clear:
            wb.delete_range(b"", b"\xff" * 32, handles[cf])
        put, delete = wb.put, wb.delete
        marks: list[tuple[bytes, bytes | None]] = []  # dirty writes, replayed on the mirror once written
        for cf, key, value in puts:
            if value is None:
                delete(key, handles[cf])
            else:
                put(key, value, handles[cf])
            if cf == "dirty":
                marks.append((key, value))
        rows = wb.len()
        try:
            self._db.write(wb, self._write_opts)
        except BaseException as exc:
            self._marks = None
            if is_corruption(exc):  # RocksDB stops writing once a flush or compaction met a damaged file
                raise state_corrupted(self.path, exc) from exc
            raise
        state = self._marks
        if state is not None:
            if "dirty" in clear:
                state.clear()
            for key, value in marks:
                if value is None:  # a single mark or block removed: read the family again when next needed
                    self._marks = None
                    break
                state.add_stored(key, value)
        return rows
