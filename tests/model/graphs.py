"""Test helpers: random graphs, deterministic sampled edge lists, engine-style batches."""

from __future__ import annotations

import random

import torch
from torch import Tensor

__all__ = ["random_neighbourhoods", "sampled_edge_index", "gather_batch", "randomise_", "run_layerwise"]


def random_neighbourhoods(num_nodes: int, num_edges: int, seed: int, isolated: int = 2) -> list[set[int]]:
    """``N(v)`` of a random directed graph (both directions, no self loops).

    The first ``isolated`` nodes get no edges at all.
    """
    rng = random.Random(seed)
    nbrs: list[set[int]] = [set() for _ in range(num_nodes)]
    if num_nodes - isolated < 2:
        return nbrs
    for _ in range(num_edges):
        u, v = rng.randrange(isolated, num_nodes), rng.randrange(isolated, num_nodes)
        if u != v:
            nbrs[v].add(u)
            nbrs[u].add(v)
    return nbrs


def _rank(v: int, u: int, salt: int) -> int:
    return (u * 2654435761 + v * 40503 + salt * 97) % (1 << 32)


def sampled_edge_index(nbrs: list[set[int]], k: int | None, salt: int = 0) -> Tensor:
    """Edges ``u -> v`` for ``u ∈ S_k(v)``: the ``k`` neighbours with the smallest ``(rank, u)``.

    ``k=None`` keeps every neighbour. Returns a ``[2, E]`` int64 tensor.
    """
    src: list[int] = []
    dst: list[int] = []
    for v, members in enumerate(nbrs):
        chosen = sorted(members, key=lambda u: (_rank(v, u, salt), u))
        if k is not None:
            chosen = chosen[:k]
        src.extend(chosen)
        dst.extend([v] * len(chosen))
    return torch.tensor([src, dst], dtype=torch.long).reshape(2, -1)


def gather_batch(x: Tensor, edge_index: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """What the engine feeds a layer for ``targets``: ``(x_self, x_nbr, index, self_count, nbr_count)``."""
    num_nodes = x.size(0)
    src, dst = edge_index[0], edge_index[1]
    count = torch.bincount(dst, minlength=num_nodes)
    pos = torch.full((num_nodes,), -1, dtype=torch.long)
    pos[targets] = torch.arange(targets.numel())
    keep = pos[dst] >= 0
    src_kept = src[keep]
    return x[targets], x[src_kept], pos[dst[keep]], count[targets], count[src_kept]


def randomise_(module: torch.nn.Module, seed: int, scale: float = 0.5) -> torch.nn.Module:
    """Fill every parameter with ``N(0, scale²)`` noise (so zero-initialised biases are tested too)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return module


def run_layerwise(gnn, x: Tensor, edge_lists: list[Tensor], batch_size: int, seed: int) -> Tensor:
    """Run ``gnn.layer`` over all nodes in shuffled batches, one layer at a time, like the engine."""
    gen = torch.Generator().manual_seed(seed)
    h = x
    for l, edges in enumerate(edge_lists):
        out = torch.empty(x.size(0), gnn.dims[l + 1])
        order = torch.randperm(x.size(0), generator=gen)
        for start in range(0, x.size(0), batch_size):
            targets = order[start:start + batch_size]
            out[targets] = gnn.layer(l, *gather_batch(h, edges, targets))
        h = out
    return h
