"""The graph store: the one entry point to a state's graph, composed of its parts (identity and meta records,
interned ids and node records, the neighbour index, the sampled-by relation, dirty marks), with the atomic
writes of a batch of events (:meth:`GraphStore.apply`) and of a :class:`~gnnstream.graph_state.transaction.Transaction`
(:meth:`GraphStore.commit`)."""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
from rocksdict import IngestExternalFileOptions, Rdict, WriteBatch, WriteOptions

from gnnstream.graph_state import keys
from gnnstream.graph_state.apply import EventApplier
from gnnstream.graph_state.batch import ApplyResult, Batch, validate_events
from gnnstream.graph_state.db import (Columns, Family, is_corruption, open_db, open_follower, record_manifest,
                                      state_corrupted, write_table)
from gnnstream.graph_state.exceptions import StoreConfigError
from gnnstream.graph_state.marks import MarkLog, combine
from gnnstream.graph_state.meta import StateMeta, check_offsets, stored_offsets
from gnnstream.graph_state.neighbours import NeighbourIndex
from gnnstream.graph_state.nodes import NodeIds, NodeRecords
from gnnstream.graph_state.sampled import PAIR_BITS, SampledBy, check_indexable
from gnnstream.graph_state.sampler import check_fanout, seeded_rank_bytes
from gnnstream.graph_state.transaction import Transaction

__all__ = ["GraphStore", "ApplyResult"]

logger = logging.getLogger(__name__)

_MIN_TOP = 8  # prefix width of a store without fanouts (or with small ones)


