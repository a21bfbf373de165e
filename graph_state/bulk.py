"""Bulk load: a large initial graph into an empty state as RocksDB table files, without a WriteBatch per batch
(``gnnstream graph load``; what it takes and leaves: ``docs/storage.md``)."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.batch import validate_events
from gnnstream.graph_state.exceptions import StoreConfigError
from gnnstream.graph_state.sampled import MAX_INDEXED_IDS, PAIR_BITS, SNAPSHOT_PAIRS
from gnnstream.graph_state.sampler import check_fanout, seeded_rank_bytes

__all__ = ["BulkLoad"]

_EDGE_RECORD = np.dtype([("weight", ">f8"), ("ts", ">f8")])
_PAIR_KEY = np.dtype([("src", ">u8"), ("dst", ">u8")])
_NODE = np.dtype([("degree", ">u4"), ("flags", "u1"), ("last_ts", ">f8"), ("first_ts", ">f8")])
_SIGN = np.uint64(1 << 63)
_CHUNK = 1 << 20  # events gathered in Python lists before they become arrays
_RANK_SLICE = 1 << 20  # neighbour entries ranked and sorted at a time


class _Interner(dict):
    """``name -> iid`` in order of first appearance: indexing with a new name interns it (``get`` does not)."""

    def __missing__(self, name: str) -> int:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Expected a non-empty string node id (got {name!r})")
        iid = self[name] = len(self)
        return iid


def _distinct_sorted(values: np.ndarray) -> np.ndarray:
    """The distinct ``values``, ascending (a sort, then a pass: faster than ``np.unique``'s hashing at 10 M)."""
    values = np.sort(values)
    return values[np.append(True, values[1:] != values[:-1])] if len(values) else values


def _time_keys(t: np.ndarray) -> np.ndarray:
    """:func:`graph_state.keys.time_key` of many times, as big-endian uint64 (byte order is numeric order)."""
    bits = (np.asarray(t, dtype=np.float64) + 0.0).view(np.uint64)
    return np.where(bits & _SIGN, ~bits, bits | _SIGN)


def _last_per_key(keys_: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """The index of the latest entry (highest ``seq``) of each distinct key, in key order."""
    if not len(keys_):
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((seq, keys_))
    ordered = keys_[order]
    return order[np.flatnonzero(np.append(ordered[1:] != ordered[:-1], True))]


class BulkLoad:
    """Events gathered for one bulk load into ``store``.

    Args:
        store: an open :class:`~gnnstream.graph_state.store.GraphStore` with no node and no fanouts.
        fanouts: the fanouts whose sampled-by index to write with the graph (none: the first engine builds it).

    Raises:
        StoreConfigError: the store already holds nodes or keeps fanouts.
    """

    @staticmethod
    def takes(store: Any) -> bool:
        """Whether ``store`` can take a bulk load: it has interned no node (so holds none) and keeps no fanouts."""
        return not store.fanouts and next(store.column("ids").keys(), None) is None

    def __init__(self, store: Any, fanouts: Sequence[int] = ()):
        if next(store.column("ids").keys(), None) is not None:
            raise StoreConfigError(f"state {store.path!r} already holds a graph: a bulk load needs an empty state")
        if store.fanouts:
            raise StoreConfigError(f"state {store.path!r} keeps a sampled-by index (fanouts {list(store.fanouts)}): "
                                   f"a bulk load needs a state without one")
        self.store = store
        self.fanouts = tuple(sorted({check_fanout(k) for k in fanouts}))
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
        ends = np.fromiter(map(self.ids.__getitem__, itertools.chain.from_iterable(zip(src, dst))), np.int64,
                           2 * len(src))  # interned in event order, source first
        self._edges.append((ends[0::2], ends[1::2], weight, ts, np.ones(len(ts), dtype=bool),
                            np.arange(self.events, self.events + len(ts), dtype=np.int64)))
        self.events += len(ts)

    def add_nodes(self, ids: Sequence[str], ts: np.ndarray, features: np.ndarray) -> None:
        """Take ``node_upsert`` events as columns (in order): ``features`` is ``[len(ids), dim]``, finite."""
        features = np.asarray(features, dtype=np.float64)
        ts = np.asarray(ts, dtype=np.float64)
        if features.ndim != 2 or len(features) != len(ids) or len(ts) != len(ids):
            raise ValueError(f"Expected {len(ids)} timestamps and a [{len(ids)}, dim] feature matrix "
                             f"(got {len(ts)} and {features.shape})")
        dim = self.dim if self.dim is not None else features.shape[1]
        if features.shape[1] != dim or dim == 0:
            raise ValueError(f"Expected {dim} features per node (got {features.shape[1]})")
        if not (np.isfinite(ts).all() and (np.abs(features) <= np.finfo(np.float32).max).all()):
            raise ValueError("Expected finite times and features within float32 range")
        self.dim = dim
        self._flush_nodes()
        iids = np.fromiter(map(self.ids.__getitem__, ids), np.int64, len(ids))
        self._nodes.append((iids, ts, features.astype("<f4"), np.arange(self.events, self.events + len(ids))))
        self.events += len(ids)

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
        cols = [np.concatenate(part) for part in zip(*self._edges)]
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
        src, dst, weight, ts, upsert, seq = (c[named] for c in (src, dst, weight, ts, upsert, seq))
        code = src * max(len(self.ids), 1) + dst
        pairs, pair = np.unique(code, return_inverse=True)
        last_delete = np.full(len(pairs), -1, dtype=np.int64)
        np.maximum.at(last_delete, pair[~upsert], seq[~upsert])
        since = upsert & (seq > last_delete[pair])
        newest = np.full(len(pairs), -np.inf)
        np.maximum.at(newest, pair[since], ts[since])
        last = _last_per_key(code, seq)
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

    def _node_columns(self, edges: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(last_ts, first_ts, has_features, features)`` by iid; features only of the nodes that have them."""
        n = len(self.ids)
        last_ts = np.full(n, -np.inf)
        first_ts = np.full(n, np.inf)
        e_src, e_dst, _, e_ts, e_upsert, _ = edges
        for ends in (e_src[e_upsert], e_dst[e_upsert]):
            np.maximum.at(last_ts, ends, e_ts[e_upsert])
            np.minimum.at(first_ts, ends, e_ts[e_upsert])
        self._flush_nodes()
        has = np.zeros(n, dtype=bool)
        dim = self.dim or 0
        features = np.zeros((n, dim), dtype="<f4")
        if self._nodes:
            iids, ts, feats, seq = (np.concatenate(part) for part in zip(*self._nodes))
            np.maximum.at(last_ts, iids, ts)
            np.minimum.at(first_ts, iids, ts)
            last = _last_per_key(iids, seq)  # a node's last upsert
            features[iids[last]] = feats[last]
            has[iids] = True
        return last_ts, first_ts, has, features

    # ------------------------------------------------------------------ writing
    def finish(self, progress: Callable[[str], None] | None = None) -> dict[str, int]:
        """Write what the events leave into the store (one table file per family, ingested); returns counts.

        A crash before the ingest leaves the state empty; the ingest of the
        families and then of the ``meta`` records that complete it is the last step.
        """
        store = self.store
        names = list(self.ids)
        encoded = [name.encode() for name in names]
        n = len(names)
        edges = self._edge_columns()
        src, dst, weight, ts = self._final_edges(edges)
        last_ts, first_ts, has, features = self._node_columns(edges)
        if progress:
            progress("graph worked out")
        # N(v): the distinct pairs either way, self-loops left out
        links = src != dst
        a, b = np.minimum(src[links], dst[links]), np.maximum(src[links], dst[links])
        pair = _distinct_sorted(a * max(n, 1) + b)
        a, b = pair // max(n, 1), pair % max(n, 1)
        v = np.concatenate([a, b])
        u = np.concatenate([b, a])
        by_v = np.argsort(v, kind="stable")
        v, u = v[by_v], u[by_v]
        degree = np.bincount(v, minlength=n)
        by_name = np.empty(n, dtype=np.int64)
        by_bytes = sorted(range(n), key=encoded.__getitem__)
        by_name[by_bytes] = np.arange(n)
        scratch = tempfile.mkdtemp(prefix=".bulk-", dir=store.path)
        try:
            files: dict[str, list[str]] = {}
            iid_keys = np.arange(n, dtype=">u8").view("V8").tolist()  # encode_iid of every iid

            def table(family: str, items: Iterable[tuple[bytes, bytes]]) -> None:
                path = os.path.join(scratch, f"{family}.sst")
                if store.write_table(family, path, items):
                    files[family] = [path]

            table("ids", zip(map(encoded.__getitem__, by_bytes), map(iid_keys.__getitem__, by_bytes)))
            table("names", zip(iid_keys, encoded))
            node = np.empty(n, dtype=_NODE)
            node["degree"], node["flags"], node["last_ts"] = degree, np.where(has, keys.FLAG_HAS_FEATURES, 0), last_ts
            node["first_ts"] = first_ts
            table("nodes", zip(iid_keys, node.view(f"V{_NODE.itemsize}").tolist()))
            born = np.empty(n, dtype=[("t", ">u8"), ("iid", ">u8")])
            born["t"], born["iid"] = _time_keys(first_ts), np.arange(n)
            born.sort(order=["t", "iid"])
            table("born", ((key, b"") for key in born.view("V16").tolist()))
            if has.any():
                with_features = np.flatnonzero(has)
                rows = np.ascontiguousarray(features[with_features]).view(f"V{features.shape[1] * 4}").ravel()
                table("feats", zip(map(iid_keys.__getitem__, with_features.tolist()), rows.tolist()))
            edge_keys = np.empty(len(src), dtype=_PAIR_KEY)
            edge_keys["src"], edge_keys["dst"] = src, dst
            edge_vals = np.empty(len(src), dtype=_EDGE_RECORD)
            edge_vals["weight"], edge_vals["ts"] = weight, ts
            table("edges", zip(edge_keys.view("V16").tolist(), edge_vals.view("V16").tolist()))
            if store.edge_ttl:
                expiry = np.empty(len(src), dtype=[("t", ">u8"), ("src", ">u8"), ("dst", ">u8")])
                expiry["t"], expiry["src"], expiry["dst"] = _time_keys(ts), src, dst
                expiry.sort(order=["t", "src", "dst"])
                table("expiry", ((key, b"") for key in expiry.view("V24").tolist()))
            table("nbrs", itertools.chain.from_iterable(  # puts u in index order
                self._neighbour_index(v, u, names, encoded, iid_keys, by_name)))
            if progress:
                progress("neighbour index written")
            if self.fanouts:
                table("sampled", self._snapshot(v, u, n))
            if progress:
                progress("tables written")
            store.ingest(files, next_iid=n, feature_dim=self.dim, fanouts=self.fanouts,
                         stream_time=self.final_time() if self.events else None)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return {"events": self.events, "nodes": n, "edges": int(len(src)), "neighbour_entries": int(len(v))}

    def _snapshot(self, v: np.ndarray, u: np.ndarray, n: int) -> Iterable[tuple[bytes, bytes]]:
        """The sampled-by snapshot records of every fanout, from the neighbour entries in index order: ``S_k(v)``
        is the first ``k`` entries of ``v``'s run."""
        if n > MAX_INDEXED_IDS:
            raise StoreConfigError(f"the sampled-by index holds at most {MAX_INDEXED_IDS} nodes (this load has {n})")
        starts = np.flatnonzero(np.append(True, v[1:] != v[:-1])) if len(v) else np.zeros(0, dtype=np.int64)
        run = np.diff(np.append(starts, len(v)))
        position = np.arange(len(v)) - np.repeat(starts, run)
        for k in self.fanouts:
            keep = position < k
            pairs = np.sort((u[keep] << PAIR_BITS) | v[keep]).astype("<i8")
            for chunk, start in enumerate(range(0, len(pairs), SNAPSHOT_PAIRS)):
                yield keys.sampled_snapshot_key(k, chunk), pairs[start:start + SNAPSHOT_PAIRS].tobytes()

    def _neighbour_index(self, v: np.ndarray, u: np.ndarray, names: list[str], encoded: list[bytes],
                         iid_keys: list[bytes], by_name: np.ndarray) -> Iterable[Iterable[tuple[bytes, bytes]]]:
        """The ``nbrs`` records of the entries ``(v, u)`` (sorted by ``v``) in key order, a slice of whole
        neighbour lists at a time (each slice's ranks computed and sorted as it is reached); ``u`` is left in
        index order (rank, then id) within each ``v``."""
        rank = seeded_rank_bytes(self.store.seed)
        starts = np.flatnonzero(np.append(True, v[1:] != v[:-1]))[1:]  # where each neighbour list but the first begins
        cut = np.unique(np.searchsorted(starts, np.arange(_RANK_SLICE, len(v), _RANK_SLICE)))
        lo = 0
        for hi in [*starts[cut[cut < len(starts)]].tolist(), len(v)]:  # slices end where a neighbour list begins
            if hi <= lo:
                continue
            vs, us = v[lo:hi], u[lo:hi]
            ranks = list(map(rank, map(names.__getitem__, vs.tolist()), map(names.__getitem__, us.tolist())))
            order = np.lexsort((by_name[us], np.frombuffer(b"".join(ranks), dtype=">u8"), vs))
            us[:] = us[order]  # u is a view into the caller's array: index order for the snapshot
            keys_ = map(bytes.__add__, map(bytes.__add__, map(iid_keys.__getitem__, vs.tolist()),
                                           map(ranks.__getitem__, order.tolist())),
                        map(encoded.__getitem__, us.tolist()))
            yield zip(keys_, map(iid_keys.__getitem__, us.tolist()))
            lo = hi
