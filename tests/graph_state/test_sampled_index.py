"""The in-memory sampled-by index against a plain set of pairs, across merges of its pending changes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gnnstream.graph_state.sampled import SampledIndex


def _packed(pairs) -> np.ndarray:
    return np.asarray(sorted((u << 32) | v for u, v in pairs), dtype=np.int64)


@pytest.mark.parametrize("compact_at", [1, 40, 1 << 16])
def test_lookup_matches_a_set_of_pairs(compact_at: int, monkeypatch) -> None:
    monkeypatch.setattr(SampledIndex, "compact_at", compact_at)
    rng = random.Random(compact_at)
    truth = {(rng.randrange(50), rng.randrange(200)) for _ in range(3000)}
    index = SampledIndex(_packed(truth))
    merged = 0
    for step in range(300):
        removed = set(rng.sample(sorted(truth), min(len(truth), rng.randrange(30))))
        added = {(rng.randrange(60), rng.randrange(200)) for _ in range(rng.randrange(30))} - truth
        truth = (truth - removed) | added
        before = len(index.added) + len(index.removed)
        index.update(_packed(removed), _packed(added))
        merged += len(index.added) + len(index.removed) < before
        sources = np.asarray(rng.sample(range(60), 10), dtype=np.int64)
        bound = rng.choice([None, 3, 60])
        deps, over = index.lookup(sources, bound)
        want, want_over = [], []
        for u in sources.tolist():
            vs = [v for a, v in truth if a == u]
            (want_over.append(u) if bound is not None and len(vs) > bound else want.extend(vs))
        assert sorted(deps.tolist()) == sorted(want), f"step {step}"
        assert sorted(over.tolist()) == sorted(want_over), f"step {step}"
    if compact_at < 100:
        assert merged > 0  # the merge path was exercised
