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

import gc
import json
import logging
import os
import time
from collections import defaultdict
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
from rocksdict import Cache, IngestExternalFileOptions, Rdict, SstFileWriter, WriteBatch, WriteOptions

from gnnstream.graph_state import keys
from gnnstream.graph_state.batch import ApplyResult, Batch, validate_events
from gnnstream.graph_state.db import (Family, check_iterator, family_options, is_corruption, layout_error, open_db,
                            open_follower, record_manifest, state_corrupted)
from gnnstream.graph_state.exceptions import OffsetRegressionError, StoreConfigError
from gnnstream.graph_state.idsets import unique_ids
from gnnstream.graph_state.marks import (DIRTY_COUNT, DIRTY_DEGREE, DIRTY_INPUT, DIRTY_SAMPLE, DirtyMarks, combine, mark_records,
                               or_reduce, split)
from gnnstream.graph_state.prefixes import GONE, DenseNodes, Node, PrefixTable, merge_rows
from gnnstream.graph_state.sampled import (FOLD_PAIRS, MAX_INDEXED_IDS, PAIR_BITS, SNAPSHOT_PAIRS, SampledIndex, member,
                                 sample_pairs)
from gnnstream.graph_state.sampler import check_fanout, seeded_rank_bytes
from gnnstream.graph_state.transaction import Transaction

__all__ = ["GraphStore", "ApplyResult"]

logger = logging.getLogger(__name__)

_MIN_TOP = 8  # prefix width of a store without fanouts (or with small ones)
_SAMPLED_DELTA = keys.SAMPLED_DELTA_RECORD
_PACK_U64 = keys.U64.pack
_UNREAD = object()  # a node record not read yet (``_nodes`` holds None for an absent node)


