"""Bulk load: a large initial graph into an empty state as RocksDB table files, without a WriteBatch per batch
(``gnnstream graph load``; what it takes and leaves: ``docs/storage.md``). The events are taken in and the graph
they leave is worked out here; :mod:`gnnstream.graph_state.bulk_tables` writes the table files, on several
cores."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from typing import Any, Callable, Sequence

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.batch import validate_events
from gnnstream.graph_state.bulk_tables import (
    NodeNames, Samples, Tables, cores, run_parts, shared_array, time_keys, write_tables,
)
from gnnstream.graph_state.exceptions import StoreConfigError
from gnnstream.graph_state.sampled import MAX_INDEXED_IDS
from gnnstream.graph_state.sampler import check_fanout

__all__ = ["BulkLoad"]

_NODE = np.dtype([("degree", ">u4"), ("flags", "u1"), ("last_ts", ">f8"), ("first_ts", ">f8")])
_CHUNK = 1 << 20  # events gathered in Python lists before they become arrays
_LOOKUPS_PER_WORKER = 1 << 18  # edges of add_edges each worker looks up at least
_F32_MAX = float(np.finfo(np.float32).max)


class _Interner(dict):
    """``name -> iid`` in order of first appearance: indexing with a new name interns it (``get`` does not)."""

    def __missing__(self, name: str) -> int:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Expected a non-empty string node id (got {name!r})")
        iid = self[name] = len(self)
        return iid

    def intern(self, names: Sequence[str]) -> np.ndarray:
        """The iids of ``names``, the new ones interned in order of first appearance (all at once)."""
        new = list(itertools.filterfalse(self.__contains__, dict.fromkeys(names)))
        if not all(map(isinstance, new, itertools.repeat(str))) or "" in new:
            self.__missing__(next(name for name in new if not isinstance(name, str) or not name))
        self.update(zip(new, range(len(self), len(self) + len(new))))
        return np.fromiter(map(self.__getitem__, names), np.int64, len(names))


def _key_runs(keys_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(order, last)`` of entries in event order: ``order`` sorts them by key, each key's entries in event
    order; ``last[i]`` says whether ``order[i]`` is its key's last entry."""
    order = np.argsort(keys_, kind="stable")
    ordered = keys_[order]
    last = np.ones(len(order), dtype=bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    return order, last


class BulkLoad:
    """Events gathered for one bulk load into ``store``.

    Args:
        store: an open :class:`~gnnstream.graph_state.store.GraphStore` with no node and no fanouts.
        fanouts: the fanouts whose sampled-by index to write with the graph (none: the first engine builds it).
        workers: processes the load runs on: they look up the names of edge columns and write the table files,
            a range each (default: one per core this process may use; 1: this process alone). The state is the
            same for any number.

    Raises:
        StoreConfigError: the store already holds nodes or keeps fanouts.
        ValueError: ``workers`` is not a positive integer.
    """

    @staticmethod
    def takes(store: Any) -> bool:
        """Whether ``store`` can take a bulk load: it has interned no node (so holds none) and keeps no fanouts."""
        return not store.fanouts and next(store.column("ids").keys(), None) is None

    def __init__(self, store: Any, fanouts: Sequence[int] = (), workers: int | None = None):
        if workers is None:
            workers = cores()
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"Expected a positive whole number of bulk load workers (got {workers!r})")
        if next(store.column("ids").keys(), None) is not None:
            raise StoreConfigError(f"state {store.path!r} already holds a graph: a bulk load needs an empty state")
        if store.fanouts:
            raise StoreConfigError(f"state {store.path!r} keeps a sampled-by index (fanouts {list(store.fanouts)}): "
                                   f"a bulk load needs a state without one")
        self.store = store
        self.fanouts = tuple(sorted({check_fanout(k) for k in fanouts}))
        self.workers = workers
        self.dim = store.feature_dim
        self.ids = _Interner()  # name -> iid, in order of first appearance in an upsert
        # edge events in order: src and dst iid (-1: a delete naming a node not seen yet), weight, ts, upsert?
        self._edges: list[tuple[np.ndarray, ...]] = []
        self._edge_rows: tuple[list, ...] = ([], [], [], [], [], [])  # the columns above, then the event's number
        self._late: list[tuple[int, str, str]] = []  # deletes naming an unseen node: (position, src, dst)
        self._nodes: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # node upserts: iid, ts, features
        self._node_rows: tuple[list, ...] = ([], [], [], [])
        self.events = 0

    # ------------------------------------------------------------------ taking events in
    def add(self, ev: Any) -> None:
        """Take one validated event (``edge_upsert``, ``edge_delete`` or ``node_upsert``).

        Raises:
            ValueError: an invalid event, or a ``node_delete`` (apply it with :meth:`GraphStore.apply`).
        """
        self.dim = validate_events((ev,), self.dim)
        op = ev.op
        if op == "node_delete":
            raise ValueError("Expected edge_upsert, edge_delete or node_upsert in a bulk load (got node_delete)")
        if op == "node_upsert":
            rows = self._node_rows
            rows[0].append(self.ids[ev.id])
            rows[1].append(float(ev.ts))
            rows[2].append(ev.features)
            rows[3].append(self.events)
            if len(rows[0]) >= _CHUNK:
                self._flush_nodes()
        else:
            rows = self._edge_rows
            if op == "edge_upsert":
                s, d, upsert = self.ids[ev.src], self.ids[ev.dst], True
            else:
                s, d, upsert = self.ids.get(ev.src, -1), self.ids.get(ev.dst, -1), False
                if s < 0 or d < 0:  # may still be named by a later upsert: resolved at the end
                    self._late.append((self.events, ev.src, ev.dst))
            rows[0].append(s)
            rows[1].append(d)
            rows[2].append(float(ev.weight) if upsert else 0.0)
            rows[3].append(float(ev.ts))
            rows[4].append(upsert)
            rows[5].append(self.events)
            if len(rows[0]) >= _CHUNK:
                self._flush_edges()
        self.events += 1

    def add_edges(self, src: Sequence[str], dst: Sequence[str], weight: np.ndarray, ts: np.ndarray) -> None:
        """Take ``edge_upsert`` events as columns (in order), each weight and time finite."""
        weight, ts = np.asarray(weight, dtype=np.float64), np.asarray(ts, dtype=np.float64)
        if not (len(src) == len(dst) == len(weight) == len(ts)):
            raise ValueError(f"Expected equally long columns (got {len(src)}, {len(dst)}, {len(weight)}, {len(ts)})")
        if not (np.isfinite(weight).all() and np.isfinite(ts).all()):
            raise ValueError("Expected finite weights and times")
        self._flush_edges()
        self._edges.append((*self._ends(src, dst), weight, ts, np.ones(len(ts), dtype=bool),
                            np.arange(self.events, self.events + len(ts), dtype=np.int64)))
        self.events += len(ts)

    def add_nodes(self, ids: Sequence[str], ts: np.ndarray, features: np.ndarray) -> None:
        """Take ``node_upsert`` events as columns (in order): ``features`` is ``[len(ids), dim]``, finite."""
        features = np.asarray(features)
        ts = np.asarray(ts, dtype=np.float64)
        if features.ndim != 2 or len(features) != len(ids) or len(ts) != len(ids):
            raise ValueError(f"Expected {len(ids)} timestamps and a [{len(ids)}, dim] feature matrix "
                             f"(got {len(ts)} and {features.shape})")
        dim = self.dim if self.dim is not None else features.shape[1]
        if features.shape[1] != dim or dim == 0:
            raise ValueError(f"Expected {dim} features per node (got {features.shape[1]})")
        rows = features.astype("<f4")
        in_range = np.isfinite(rows).all() if features.dtype == np.float32 else \
            (np.abs(features.astype(np.float64)) <= _F32_MAX).all()
        if not (np.isfinite(ts).all() and in_range):
            raise ValueError("Expected finite times and features within float32 range")
        self.dim = dim
        self._flush_nodes()
        iids = self.ids.intern(ids)
        self._nodes.append((iids, ts, rows, np.arange(self.events, self.events + len(ids))))
        self.events += len(ids)

    def _ends(self, src: Sequence[str], dst: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The iids of the edges' ends, names not seen before interned in event order (source first).

        The workers look the names up, a range of edges each (a lookup is
        mostly waits on memory); the names none of them found are interned
        here after them, in order.
        """
        m = len(src)
        src_iids, dst_iids = shared_array(m), shared_array(m)
        workers = max(1, min(self.workers, m // _LOOKUPS_PER_WORKER))
        cuts = (np.arange(workers + 1) * m // workers).tolist()
        known = self.ids.get

        def look_up(w: int) -> None:
            a, b = cuts[w], cuts[w + 1]
            for names, iids in ((src, src_iids), (dst, dst_iids)):
                iids[a:b] = np.fromiter(map(known, names[a:b], itertools.repeat(-1)), np.int64, b - a)

        run_parts(look_up, workers)
        new = np.flatnonzero((src_iids < 0) | (dst_iids < 0)).tolist()
        if new:
            ends = self.ids.intern(list(itertools.chain.from_iterable(
                zip(map(src.__getitem__, new), map(dst.__getitem__, new)))))
            src_iids[new], dst_iids[new] = ends[0::2], ends[1::2]
        return src_iids, dst_iids

    def _flush_edges(self) -> None:
        rows = self._edge_rows
        if rows[0]:
            self._edges.append((np.asarray(rows[0], dtype=np.int64), np.asarray(rows[1], dtype=np.int64),
                                np.asarray(rows[2], dtype=np.float64), np.asarray(rows[3], dtype=np.float64),
                                np.asarray(rows[4], dtype=bool), np.asarray(rows[5], dtype=np.int64)))
            for part in rows:
                part.clear()

    def _flush_nodes(self) -> None:
        rows = self._node_rows
        if rows[0]:
            self._nodes.append((np.asarray(rows[0], dtype=np.int64), np.asarray(rows[1], dtype=np.float64),
                                np.asarray(rows[2], dtype="<f4").reshape(len(rows[0]), -1),
                                np.asarray(rows[3], dtype=np.int64)))
            for part in rows:
                part.clear()

    # ------------------------------------------------------------------ the graph the events leave
    def _edge_columns(self) -> tuple[np.ndarray, ...]:
        self._flush_edges()
        if not self._edges:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros(0), np.zeros(0), np.zeros(0, dtype=bool), empty
        cols = [part[0] if len(part) == 1 else np.concatenate(part) for part in zip(*self._edges)]
        if self._late:  # deletes that named a node before an upsert did
            where = np.searchsorted(cols[5], [at for at, _, _ in self._late])
            cols[0][where] = [self.ids.get(s, -1) for _, s, _ in self._late]
            cols[1][where] = [self.ids.get(d, -1) for _, _, d in self._late]
        return tuple(cols)

    def _stream_times(self, edges: tuple[np.ndarray, ...]) -> np.ndarray:
        """Stream time ``T`` before each event, by event number (``-inf`` before the first)."""
        times = np.full(self.events, -np.inf)
        times[edges[5]] = edges[3]
        self._flush_nodes()
        for _, ts, _, seq in self._nodes:
            times[seq] = ts
        before = np.empty(self.events)
        if self.events:
            before[0] = -np.inf
            before[1:] = np.maximum.accumulate(times)[:-1]
        return before

    def _final_edges(self, edges: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(src, dst, weight, t(e))`` of every directed edge the events (:meth:`_edge_columns`) leave, sorted by
        (src, dst): the last event of each pair that is not a late upsert decides; ``t(e)`` is the largest ``ts``
        of the pair's upserts since its last delete; with a window, the edges with ``t(e) <= T - ttl`` at the
        load's final ``T`` are left out."""
        src, dst, weight, ts, upsert, seq = edges
        named = (src >= 0) & (dst >= 0)
        ttl = float(self.store.edge_ttl)
        if ttl:
            before = self._stream_times(edges)
            named &= ~(upsert & (ts <= before[seq] - ttl))
        if not named.all():
            src, dst, weight, ts, upsert, seq = (c[named] for c in (src, dst, weight, ts, upsert, seq))
        order, ends = _key_runs(src * max(len(self.ids), 1) + dst)  # by pair, then event order
        pair = np.empty(len(order), dtype=np.int64)
        pair[order] = np.cumsum(ends) - ends  # each event's pair, numbered in (src, dst) order
        pairs = int(ends.sum())
        last_delete = np.full(pairs, -1, dtype=np.int64)
        np.maximum.at(last_delete, pair[~upsert], seq[~upsert])
        since = upsert & (seq > last_delete[pair])
        newest = np.full(pairs, -np.inf)
        np.maximum.at(newest, pair[since], ts[since])
        last = order[ends]
        last = last[upsert[last]]
        t = newest[pair[last]]
        if ttl and self.events:
            keep = t > self.final_time() - ttl
            last, t = last[keep], t[keep]
        return src[last], dst[last], weight[last], t

    def final_time(self) -> float:
        """Stream time ``T`` once every event taken is applied."""
        self._flush_edges()
        self._flush_nodes()
        ends = [part[3] for part in self._edges] + [part[1] for part in self._nodes]
        return max((float(p.max()) for p in ends if len(p)), default=-np.inf)

    def _node_columns(self, edges: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """``(last_ts, first_ts)`` by iid, then ``(with_features, rows, features)``: the iids that have features,
        ascending, and the row of ``features`` (one per node upsert) that each one's last upsert left."""
        n = len(self.ids)
        last_ts = np.full(n, -np.inf)
        first_ts = np.full(n, np.inf)
        e_src, e_dst, _, e_ts, e_upsert, _ = edges
        for ends in (e_src[e_upsert], e_dst[e_upsert]):
            np.maximum.at(last_ts, ends, e_ts[e_upsert])
            np.minimum.at(first_ts, ends, e_ts[e_upsert])
        self._flush_nodes()
        if not self._nodes:
            none = np.zeros(0, dtype=np.int64)
            return last_ts, first_ts, none, none, np.zeros((0, self.dim or 0), dtype="<f4")
        iids, ts, features, _ = (part[0] if len(part) == 1 else np.concatenate(part) for part in zip(*self._nodes))
        np.maximum.at(last_ts, iids, ts)
        np.minimum.at(first_ts, iids, ts)
        order, ends = _key_runs(iids)
        rows = order[ends]  # each node's last upsert, by iid
        return last_ts, first_ts, iids[rows], rows, features

    # ------------------------------------------------------------------ writing
    def finish(self, progress: Callable[[str], None] | None = None) -> dict[str, int]:
        """Write what the events leave into the store (table files by ``workers`` processes, ingested); returns
        counts.

        A crash before the ingest leaves the state empty; the ingest of the
        families and then of the ``meta`` records that complete it is the last step.
        """
        store = self.store
        encoded = [name.encode() for name in self.ids]
        n = len(encoded)
        if self.fanouts and n > MAX_INDEXED_IDS:
            raise StoreConfigError(f"the sampled-by index holds at most {MAX_INDEXED_IDS} nodes (this load has {n})")
        edges = self._edge_columns()
        src, dst, weight, ts = self._final_edges(edges)
        last_ts, first_ts, with_features, feature_rows, features = self._node_columns(edges)
        del edges
        if progress:
            progress("graph worked out")
        # N(v): the distinct pairs either way, self-loops left out, as neighbour entries (v, u) sorted by v
        links = src != dst
        width = max(n, 1)
        entries = np.concatenate([src[links] * width + dst[links], dst[links] * width + src[links]])
        entries.sort()
        if len(entries):
            entries = entries[np.append(True, entries[1:] != entries[:-1])]
        v, u = np.divmod(entries, width)
        del entries, links
        lists = np.flatnonzero(np.append(True, v[1:] != v[:-1])) if len(v) else np.zeros(0, dtype=np.int64)
        lengths = np.diff(np.append(lists, len(v)))
        by_bytes = np.fromiter(sorted(range(n), key=encoded.__getitem__), np.int64, n)
        name_order = np.empty(n, dtype=np.int64)
        name_order[by_bytes] = np.arange(n)
        node = np.empty(n, dtype=_NODE)
        node["degree"], node["last_ts"], node["first_ts"] = np.bincount(v, minlength=n), last_ts, first_ts
        node["flags"] = 0
        node["flags"][with_features] = keys.FLAG_HAS_FEATURES
        born_at = time_keys(first_ts)
        by_birth = np.argsort(born_at, kind="stable")  # (t, iid) order
        born = np.empty(n, dtype=[("t", ">u8"), ("iid", ">u8")])
        born["t"], born["iid"] = born_at[by_birth], by_birth
        tables = Tables(
            names=NodeNames(encoded), seed=store.seed, by_bytes=by_bytes, name_order=name_order, node=node,
            born=born.view("V16"), with_features=with_features, feature_rows=feature_rows, features=features,
            src=src, dst=dst, weight=weight, ts=ts,
            expiry=np.argsort(time_keys(ts), kind="stable") if store.edge_ttl else None,  # ties: (src, dst) order
            v=v, u=u, lists=lists, samples=[Samples(k, lengths) for k in self.fanouts])
        del encoded
        scratch = tempfile.mkdtemp(prefix=".bulk-", dir=store.path)
        try:
            files = write_tables(tables, scratch, self.workers, store.write_table)
            if progress:
                progress(f"tables written ({self.workers} worker{'s' if self.workers > 1 else ''})")
            if self.fanouts:
                path = os.path.join(scratch, "sampled.sst")
                records = itertools.chain.from_iterable(samples.records() for samples in tables.samples)
                files["sampled"] = [path] if store.write_table("sampled", path, records) else []
                if progress:
                    progress("sampled-by snapshot written")
            store.ingest({family: paths for family, paths in files.items() if paths}, next_iid=n,
                         feature_dim=self.dim, fanouts=self.fanouts,
                         stream_time=self.final_time() if self.events else None)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return {"events": self.events, "nodes": n, "edges": int(len(src)), "neighbour_entries": int(len(v))}
