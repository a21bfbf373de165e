"""A networkx reference model of the graph store and helpers to compare the two.

The model follows docs/design.md literally and shares no code with ``graph_state``
except ``sample_neighbors``, which is itself checked against :func:`ranked`, an
independent inline implementation of the rank formula.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Iterable, Sequence

import networkx as nx
import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.sampler import sample_neighbors
from gnnstream.stream.events import EdgeDelete, EdgeUpsert, NodeDelete, NodeUpsert
from tests.graph_state._events import DIM, random_batches

__all__ = ["GraphModel", "ranked", "assert_store_matches", "raw_contents", "random_batches", "DIM"]


def ranked(seed: int, v: str, members: Iterable[str]) -> list[str]:
    """``members`` sorted by ``(r(v, u), u)``, the rank formula of docs/design.md written out."""

    def key(u: str) -> tuple[int, str]:
        digest = blake2b(f"{seed}:{v}:{u}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big"), u

    return sorted((u for u in set(members) if u != v), key=key)


class GraphModel:
    """The graph of docs/design.md as an ``nx.DiGraph`` plus a feature dict."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.g = nx.DiGraph()
        self.features: dict[str, np.ndarray] = {}
        self._samples: dict[tuple[str, int], list[str]] = {}  # memo, dropped when N(v) may change

    # -------------------------------------------------------------- events
    def apply(self, ev) -> None:
        if isinstance(ev, (EdgeUpsert, EdgeDelete)):
            stale = {ev.src, ev.dst}
        else:
            stale = {ev.id} | self.nbrs(ev.id)
        self._samples = {key: val for key, val in self._samples.items() if key[0] not in stale}
        if isinstance(ev, EdgeUpsert):
            # t(e): the largest ts of the edge's upserts since it was created
            old = self.g.edges[ev.src, ev.dst]["ts"] if self.g.has_edge(ev.src, ev.dst) else float(ev.ts)
            self.g.add_edge(ev.src, ev.dst, weight=float(ev.weight), ts=max(old, float(ev.ts)))
        elif isinstance(ev, EdgeDelete):
            if self.g.has_edge(ev.src, ev.dst):
                self.g.remove_edge(ev.src, ev.dst)
        elif isinstance(ev, NodeUpsert):
            self.g.add_node(ev.id)
            self.features[ev.id] = np.asarray(ev.features, dtype=np.float32)
        elif isinstance(ev, NodeDelete):
            if ev.id in self.g:
                self.g.remove_node(ev.id)
                self.features.pop(ev.id, None)
        else:  # pragma: no cover - test bug
            raise TypeError(ev)

    def apply_all(self, events: Iterable) -> "GraphModel":
        for ev in events:
            self.apply(ev)
        return self

    # -------------------------------------------------------------- queries
    def nodes(self) -> set[str]:
        return set(self.g.nodes)

    def nbrs(self, v: str) -> set[str]:
        if v not in self.g:
            return set()
        return (set(self.g.successors(v)) | set(self.g.predecessors(v))) - {v}

    def sample(self, v: str, k: int) -> list[str]:
        """``S_k(v)`` from the project's sampler, cross-checked with :func:`ranked`."""
        memo = self._samples.get((v, k))
        if memo is not None:
            return list(memo)
        n = self.nbrs(v)
        expected = sample_neighbors(self.seed, v, n, k)
        assert expected == ranked(self.seed, v, n)[:k], f"sampler oracle disagrees with the rank formula for {v!r}"
        self._samples[(v, k)] = expected
        return list(expected)

    def edges(self) -> list[tuple[str, str, float, float]]:
        return sorted((s, d, a["weight"], a["ts"]) for s, d, a in self.g.edges(data=True))

    def sampled_by(self, k: int) -> dict[str, set[str]]:
        """Reverse index: ``u -> {v : u in S_k(v)}``."""
        rev: dict[str, set[str]] = {}
        for v in self.g.nodes:
            for u in self.sample(v, k):
                rev.setdefault(u, set()).add(v)
        return rev


def assert_store_matches(store, model: GraphModel, names: Iterable[str], ks: Sequence[int]) -> None:
    """Assert that every read of ``store`` agrees with ``model``.

    Args:
        store: an open ``GraphStore``.
        model: the reference model after the same events.
        names: every node name the events mentioned (present or not).
        ks: the sample sizes to check.
    """
    names = set(names) | model.nodes()
    present = model.nodes()
    assert set(store.nodes()) == present
    assert store.num_nodes() == len(present)
    assert sorted(store.edges()) == model.edges()
    for v in sorted(names):
        exists = v in present
        assert store.exists(v) == exists, f"exists({v!r})"
        n = model.nbrs(v)
        order = ranked(model.seed, v, n)
        assert store.neighbors(v) == order, f"N({v!r}) or its rank order"
        assert store.degree(v) == len(n), f"degree({v!r})"
        for k in ks:
            assert store.sample(v, k) == model.sample(v, k), f"S_{k}({v!r})"
        want = model.features.get(v)
        got = store.features(v)
        if want is None:
            assert got is None, f"features({v!r}) should be absent"
        else:
            assert got is not None and got.dtype == np.float32, f"features({v!r})"
            assert np.array_equal(got, want), f"features({v!r})"
        iid = store.iid(v)
        if exists:
            assert iid is not None
            assert store.has_features_iid(iid) == (want is not None)
            assert store.sample_iids(iid, 3) == [store.iid(u) for u in model.sample(v, 3)]
    for s, d, w, ts in model.edges():
        assert store.edge(s, d) == (w, ts)
    for k in store.fanouts:
        rev = model.sampled_by(k)
        for u in sorted(names):
            iid = store.iid(u)
            if iid is None:
                assert u not in rev
                continue
            got = sorted(store.name(x) for x in store.sampled_by(k, iid))
            assert got == sorted(rev.get(u, ())), f"sampled_by({k}, {u!r})"


def raw_contents(store) -> dict[str, list[tuple[bytes, bytes]]]:
    """The raw key/value pairs of every column family (for "nothing was written" checks)."""
    return {cf: list(store.column(cf).items()) for cf in keys.COLUMN_FAMILIES}
