"""What-if overlays: the stored graph with a list of events folded on top, in memory (the store is never
written), as :meth:`GraphStore.apply` would apply them, the edge window and node ages included."""

from __future__ import annotations

import heapq
import logging
from typing import Iterator, Sequence

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.sampler import seeded_rank_bytes
from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.events import EdgeDelete, EdgeUpsert, Event, NodeDelete, NodeUpsert

__all__ = ["Overlay"]

logger = logging.getLogger(__name__)


class Overlay:
    """The stored graph with a list of events folded on top, held in memory; the store is never written.

    Nodes are stored iids, or negative numbers for nodes the events create.
    """

    def __init__(self, store: GraphStore, seed: int):
        self.store = store
        self._rank = seeded_rank_bytes(seed)
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._next_new = -1
        self.exists: dict[int, bool] = {}
        self.features: dict[int, np.ndarray | None] = {}  # None: no features
        self._edges: dict[tuple[int, int], bool] = {}
        self.added: dict[int, dict[int, bytes]] = {}  # v -> {u: order key} in N'(v), not in the stored N(v)
        self.removed: dict[int, set[int]] = {}  # v -> stored members of N(v) no longer in N'(v)
        self.inputs: set[int] = set()  # nodes whose h^0 the events changed (features, existence)
        self.nbrs: set[int] = set()  # nodes whose neighbour set (or age) the events changed
        self.ttl = float(store.edge_ttl)
        self.stream_time: float | None = store.stream_time  # T' (None: no event yet)
        self._edge_time: dict[tuple[int, int], float] = {}  # t(e) of the edges the events wrote
        self._first: dict[int, float] = {}  # first(v) of the nodes the events named or created

    # ---------------------------------------------------------------- ids
    def node(self, name: str, create: bool = False) -> int | None:
        """The id of node ``name`` (stored iid, or an overlay id when ``create`` and it was never stored)."""
        got = self._ids.get(name)
        if got is not None:
            return got
        iid = self.store.iid(name)
        if iid is None:
            if not create:
                return None
            iid, self._next_new = self._next_new, self._next_new - 1
        self._ids[name], self._names[iid] = iid, name
        return iid

    def name(self, v: int) -> str:
        name = self._names.get(v)
        if name is None:
            name = self._names[v] = self.store.name(v)
        return name

    # ---------------------------------------------------------------- the folded graph
    def alive(self, v: int) -> bool:
        got = self.exists.get(v)
        if got is not None:
            return got
        return v >= 0 and self.store.exists_iid(v)

    def edge(self, s: int, d: int) -> bool:
        got = self._edges.get((s, d))
        if got is not None:
            return got
        return s >= 0 and d >= 0 and self.store.edge(self.name(s), self.name(d)) is not None

    def degree(self, v: int) -> int:
        stored = self.store.degree_iid(v) if v >= 0 else 0
        return stored + len(self.added.get(v, ())) - len(self.removed.get(v, ()))

    def first(self, v: int) -> float:
        got = self._first.get(v)
        if got is not None:
            return got
        return float(self.store.first_ts(np.asarray([v]))[0]) if v >= 0 else 0.0

    def age(self, v: int) -> float:
        """``T' - first'(v)``."""
        return (self.stream_time or 0.0) - self.first(v)

    def edge_time(self, s: int, d: int) -> float | None:
        if not self.edge(s, d):
            return None
        got = self._edge_time.get((s, d))
        if got is None:
            got = self.store.edge(self.name(s), self.name(d))[1]
        return got

    def has_features(self, v: int) -> bool:
        if v in self.features:
            return self.features[v] is not None
        return v >= 0 and self.store.has_features_iid(v)

    def neighbours(self, v: int) -> Iterator[tuple[bytes, int]]:
        """``N'(v)`` in sampling order (``(order key, u)``), read lazily."""
        removed = self.removed.get(v, set())
        stored = ((key, u) for key, u in (self.store.ranked_neighbours(v) if v >= 0 else ()) if u not in removed)
        added = sorted((key, u) for u, key in self.added.get(v, {}).items())
        return heapq.merge(stored, added)

    def sample(self, v: int, k: int) -> list[int]:
        """``S'_k(v)``: the stored sample when nothing touched ``v``'s neighbours, else merged."""
        if k == 0:
            return []
        if v >= 0 and v not in self.added and v not in self.removed:
            return list(self.store.sample_iids(v, k))
        out = []
        for _, u in self.neighbours(v):
            out.append(u)
            if len(out) == k:
                break
        return out

    def _link(self, v: int, u: int) -> None:
        """``u`` joins ``N'(v)``."""
        self.nbrs.add(v)
        if u in self.removed.get(v, ()):
            self.removed[v].discard(u)
        else:
            self.added.setdefault(v, {})[u] = self._rank(self.name(v), self.name(u)) + self.name(u).encode()

    def _unlink(self, v: int, u: int) -> None:
        """``u`` leaves ``N'(v)``."""
        self.nbrs.add(v)
        if u in self.added.get(v, {}):
            del self.added[v][u]
        else:
            self.removed.setdefault(v, set()).add(u)

    def _touch(self, name: str, ts: float) -> int:
        v = self.node(name, create=True)
        if not self.alive(v):
            self.exists[v] = True
            self.features[v] = None  # a node brought back by an edge has no features
            self.inputs.add(v)
            self._first[v] = float(ts)
        elif ts < self.first(v):
            self._first[v] = float(ts)
            self.nbrs.add(v)  # its age, so its stage, may change
        return v

    def _remove(self, s: int, d: int) -> None:
        self._edges[(s, d)] = False
        self._edge_time.pop((s, d), None)
        if s != d and not self.edge(d, s):
            self._unlink(s, d)
            self._unlink(d, s)

    def apply(self, ev: Event) -> None:
        """Fold one event in, as :meth:`GraphStore.apply` would apply it."""
        now = -np.inf if self.stream_time is None else self.stream_time
        if ev.ts > now:
            self.stream_time = float(ev.ts)
        if isinstance(ev, EdgeUpsert):
            s, d = self._touch(ev.src, ev.ts), self._touch(ev.dst, ev.ts)
            if self.ttl and ev.ts <= now - self.ttl:  # late: the endpoints only
                return
            old = self.edge_time(s, d)
            was = old is not None or self.edge(d, s)
            self._edges[(s, d)] = True
            self._edge_time[(s, d)] = float(ev.ts) if old is None else max(old, float(ev.ts))
            if s != d and not was:
                self._link(s, d)
                self._link(d, s)
        elif isinstance(ev, EdgeDelete):
            s, d = self.node(ev.src), self.node(ev.dst)
            if s is None or d is None or not self.edge(s, d):
                return
            self._remove(s, d)
        elif isinstance(ev, NodeUpsert):
            v = self._touch(ev.id, ev.ts)
            self.features[v] = np.asarray(ev.features, dtype=np.float32)
            self.inputs.add(v)
        elif isinstance(ev, NodeDelete):
            v = self.node(ev.id)
            if v is None or not self.alive(v):
                return
            for _, u in list(self.neighbours(v)):
                self._edges[(v, u)] = self._edges[(u, v)] = False
                self._unlink(v, u)
                self._unlink(u, v)
            self._edges[(v, v)] = False
            self.exists[v], self.features[v] = False, None
            self._first.pop(v, None)
            self.inputs.add(v)

    def expire(self) -> int:
        """Remove the edges with ``t(e) <= T' - ttl`` (after the events); return how many."""
        if not self.ttl or self.stream_time is None:
            return 0
        threshold = self.stream_time - self.ttl
        stop = keys.time_key(threshold)
        due = []
        for key in self.store.column("expiry").keys():
            if key[:8] > stop:
                break
            _, s, d = keys.decode_expiry_key(key)
            if (s, d) not in self._edge_time and self._edges.get((s, d)) is not False:
                due.append((s, d))
        due += [e for e, t in self._edge_time.items() if t <= threshold]
        for s, d in due:
            self._remove(s, d)
        return len(due)

    def feature_rows(self, nodes: Sequence[int], dim: int) -> np.ndarray:
        rows = np.zeros((len(nodes), dim), dtype=np.float32)
        stored = [(i, v) for i, v in enumerate(nodes) if v not in self.features]
        if stored:
            got, _ = self.store.feature_rows([v for _, v in stored], dim)
            rows[[i for i, _ in stored]] = got
        for i, v in enumerate(nodes):
            f = self.features.get(v)
            if f is not None:
                rows[i] = f
        return rows