_BULK_MARKER = "bulk_load_in_progress"  # meta: set while a bulk load's files are being ingested
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
        self._db = open_follower(self.path, os.fspath(follow)) if follow is not None else \
            self._open(self.path, lock_timeout)
        self._cf = {name: self._db.get_column_family(name) for name in keys.COLUMN_FAMILIES}
        self._families = {name: Family(view, self.path) for name, view in self._cf.items()}  # checked scans
        self._handles = {name: self._db.get_column_family_handle(name) for name in keys.COLUMN_FAMILIES}
        self._write_opts = WriteOptions()
        self._cache_nodes = cache_nodes
        try:
            self._check_layout()
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
        self._nodes: dict[int, Node | None] = {}
        self._sampled: dict[int, SampledIndex] = {}  # the sampled-by index in memory, loaded on first use
        self._delta_seq: int | None = None  # key of the next batch's sampled-by changes
        self._delta_pairs = 0  # sampled-by changes stored since the snapshot (known once the index is loaded)
        self._dense_nodes = DenseNodes()
        self._marks: DirtyMarks | None = None  # mirror of the dirty family, loaded on first use
        self._batch: Batch | None = None

    # ------------------------------------------------------------------ open/close
    def _open(self, path: str, lock_timeout: float) -> Rdict:
        """Open the database for writing (:func:`graph_state.db.open_db`); a read-only store overrides it."""
        return open_db(path, lock_timeout)

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

    # ------------------------------------------------------------------ meta
    def meta(self, name: str) -> Any:
        """A record stored with :meth:`apply`'s ``meta`` (``None`` if there is none)."""
        return self._meta_get(f"{_CALLER_META}{name}")

    def _meta_get(self, name: str) -> Any:
        raw = self._cf["meta"].get(name.encode())
        return None if raw is None else json.loads(raw)

    def _meta_put(self, name: str, value: Any, batch: Batch | None = None) -> None:
        data = json.dumps(value).encode()
        if batch is None:
            self._cf["meta"].put(name.encode(), data)
        else:
            batch.put("meta", name.encode(), data)

    def _check_layout(self) -> None:
        """Refuse a state written with another layout (:data:`graph_state.keys.LAYOUT`); record the layout in
        a new one."""
        stored = self._meta_get("layout")
        if stored == keys.LAYOUT:
            if self._meta_get(_BULK_MARKER):
                raise StoreConfigError(f"state {self.path!r}: a bulk load (`gnnstream graph load`) was cut short; "
                                       f"delete the directory and run the load again")
            return
        if stored is None and next(self._families["meta"].keys(), None) is None:  # a new state
            if not self.following:
                self._meta_put("layout", keys.LAYOUT)
            return
        raise layout_error(self.path, stored)

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
        batch = Batch(self._handles)
        batch.wb.delete_range(b"", b"\xff" * 20, self._handles["sampled"])
        self._meta_put("fanouts", [], batch)
        self._db.write(batch.wb, self._write_opts)
        self.fanouts = ks
        self._sampled.clear()
        self._check_indexable()
        pairs: dict[int, list[int]] = {k: [] for k in ks}
        for iid in self.node_iids():
            top = self._prefix_ids(iid)
            for k in ks:
                pairs[k].extend((u << PAIR_BITS) | iid for u in top[:k])
        self._sampled = {k: SampledIndex(np.sort(np.asarray(p, dtype=np.int64))) for k, p in pairs.items()}
        self._fold_sampled()  # the snapshot, written before the fanouts that make it current
        batch = Batch(self._handles)
        self._meta_put("fanouts", list(ks), batch)
        self._db.write(batch.wb, self._write_opts)
        self._trim_caches()

    @property
    def top_size(self) -> int:
        """How many rank-ordered neighbours of each node the prefix table holds (the largest fanout, at least 8)."""
        return self._top_size

    @property
    def fanouts(self) -> tuple[int, ...]:
        """The fanouts whose sampled-by index and dirty marks the store keeps (:meth:`set_fanouts`)."""
        return self._fanouts

    @fanouts.setter
    def fanouts(self, ks: tuple[int, ...]) -> None:
        self._fanouts = ks
        self._top_size = max(_MIN_TOP, max(ks, default=0))
        if getattr(self, "_prefixes", None) is None or self._prefixes.width != self._top_size:
            self._prefixes = PrefixTable(self._top_size)  # rows of another width are read again

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

    def _intern(self, name: str, batch: Batch) -> int:
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
    def _node(self, iid: int) -> Node | None:
        node = self._nodes.get(iid, _UNREAD)  # one lookup; None is an absent node
        if node is not _UNREAD:
            return node
        node = Node.decode(self._cf["nodes"].get(keys.encode_iid(iid)))
        self._nodes[iid] = node
        return node

    def _put_node(self, iid: int, node: Node | None, batch: Batch) -> None:
        # Records are mutated in place during the batch and encoded once at its end.
        self._nodes[iid] = node
        batch.nodes.add(iid)

    # ------------------------------------------------------------------ neighbour lists
    def _iter_nbrs(self, v: int) -> Iterator[tuple[bytes, int]]:
        """Neighbour entries of ``v`` in rank order, the open batch's changes merged in."""
        prefix = keys.nbr_prefix(v)
        pending = self._batch.pending_nbr.get(v, {}) if self._batch is not None else {}
        added = sorted((k, u) for k, u in pending.items() if u is not None)
        ai = 0
        it = self._cf["nbrs"].iter()
        it.seek(prefix)
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

    def _read_prefix(self, v: int) -> tuple[list[bytes], list[int]]:
        """The first :attr:`top_size` entries of ``v``'s list, the open batch's changes merged in: rank bytes
        and ids."""
        ranks: list[bytes] = []
        if self._batch is not None and v in self._batch.pending_nbr:
            ids: list[int] = []
            for key, u in self._iter_nbrs(v):  # merges the open batch's changes
                if len(ids) >= self._top_size:
                    break
                ranks.append(key[8:16])
                ids.append(u)
            return ranks, ids
        values: list[bytes] = []
        it = self._cf["nbrs"].iter()
        try:
            self._scan_prefix(it, v, ranks, values)
        finally:
            del it
        return ranks, list(map(keys.decode_iid, values))

    def _scan_prefix(self, it: Any, v: int, ranks: list[bytes], values: list[bytes]) -> int:
        """Append the rank bytes and raw ids of ``v``'s first :attr:`top_size` stored entries, read with the
        iterator ``it``; returns how many."""
        prefix = _PACK_U64(v)
        take = self._top_size
        it.seek(prefix)
        n = 0
        while n < take and it.valid():
            key = it.key()
            if key[:8] != prefix:
                return n
            ranks.append(key[8:16])
            values.append(it.value())
            n += 1
            it.next()
        if not it.valid():  # the end of the family, or a read error
            check_iterator(it, self.path)
        return n

    def _prefix_ids(self, v: int) -> list[int]:
        """``v``'s prefix ids: the table's row, or read from RocksDB when it is not loaded (leaving the table
        alone; rows are loaded many at a time, by :meth:`sample_matrix` and batches)."""
        row = self._prefixes.row(v)
        return row if row is not None else self._read_prefix(v)[1]

    def _read_rows(self, iids: np.ndarray, stored: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_read_prefix` of many nodes as prefix-table rows: ``(rank, ids, length)``.

        Nodes without changes in the open batch (all of them when ``stored``) are read with one iterator, the
        first :attr:`top_size` index entries after a seek to each, their ranks and ids decoded all at once.
        """
        width = self._prefixes.width
        n_rows = len(iids)
        rank = np.zeros((n_rows, width), dtype=np.uint64)
        ids = np.full((n_rows, width), -1, dtype=np.int64)
        length = np.zeros(n_rows, dtype=np.int32)
        pending = self._batch.pending_nbr if self._batch is not None and not stored else {}
        ranks: list[bytes] = []
        values: list[bytes] = []
        counts = [0] * n_rows
        it = self._cf["nbrs"].iter()
        try:
            for row, v in enumerate(iids.tolist()):
                if v in pending:  # the open batch changed this list: merge its changes
                    raw, held = self._read_prefix(v)
                    ranks += raw
                    values += map(_PACK_U64, held)
                    counts[row] = len(held)
                else:
                    counts[row] = self._scan_prefix(it, v, ranks, values)
        finally:
            del it
        if ranks:
            length[:] = counts
            row_of = np.repeat(np.arange(n_rows), length)
            col = np.arange(len(ranks)) - np.repeat(np.cumsum(length) - length, length)
            rank[row_of, col] = np.frombuffer(b"".join(ranks), dtype=">u8")
            ids[row_of, col] = np.frombuffer(b"".join(values), dtype=">u8")
        return rank, ids, length

    def _load_rows(self, iids: np.ndarray) -> None:
        """Read the rows of ``iids`` that the prefix table lacks from RocksDB, as stored (before any open
        batch)."""
        missing = self._prefixes.missing(iids)
        if len(missing):
            self._prefixes.put_rows(missing, *self._read_rows(missing, stored=True))

    def _add_nbr(self, v: int, v_name: str, u: int, u_name: str, node: Node, batch: Batch) -> None:
        """Add ``u`` to ``N(v)``: its index entry and degree (the prefix follows at the end of the batch)."""
        key = keys.nbr_key(v, self._rank(v_name, u_name), u_name)
        node.degree += 1
        batch.wb.put(key, _PACK_U64(u), batch.nbrs_family)
        batch.pending_nbr[v][key] = u
        batch.nbr_first.setdefault(key, -1)

    def _remove_nbr(self, v: int, v_name: str, u: int, u_name: str, node: Node, batch: Batch) -> None:
        key = keys.nbr_key(v, self._rank(v_name, u_name), u_name)
        node.degree -= 1
        batch.delete("nbrs", key)
        batch.pending_nbr[v][key] = None
        batch.nbr_first.setdefault(key, u)

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
        dim = validate_events(events, self.feature_dim)
        current = self.offsets()
        for tp, off in (offsets or {}).items():
            if isinstance(off, bool) or not isinstance(off, int) or off < 0:
                raise ValueError(f"Expected a non-negative integer offset for {tp} (got {off!r})")
            if off < current.get(tp, 0):
                raise OffsetRegressionError(f"offset of {tp[0]}[{tp[1]}] would move back from {current[tp]} to {off}")
        batch = Batch(self._handles)
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
            if self._sampled and self._delta_pairs > FOLD_PAIRS:
                self._fold_sampled()
        self._trim_caches()
        result.lap("caches", t)
        return result

    def _prefetch(self, events: Sequence[Any], batch: Batch) -> None:
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
                self._nodes[iid] = None if degree < 0 else Node(degree, flags, last_ts)
            cold = ids[~mirrored].tolist()
            if cold:
                for iid, raw in zip(cold, self._cf["nodes"].get([keys.encode_iid(i) for i in cold])):
                    self._nodes[iid] = Node.decode(raw)
        pairs: dict[bytes, None] = {}
        for ev in events:
            if ev.op in ("edge_upsert", "edge_delete"):
                s, d = known.get(ev.src), known.get(ev.dst)
                if s is not None and d is not None:
                    pairs[keys.edge_key(s, d)] = pairs[keys.edge_key(d, s)] = None
        if pairs:
            wanted = list(pairs)
            batch.stored_edges = {k: raw is not None for k, raw in zip(wanted, self._cf["edges"].get(wanted))}

    def _touch(self, name: str, ts: float, batch: Batch, result: ApplyResult) -> tuple[int, Node]:
        iid = self._intern(name, batch)
        node = self._node(iid)
        if node is None:
            node = Node(0, 0, ts)
            result.created.add(iid)
            result.features_changed.add(iid)
            result.deleted.discard(iid)
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

    def _set_edge(self, batch: Batch, key: bytes, record: bytes | None) -> None:
        if record is None:
            batch.delete("edges", key)
        else:
            batch.put("edges", key, record)
        batch.edges[key] = record is not None

    def _link(self, a: int, a_name: str, an: Node, b: int, b_name: str, bn: Node,
              batch: Batch, result: ApplyResult, add: bool) -> None:
        change = self._add_nbr if add else self._remove_nbr
        change(a, a_name, b, b_name, an, batch)
        change(b, b_name, a, a_name, bn, batch)
        result.degree_changed.update((a, b))

    def _run_events(self, events: Sequence[Any], batch: Batch, result: ApplyResult) -> None:
        """Apply each event of a validated batch in order.

        An edge upsert between two nodes already read (the common case after
        :meth:`_prefetch`) runs inline with its lookups bound once a batch;
        anything else goes through the ``_apply_<op>`` handlers.
        """
        handlers = {op: getattr(self, "_apply_" + op) for op in ("edge_upsert", "edge_delete", "node_upsert", "node_delete")}
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
            ts = ev.ts
            if ts > max_ts:
                max_ts = float(ts)
            if ev.op != "edge_upsert" or (s := iid_of(ev.src)) is None or (d := iid_of(ev.dst)) is None \
                    or (sn := node_of(s)) is None or (dn := node_of(d)) is None:
                handlers[ev.op](ev, batch, result)
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
                add_nbr(s, ev.src, d, ev.dst, sn, batch)
                add_nbr(d, ev.dst, s, ev.src, dn, batch)
                degree_changed.add(s)
                degree_changed.add(d)
        result.max_ts = max_ts

    def _apply_edge_upsert(self, ev: Any, batch: Batch, result: ApplyResult) -> None:
        s, sn = self._touch(ev.src, ev.ts, batch, result)
        d, dn = self._touch(ev.dst, ev.ts, batch, result)
        key = keys.edge_key(s, d)
        existed = self._edge_exists(key)
        self._set_edge(batch, key, keys.EDGE_RECORD.pack(float(ev.weight), float(ev.ts)))
        if not existed and s != d and not self._edge_exists(keys.edge_key(d, s)):
            self._link(s, ev.src, sn, d, ev.dst, dn, batch, result, add=True)

    def _apply_edge_delete(self, ev: Any, batch: Batch, result: ApplyResult) -> None:
        s, d = self.iid(ev.src), self.iid(ev.dst)
        key = None if s is None or d is None else keys.edge_key(s, d)
        if key is None or not self._edge_exists(key):
            return
        self._set_edge(batch, key, None)
        if s != d and not self._edge_exists(keys.edge_key(d, s)):
            sn, dn = self._node(s), self._node(d)
            self._put_node(s, sn, batch)
            self._put_node(d, dn, batch)
            self._link(s, ev.src, sn, d, ev.dst, dn, batch, result, add=False)

    def _apply_node_upsert(self, ev: Any, batch: Batch, result: ApplyResult) -> None:
        iid, node = self._touch(ev.id, ev.ts, batch, result)
        node.flags |= keys.FLAG_HAS_FEATURES
        self._put_node(iid, node, batch)
        batch.put("feats", keys.encode_iid(iid), np.asarray(ev.features, dtype="<f4").tobytes())
        result.features_changed.add(iid)

    def _apply_node_delete(self, ev: Any, batch: Batch, result: ApplyResult) -> None:
        v = self.iid(ev.id)
        node = None if v is None else self._node(v)
        if node is None:
            return
        entries = list(self._iter_nbrs(v))
        for key, u in entries:
            u_name = key[16:].decode()
            for a, b in ((v, u), (u, v)):
                edge = keys.edge_key(a, b)
                if self._edge_exists(edge):
                    self._set_edge(batch, edge, None)
            un = self._node(u)
            self._put_node(u, un, batch)
            self._remove_nbr(u, u_name, v, ev.id, un, batch)
            result.degree_changed.add(u)
        # v's own neighbour list goes in one range delete (linear in the degree overall)
        batch.wb.delete_range(keys.nbr_prefix(v), keys.nbr_prefix(v + 1), self._handles["nbrs"])
        pending, first = batch.pending_nbr[v], batch.nbr_first
        for key, u in entries:
            pending[key] = None
            first.setdefault(key, u)
        if entries:
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

    def _finish(self, batch: Batch, result: ApplyResult) -> None:
        """Node records, net sample changes, the sampled-by index and dirty marks."""
        put, delete, family = batch.wb.put, batch.wb.delete, batch.handles["nodes"]
        pack_key, pack_node, nodes = keys.U64.pack, keys.NODE_RECORD.pack, self._nodes
        touched = list(batch.nodes)
        records = [nodes[iid] for iid in touched]
        gone = [i for i, node in enumerate(records) if node is None]
        for i in gone:
            delete(pack_key(touched[i]), family)
            records[i] = GONE
        degree = [node.degree for node in records]
        flags = [node.flags for node in records]
        last_ts = [node.last_ts for node in records]
        columns = zip(touched, degree, flags, last_ts)
        if gone:  # the deleted ones were deleted above
            columns = (column for column, node in zip(columns, records) if node is not GONE)
        for iid, deg, flag, ts in columns:
            put(pack_key(iid), pack_node(deg, flag, ts), family)
        batch.node_columns = touched, degree, flags, last_ts
        ids, before_m, after_m, deg = self._settle_prefixes(batch)
        delta: list[np.ndarray] = []  # this batch's sampled-by changes: one record
        mark_parts: list[tuple[int, np.ndarray, int]] = [
            (0, np.fromiter(result.features_changed, np.int64, len(result.features_changed)), DIRTY_INPUT),
            (0, np.fromiter(result.degree_changed, np.int64, len(result.degree_changed)), DIRTY_DEGREE),
        ]
        for k in self.fanouts:
            old, new = before_m[:, :k], after_m[:, :k]
            rows = (old != new).any(axis=1)
            ids_k, old, new = ids[rows], old[rows], new[rows]
            old_pairs, new_pairs = sample_pairs(ids_k, old), sample_pairs(ids_k, new)
            removed = old_pairs[~member(new_pairs, old_pairs)]
            added = new_pairs[~member(old_pairs, new_pairs)]
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
        marks, flags = or_reduce([(combine(np.full(len(a), t), a), np.full(len(a), f, dtype=np.uint8))
                                   for t, a, f in mark_parts])
        if len(marks):  # one packed block: flags of marks already stored are OR-combined when read
            key, value = self._mark_block(marks, flags)
            batch.put("dirty", key, value)
            batch.marks = marks, flags

    def _settle_prefixes(self, batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Merge the batch's neighbour changes into the prefixes of every node whose list changed, all at once,
        and write them into the table.

        Returns ``(ids, before, after, moved)``: the nodes whose prefix ids
        changed, those ids before and after as ``[len(ids), width]`` matrices
        padded with -1, and ``(v, degree before, degree after)`` rows of every
        node whose degree changed.
        """
        table, width = self._prefixes, self._prefixes.width
        if not batch.pending_nbr:
            empty = np.zeros(0, dtype=np.int64)
            return empty, np.zeros((0, width), np.int64), np.zeros((0, width), np.int64), empty.reshape(0, 3)
        first = batch.nbr_first
        add_row: list[int] = []
        add_rank: list[bytes] = []
        add_id: list[int] = []
        rem_row: list[int] = []
        rem_id: list[int] = []
        for row, changes in enumerate(batch.pending_nbr.values()):  # net changes: entries stored now or before only
            for key, u in changes.items():
                was = first[key]
                if u is None:
                    if was >= 0:
                        rem_row.append(row)
                        rem_id.append(was)
                elif was < 0:
                    add_row.append(row)
                    add_rank.append(key[8:16])
                    add_id.append(u)
        v = np.fromiter(batch.pending_nbr, np.int64, len(batch.pending_nbr))
        self._load_rows(v)
        nodes = self._nodes
        deg1 = np.fromiter(((n.degree if (n := nodes[i]) is not None else 0) for i in v.tolist()), np.int64, len(v))
        added_to, removed_from = np.asarray(add_row, dtype=np.int64), np.asarray(rem_row, dtype=np.int64)
        # a degree counts its index entries: before the batch, less the net additions, plus the net removals
        deg0 = deg1 - np.bincount(added_to, minlength=len(v)) + np.bincount(removed_from, minlength=len(v))
        rank, ids, length = table.rank[v], table.ids[v], table.length[v]
        new_rank, new_ids, new_len, exact = merge_rows(
            rank, ids, length, deg0 > length, deg1,
            (added_to, np.frombuffer(b"".join(add_rank), dtype=">u8").astype(np.uint64),
             np.asarray(add_id, dtype=np.int64)),
            (removed_from, np.asarray(rem_id, dtype=np.int64)))
        again = np.flatnonzero(~exact)  # read again, with the batch's changes merged
        if len(again):
            new_rank[again], new_ids[again], new_len[again] = self._read_rows(v[again])
        table.put_rows(v, new_rank, new_ids, new_len)
        changed = (ids != new_ids).any(axis=1)
        moved = deg0 != deg1
        return (v[changed], ids[changed], new_ids[changed],
                np.stack([v[moved], deg0[moved], deg1[moved]], axis=1))

    # ------------------------------------------------------------------ caches

    def _invalidate_caches(self) -> None:
        self._iid.clear()
        self._name.clear()
        self._nodes.clear()
        self._prefixes.clear()
        self._sampled.clear()
        self._delta_seq, self._delta_pairs = None, 0
        self._dense_nodes = DenseNodes()
        self._marks = None
        self._next_iid = self._meta_get("next_iid") or 0
        self.feature_dim = self._meta_get("feature_dim")

    def _trim_caches(self) -> None:
        if self._prefixes.count > self._cache_nodes:
            self._prefixes.clear()
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
        """``S_k`` of node ``iid`` as interned ids in rank order; O(k) reads."""
        if self._node(iid) is None:
            return []
        if k <= self.top_size and self._batch is None:
            return self._prefix_ids(iid)[:k]
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

        Outside a batch the rows come from the prefix table; rows not loaded
        yet are read from RocksDB first and kept there.
        """
        iids = np.asarray(iids, dtype=np.int64)
        if self._batch is not None or k > self.top_size:
            out = np.full((len(iids), k), -1, dtype=np.int64)
            for row, v in enumerate(iids.tolist()):
                s = self.sample_iids(v, k)
                out[row, :len(s)] = s
            return out
        self._load_rows(iids)
        return self._prefixes.samples(iids, k)

    def _check_indexable(self) -> None:
        if self._next_iid > MAX_INDEXED_IDS:
            raise StoreConfigError(f"the sampled-by index holds at most {MAX_INDEXED_IDS} nodes "
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

    def _sampled_index(self, k: int) -> SampledIndex | None:
        """The in-memory sampled-by index of fanout ``k`` (None when ``k`` is not one of the fanouts).

        The first call loads every fanout's index: the snapshot, then the
        stored changes of each batch since, in order. A store with more
        changes than :data:`FOLD_PAIRS` waiting gets a new snapshot at once.
        """
        if k not in self.fanouts:
            return None
        if not self._sampled:
            self._load_sampled()
        return self._sampled[k]

    def _load_sampled(self) -> None:
        snapshot: dict[int, list[np.ndarray]] = defaultdict(list)
        deltas: list[np.ndarray] = []  # in key order, which is batch order
        seq = -1
        for key, value in self._families["sampled"].items():
            if key.startswith(keys.SAMPLED_SNAPSHOT_PREFIX):
                snapshot[int.from_bytes(key[2:4], "big")].append(np.frombuffer(value, dtype="<i8"))
            else:
                deltas.append(np.frombuffer(value, dtype=_SAMPLED_DELTA))
                seq = keys.decode_iid(key[2:])
        indexes = {k: SampledIndex(np.concatenate(snapshot[k]).astype(np.int64) if snapshot.get(k)
                                   else np.zeros(0, dtype=np.int64)) for k in self.fanouts}
        for rec in deltas:
            for k, index in indexes.items():
                mine = rec[rec["k"] == k]
                index.update(mine["pair"][mine["added"] == 0], mine["pair"][mine["added"] == 1])
        pending = sum(len(rec) for rec in deltas)
        self._sampled = indexes
        self._delta_seq, self._delta_pairs = seq + 1, pending
        if pending > FOLD_PAIRS:
            self._fold_sampled()

    def _fold_sampled(self) -> None:
        """Replace the stored sampled-by relation with a snapshot of the in-memory one (one WriteBatch)."""
        wb = WriteBatch(raw_mode=True)
        handle = self._handles["sampled"]
        wb.delete_range(b"", b"\xff" * 20, handle)
        for k, index in self._sampled.items():
            pairs = index.pairs().astype("<i8")
            for chunk, start in enumerate(range(0, len(pairs), SNAPSHOT_PAIRS)):
                wb.put(keys.sampled_snapshot_key(k, chunk), pairs[start:start + SNAPSHOT_PAIRS].tobytes(), handle)
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
        row = self._prefixes.row(iid) if k <= self.top_size else None
        if row is not None:
            return [self.name(u) for u in row[:k]]
        held = []  # the names are in the index keys: no lookup each
        for key, _ in self._iter_nbrs(iid):
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
        return sum(1 for _ in self._families["nodes"].keys())

    def offsets(self) -> dict[tuple[str, int], int]:
        """Stored next offsets per ``(topic, partition)``."""
        return {keys.decode_offset_key(k): keys.U64.unpack(v)[0] for k, v in self._families["offsets"].items()}

    # ------------------------------------------------------------------ raw access for the engine
    def _mark_state(self) -> DirtyMarks:
        """The in-memory mirror of the ``dirty`` family (read once, then kept in step by
        :meth:`apply` and :meth:`write`)."""
        if self._marks is None:
            state = DirtyMarks()
            for key, value in self._families["dirty"].items():
                state.add_stored(key, value)
            self._marks = state
        return self._marks

    def _mark_block(self, marks: np.ndarray, flags: np.ndarray) -> tuple[bytes, bytes]:
        state = self._mark_state()
        key = keys.dirty_block_key(state.next_seq)
        state.next_seq += 1
        return key, mark_records(marks, flags)

    def dirty_mark_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every dirty mark once, in (tag, iid) order: ``(tags, iids, flags)``, flags OR-combined."""
        marks, flags = self._mark_state().reduced()
        tags, iids = split(marks)
        return tags.astype(np.int64), iids.astype(np.int64), flags.copy()

    def dirty_count(self) -> int:
        """The number of distinct dirty marks."""
        return len(self._mark_state().reduced()[0])

    def column(self, name: str) -> Family:
        """The column family ``name``, for reading, with scans that raise :class:`StateCorrupted` on a read error
        (:class:`Family`); writes go through :meth:`commit` (or :meth:`apply`)."""
        return self._families[name]

    def write_table(self, family: str, path: str, items: Iterable[tuple[bytes, bytes]]) -> int:
        """Write ``(key, value)`` items of ``family``, in strictly increasing key order, into a table file at
        ``path`` for :meth:`ingest`; returns how many (no file is left for none)."""
        items = iter(items)
        first = next(items, None)
        if first is None:
            return 0
        writer = SstFileWriter(options=family_options(Cache(1 << 20), family))
        writer.open(path)
        writer[first[0]] = first[1]
        count = 1
        for key, value in items:
            writer[key] = value
            count += 1
        writer.finish()
        return count

    def ingest(self, files: Mapping[str, Sequence[str]], *, next_iid: int, feature_dim: int | None,
               fanouts: Sequence[int] = ()) -> None:
        """Move the table files of :meth:`write_table` into their families (a bulk load into an empty state),
        then record ``next_iid``, ``feature_dim`` and the ``fanouts`` whose sampled-by snapshot came with them.

        A marker written first and removed with the last records makes a load
        cut short by a crash refuse to open, rather than pass for a smaller graph.
        """
        marker = Batch(self._handles)
        self._meta_put(_BULK_MARKER, True, marker)
        durable = WriteOptions()
        durable.sync = True  # the ingest below is durable at once: the marker must be first on disk
        self._db.write(marker.wb, durable)
        opts = IngestExternalFileOptions()
        opts.set_move_files(True)
        try:
            for family, paths in files.items():
                self._cf[family].ingest_external_file(list(paths), opts)
            batch = Batch(self._handles)
            self._meta_put("next_iid", next_iid, batch)
            if feature_dim is not None:
                self._meta_put("feature_dim", feature_dim, batch)
            if fanouts:
                self._meta_put("fanouts", list(fanouts), batch)
            batch.delete("meta", _BULK_MARKER.encode())
            self._db.write(batch.wb, self._write_opts)
        finally:
            self._invalidate_caches()
            stored = self._meta_get("fanouts")
            self.fanouts = tuple(stored) if stored else ()

    def commit(self, tx: Transaction) -> int:
        """Write a :class:`~graph_state.transaction.Transaction` in one WriteBatch: its cleared families first
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
        blocks = [self._mark_block(combine(tags, iids), flags) for tags, iids, flags in tx.marks if len(iids)]
        for key, value in blocks:
            put(key, value, handles["dirty"])
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
            if "dirty" in tx.cleared:
                state.clear()
            for key, value in blocks:
                state.add_stored(key, value)
        return rows