class GraphStore:
    """A directed graph with rank-ordered neighbour lists in RocksDB.

    A subclass may override the hooks :meth:`_open`, :meth:`_meta_put`,
    :meth:`_fold_sampled`, :meth:`commit` and :meth:`close` (a read-only store
    does).

    Args:
        path: the database directory (created if missing).
        seed: the sampling seed; fixed when the store is created (default 0).
        feature_dim: the node feature length; fixed when first known.
        cache_nodes: bound on the number of nodes held in the in-memory caches.
        lock_timeout: seconds to keep retrying when another process holds the
            database lock.
        edge_ttl: the edge window in seconds (0: none, every edge is kept); fixed when the store is created
            (None: the stored one).
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
        edge_ttl: int | None = None,
        cache_nodes: int = 2_000_000,
        lock_timeout: float = 10.0,
        follow: str | os.PathLike[str] | None = None,
    ):
        self.path = os.fspath(path)
        self.following = follow is not None
        self._db = open_follower(self.path, os.fspath(follow)) if follow is not None else \
            self._open(self.path, lock_timeout)
        self._cf = {name: self._db.get_column_family(name) for name in keys.COLUMN_FAMILIES}
        self._families = {name: Family(view, self.path) for name, view in self._cf.items()}  # checked scans
        self._handles = {name: self._db.get_column_family_handle(name) for name in keys.COLUMN_FAMILIES}
        self._write_opts = WriteOptions()
        self._cache_nodes = cache_nodes
        this = weakref.proxy(self)  # the parts call the hooks below without keeping the store alive
        columns = Columns(self.path, self._cf, self._families, self._handles, lambda wb: this._write(wb))
        self._meta = StateMeta(columns, self.following, lambda name, value, batch: this._meta_put(name, value, batch))
        try:
            self._meta.check_layout()
            self.seed = self._meta.init_int(keys.META_SEED, seed, default=0)
            self.feature_dim = self._meta.init_int(keys.META_FEATURE_DIM, feature_dim, default=None)
            held_ttl = self._meta.get(keys.META_EDGE_TTL)
            if edge_ttl is not None and held_ttl is not None and edge_ttl != held_ttl:
                raise StoreConfigError(
                    f"state {self.path!r} was created with --edge-ttl {held_ttl}, not {edge_ttl}; a state's edge "
                    f"window is fixed when it is created: leave out --edge-ttl, or rebuild the state in a new "
                    f"directory with `gnnstream graph load --edge-ttl {edge_ttl}` and `gnnstream backfill`")
            self.edge_ttl = self._meta.init_int(keys.META_EDGE_TTL, edge_ttl, default=0)
        except BaseException:
            self.close()  # release the lock so a corrected retry can open it
            raise
        self._ids = NodeIds(columns, self._meta.next_iid())
        self._nodes = NodeRecords(columns)
        self._nbrs = NeighbourIndex(columns, seeded_rank_bytes(self.seed), self._nodes, lambda: this.iid_bound)
        self._sampled = SampledBy(columns, lambda: this._fold_sampled())
        self._marks = MarkLog(columns)
        self._events = EventApplier(columns, self._ids, self._nodes, self._nbrs, self._sampled, self._marks)
        self._events.edge_ttl = float(self.edge_ttl)
        self._events.stream_time = self._meta.get(keys.META_STREAM_TIME)
        self.fanouts = self._meta.fanouts()

    # ------------------------------------------------------------------ open/close and hooks
    def _open(self, path: str, lock_timeout: float) -> Rdict:
        """Open the database for writing (:func:`gnnstream.graph_state.db.open_db`); a read-only store overrides it."""
        return open_db(path, lock_timeout)

    def _write(self, wb: WriteBatch) -> None:
        self._db.write(wb, self._write_opts)

    def _meta_put(self, name: str, value: Any, batch: Batch | None = None) -> None:
        """Store the JSON meta record ``name``, in ``batch`` or at once; a read-only store overrides it."""
        self._meta.write(name, value, batch)

    def _fold_sampled(self) -> None:
        """Replace the stored sampled-by relation with a snapshot of the in-memory one; a read-only store
        overrides it."""
        self._sampled.fold()

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
        self._invalidate_caches(keep_ids=True)  # a name's id never changes once handed out
        self._trim_caches()  # the ids kept stay within the cache's bound
        self.fanouts = self._meta.fanouts()

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
            record_manifest(self.path)

    def __enter__(self) -> "GraphStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ identity and settings
    def meta(self, name: str) -> Any:
        """A record stored with :meth:`apply`'s ``meta`` (``None`` if there is none)."""
        return self._meta.get(f"{keys.META_CALLER}{name}")

    def set_feature_dim(self, dim: int) -> None:
        """Fix the feature length (a model's input width) before any features arrive.

        Raises:
            StoreConfigError: if the store already holds features of another length.
        """
        if self.feature_dim is None:
            self.feature_dim = self._meta.init_int(keys.META_FEATURE_DIM, dim, default=None)
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
        batch = Batch(self._handles)
        batch.wb.delete_range(b"", b"\xff" * 20, self._handles["sampled"])
        self._meta_put(keys.META_FANOUTS, [], batch)
        self._write(batch.wb)
        self.fanouts = ks
        self._sampled.clear()
        check_indexable(self._ids.next_iid)
        pairs: dict[int, list[int]] = {k: [] for k in ks}
        for iid in self.node_iids():
            top = self._nbrs.prefix_ids(iid)
            for k in ks:
                pairs[k].extend((u << PAIR_BITS) | iid for u in top[:k])
        self._sampled.rebuild(pairs)  # the snapshot, written before the fanouts that make it current
        batch = Batch(self._handles)
        self._meta_put(keys.META_FANOUTS, list(ks), batch)
        self._write(batch.wb)
        self._trim_caches()

    @property
    def top_size(self) -> int:
        """How many rank-ordered neighbours of each node the prefix table holds at least (the largest fanout, at
        least 8)."""
        return self._nbrs.need

    @property
    def fanouts(self) -> tuple[int, ...]:
        """The fanouts whose sampled-by index and dirty marks the store keeps (:meth:`set_fanouts`)."""
        return self._sampled.fanouts

    @fanouts.setter
    def fanouts(self, ks: tuple[int, ...]) -> None:
        self._sampled.fanouts = ks
        self._nbrs.set_need(max(_MIN_TOP, max(ks, default=0)))

    @property
    def stream_time(self) -> float | None:
        """Stream time ``T``: the largest ``ts`` of any event applied so far (None before the first)."""
        return self._events.stream_time

    def born_between(self, low: float, high: float) -> np.ndarray:
        """Interned ids of the nodes with ``low < first(v) <= high``, from the ``born`` index (the cost is that
        of the nodes found)."""
        found: list[int] = []
        if not high > low:
            return np.zeros(0, dtype=np.int64)
        start, stop = keys.time_key(low), keys.time_key(high)
        family = self._families["born"]
        for key in family.keys(from_key=start):
            head = key[:8]
            if head > stop:
                break
            if head > start:
                found.append(keys.U64.unpack(key[8:16])[0])
        return np.asarray(found, dtype=np.int64)

    def first_ts(self, iids: np.ndarray) -> np.ndarray:
        """``first(v)`` of many nodes (0 where a node is absent)."""
        return self._nodes.first_ts(iids)

    # ------------------------------------------------------------------ ids
    def warm_ids(self) -> int:
        """Read the name <-> iid map into memory, up to the node cache bound; return how many were read.

        A long-running worker holds the ids of the nodes it sees anyway; a
        fresh process would otherwise look up each new name of its first
        batches in RocksDB, over a thousand a batch on a large graph.
        """
        return self._ids.warm(self._cache_nodes - len(self._ids.iid_of))

    @property
    def iid_bound(self) -> int:
        """One past the largest interned id handed out so far: the size tables by iid reach on this state."""
        return self._ids.next_iid

    def iid(self, name: str) -> int | None:
        """The interned id of node ``name``, or None if it was never seen."""
        return self._ids.iid(name)

    def name(self, iid: int) -> str:
        """The node id string of interned id ``iid``."""
        return self._ids.name(iid)

    # ------------------------------------------------------------------ writes
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
        dim = validate_events(events, self.feature_dim)
        check_offsets(self.offsets(), offsets or {})
        batch = Batch(self._handles)
        self._nbrs.batch = batch
        result = ApplyResult(self.fanouts)
        t = result.lap("validate", t)
        try:
            if dim != self.feature_dim:
                self.feature_dim = dim
                self._meta_put(keys.META_FEATURE_DIM, dim, batch)
            self._events.prefetch(events, batch)
            t = result.lap("prefetch", t)
            self._events.run(events, batch, result)
            t = result.lap("events", t)
            self._events.finish(batch, result)
            if result.stream_time is not None:
                self._meta_put(keys.META_STREAM_TIME, result.stream_time, batch)
            for (topic, partition), off in (offsets or {}).items():
                batch.put("offsets", keys.offset_key(topic, partition), keys.U64.pack(off))
            for name, value in (meta or {}).items():
                self._meta_put(f"{keys.META_CALLER}{name}", value, batch)
            self._meta_put(keys.META_NEXT_IID, self._ids.next_iid, batch)
            t = result.lap("finish", t)
            result.rows_written = batch.wb.len()
            self._write(batch.wb)
            t = result.lap("write", t)
        except BaseException as exc:
            self._invalidate_caches()
            if is_corruption(exc):  # a read of a damaged block, or RocksDB refusing writes after one
                raise state_corrupted(self.path, exc) from exc
            raise
        finally:
            self._nbrs.batch = None
        self._nodes.committed(batch)
        if batch.marks is not None:
            self._marks.added(*batch.marks)
        self._sampled.committed(batch)
        self._trim_caches()
        result.lap("caches", t)
        return result

    def commit(self, tx: Transaction) -> int:
        """Write a :class:`~gnnstream.graph_state.transaction.Transaction` in one WriteBatch: its cleared families first
        (one range delete each, cheap to iterate past), then its records, then its dirty marks as one block
        each.

        Returns:
            The number of records in the WriteBatch.
        """
        wb = WriteBatch(raw_mode=True)
        handles = self._handles
        for cf in tx.cleared:
            wb.delete_range(b"", b"\xff" * 32, handles[cf])
        put, delete = wb.put, wb.delete
        for cf, key, value in tx.records:
            if value is None:
                delete(key, handles[cf])
            else:
                put(key, value, handles[cf])
        blocks = [self._marks.block(combine(tags, iids), flags) for tags, iids, flags in tx.marks if len(iids)]
        for key, value in blocks:
            put(key, value, handles["dirty"])
        rows = wb.len()
        try:
            self._write(wb)
        except BaseException as exc:
            self._marks.drop()
            if is_corruption(exc):  # RocksDB stops writing once a flush or compaction met a damaged file
                raise state_corrupted(self.path, exc) from exc
            raise
        self._marks.written(blocks, "dirty" in tx.cleared)
        return rows

    def write_table(self, family: str, path: str, chunks: Iterable[tuple[Sequence[bytes], Iterable[bytes]]]) -> int:
        """Write records of ``family``, as ``(keys, values)`` chunks with keys in strictly increasing order
        throughout, into a table file at ``path`` for :meth:`ingest`; returns how many (no file is left for
        none)."""
        return write_table(family, path, chunks)

    def ingest(self, files: Mapping[str, Sequence[str]], *, next_iid: int, feature_dim: int | None,
               fanouts: Sequence[int] = (), stream_time: float | None = None) -> None:
        """Move the table files of :meth:`write_table` into their families (a bulk load into an empty state),
        then record ``next_iid``, ``feature_dim``, the ``fanouts`` whose sampled-by snapshot came with them and
        the stream time of the events loaded.

        A marker written first and removed with the last records makes a load
        cut short by a crash refuse to open, rather than pass for a smaller graph.
        """
        marker = Batch(self._handles)
        self._meta_put(keys.META_BULK_LOAD, True, marker)
        durable = WriteOptions()
        durable.sync = True  # the ingest below is durable at once: the marker must be first on disk
        self._db.write(marker.wb, durable)
        opts = IngestExternalFileOptions()
        opts.set_move_files(True)
        try:
            for family, paths in files.items():
                self._cf[family].ingest_external_file(list(paths), opts)
            batch = Batch(self._handles)
            self._meta_put(keys.META_NEXT_IID, next_iid, batch)
            if feature_dim is not None:
                self._meta_put(keys.META_FEATURE_DIM, feature_dim, batch)
            if fanouts:
                self._meta_put(keys.META_FANOUTS, list(fanouts), batch)
            if stream_time is not None:
                self._meta_put(keys.META_STREAM_TIME, stream_time, batch)
            batch.delete("meta", keys.META_BULK_LOAD.encode())
            self._write(batch.wb)
        finally:
            self._invalidate_caches()
            self.fanouts = self._meta.fanouts()

    # ------------------------------------------------------------------ caches
    def _invalidate_caches(self, keep_ids: bool = False) -> None:
        """Forget everything held in memory (but the names' ids with ``keep_ids``); what is needed is read
        again."""
        if not keep_ids:
            self._ids.clear()
        self._nodes.clear()
        self._nbrs.prefixes.clear()
        self._sampled.clear()
        self._marks.drop()
        self._ids.next_iid = self._meta.next_iid()
        self.feature_dim = self._meta.get(keys.META_FEATURE_DIM)
        self._events.stream_time = self._meta.get(keys.META_STREAM_TIME)

    def _trim_caches(self) -> None:
        if self._nbrs.prefixes.count > self._cache_nodes:
            self._nbrs.prefixes.clear()
        if len(self._nodes.records) > self._cache_nodes:
            self._nodes.records.clear()
        if len(self._ids.iid_of) > 2 * self._cache_nodes:
            self._ids.clear()

    # ------------------------------------------------------------------ reads by iid
    def node_iids(self) -> Iterator[int]:
        """Interned ids of every existing node, in id order."""
        return self._nodes.iids()

    def exists_iid(self, iid: int) -> bool:
        return self._nodes.get(iid) is not None

    def degree_iid(self, iid: int) -> int:
        node = self._nodes.get(iid)
        return 0 if node is None else node.degree

    def has_features_iid(self, iid: int) -> bool:
        node = self._nodes.get(iid)
        return bool(node and node.flags & keys.FLAG_HAS_FEATURES)

    def sample_iids(self, iid: int, k: int) -> list[int]:
        """``S_k`` of node ``iid`` as interned ids in rank order; O(k) reads."""
        return self._nbrs.sample_iids(iid, k)

    def ranked_neighbours(self, iid: int) -> Iterator[tuple[bytes, int]]:
        """``N(v)`` of node ``iid`` in sampling order, read lazily: ``(order key, u iid)`` pairs, the order key
        being ``r(v, u)`` as 8 big-endian bytes followed by ``u``'s id in UTF-8 (empty for an absent node)."""
        if self._nodes.get(iid) is None:
            return
        for key, u in self._nbrs.iter(iid):
            yield key[8:], u

    def node_arrays(self, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(degree, flags, last_ts)`` of many nodes as arrays; degree is -1 where a node is absent."""
        return self._nodes.arrays(iids)

    def sample_matrix(self, k: int, iids: np.ndarray) -> np.ndarray:
        """``S_k`` of many nodes: an ``[len(iids), k]`` iid matrix in rank order, padded with -1.

        Outside a batch the rows come from the prefix table; rows not loaded
        yet are read from RocksDB first and kept there.
        """
        return self._nbrs.sample_matrix(k, iids)

    def load_prefixes(self, iids: np.ndarray) -> None:
        """Read the neighbour-list prefix rows of ``iids`` into memory now (those :meth:`sample_matrix` has
        not read), rather than in the next batch that changes their lists."""
        self._nbrs.load_rows(np.asarray(iids, dtype=np.int64))

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
        return self._sampled.lookup(k, np.asarray(sources, dtype=np.int64), bound)

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
        return iid is not None and self._nodes.get(iid) is not None

    def degree(self, name: str) -> int:
        iid = self.iid(name)
        return 0 if iid is None else self.degree_iid(iid)

    def neighbors(self, name: str) -> list[str]:
        """``N(v)`` in rank order (O(degree))."""
        iid = self.iid(name)
        if iid is None or self._nodes.get(iid) is None:
            return []
        return [self.name(u) for _, u in self._nbrs.iter(iid)]

    def sample(self, name: str, k: int) -> list[str]:
        """``S_k(v)`` in rank order: O(k) reads, never O(degree)."""
        check_fanout(k)
        iid = self.iid(name)
        if iid is None or self._nodes.get(iid) is None:
            return []
        row = self._nbrs.prefixes.row(iid) if k <= self.top_size else None
        if row is not None:
            return [self.name(u) for u in row[:k]]
        held = []  # the names are in the index keys: no lookup each
        for key, _ in self._nbrs.iter(iid):
            if len(held) >= k:
                break
            held.append(key[16:].decode())
        return held

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
        return self._nodes.count()

    def offsets(self) -> dict[tuple[str, int], int]:
        """Stored next offsets per ``(topic, partition)``."""
        return stored_offsets(self._families["offsets"])

    # ------------------------------------------------------------------ dirty marks and raw families
    def dirty_mark_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every dirty mark once, in (tag, iid) order: ``(tags, iids, flags)``, flags OR-combined."""
        return self._marks.arrays()

    def dirty_count(self) -> int:
        """The number of distinct dirty marks."""
        return self._marks.count()

    def column(self, name: str) -> Family:
        """The column family ``name``, for reading, with scans that raise :class:`StateCorrupted` on a read error
        (:class:`Family`); writes go through :meth:`commit` (or :meth:`apply`)."""
        return self._families[name]
