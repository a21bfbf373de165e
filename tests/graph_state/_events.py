"""Deterministic event streams shared by the tests and the crash-test child (no networkx import)."""

from __future__ import annotations

import random

from gnnstream.stream.events import EdgeDelete, EdgeUpsert, NodeDelete, NodeUpsert

__all__ = ["DIM", "random_batches"]

DIM = 4


def random_batches(seed: int, n_batches: int, batch_size: int, n_nodes: int = 60) -> list[list]:
    """A deterministic event stream with a hub, self loops, reciprocal edges and deletes."""
    rng = random.Random(seed)
    names = [f"v{i}" for i in range(n_nodes)]
    out = []
    ts = 0
    for _ in range(n_batches):
        batch = []
        for _ in range(batch_size):
            ts += 1
            r = rng.random()
            a = "hub" if rng.random() < 0.4 else rng.choice(names)
            b = rng.choice(names + ["hub"])
            if r < 0.55:
                batch.append(EdgeUpsert(a, b, ts, round(rng.uniform(-10, 10), 3)))
            elif r < 0.75:
                batch.append(EdgeDelete(a, b, ts))
            elif r < 0.95:
                batch.append(NodeUpsert(b, ts, tuple(round(rng.uniform(-1, 1), 4) for _ in range(DIM))))
            else:
                batch.append(NodeDelete("hub" if rng.random() < 0.02 else b, ts))
        out.append(batch)
    return out
