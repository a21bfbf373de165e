"""An independent from-scratch reference for the embedding contract of docs/design.md.

Nothing here uses the engine, the graph store, the sampler or the ``model``
package. The final graph is folded from the events with plain dicts
(:class:`GraphFold`), ``N(v)`` and the bottom-k samples are built with an
inline copy of the rank formula, and the embeddings are computed by PyTorch
Geometric's ``GraphSAGE`` / ``GCN`` / ``GAT`` built from the model directory's
``config.json`` and loaded with its ``weights.pt`` via ``load_state_dict``,
run layer by layer on one sampled edge list per layer (in float64).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from hashlib import blake2b
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import torch
from torch_geometric.nn.models import GAT, GCN, GraphSAGE

__all__ = [
    "GraphFold",
    "fold_jsonl",
    "rank",
    "neighbourhoods",
    "bottom_k",
    "layer_edge_lists",
    "reference_embeddings",
    "expected_modes",
    "assert_embeddings_close",
    "fast_tempdir",
    "gnnstream_command",
    "run_gnnstream",
    "DATA_DIR",
    "ATOL",
]

ATOL = 1e-4
# tests/workers/reference.py -> parents[2] is the repository root, which carries the data.
DATA_DIR = Path(__file__).resolve().parents[2] / "data"

_SHM = Path("/dev/shm")


def gnnstream_command(*argv: Any) -> list[str]:
    """The command line running ``gnnstream ARGV`` in a process of its own (the installed script of this
    environment, else the CLI module with this interpreter)."""
    script = Path(sys.executable).with_name("gnnstream")
    base = [str(script)] if script.is_file() else [sys.executable, "-m", "gnnstream.workers.cli"]
    return base + [str(a) for a in argv]


def run_gnnstream(*argv: Any, timeout: float = 600) -> subprocess.CompletedProcess:
    """``gnnstream ARGV`` in a process of its own, as an operator runs it (no progress bars; wide help
    texts); its output is captured as text. ``timeout`` is a safety net, not a measurement."""
    env = dict(os.environ, GNNSTREAM_NO_PROGRESS="1", COLUMNS="200")
    return subprocess.run(gnnstream_command(*argv), capture_output=True, text=True, env=env, timeout=timeout)


def fast_tempdir() -> tempfile.TemporaryDirectory:
    """A temporary directory on tmpfs when there is one (RocksDB open/close is much faster there)."""
    root = str(_SHM) if _SHM.is_dir() and os.access(_SHM, os.W_OK) else None
    return tempfile.TemporaryDirectory(dir=root, prefix="gnnstream-test-")


_PYG = {"sage": GraphSAGE, "gcn": GCN, "gat": GAT}


# ---------------------------------------------------------------------- the graph
class GraphFold:
    """The final graph of an event stream, folded literally from docs/design.md.

    A node exists from the first ``edge_upsert`` / ``node_upsert`` naming it
    until a ``node_delete``; ``edge_delete`` / ``node_delete`` never create a
    node; ``node_delete`` removes the node's features and every edge touching it.
    """

    def __init__(self) -> None:
        self.nodes: set[str] = set()
        self.edges: set[tuple[str, str]] = set()
        self.features: dict[str, np.ndarray] = {}

    def edge_upsert(self, src: str, dst: str) -> None:
        self.nodes.update((src, dst))
        self.edges.add((src, dst))

    def edge_delete(self, src: str, dst: str) -> None:
        self.edges.discard((src, dst))

    def node_upsert(self, node: str, features: Iterable[float]) -> None:
        self.nodes.add(node)
        self.features[node] = np.asarray(list(features), dtype=np.float32)

    def node_delete(self, node: str) -> None:
        self.nodes.discard(node)
        self.features.pop(node, None)
        self.edges = {(s, d) for s, d in self.edges if s != node and d != node}

    def apply_obj(self, ev: Mapping[str, Any]) -> None:
        """Apply one event given as a JSON object (the JSONL schema)."""
        op = ev["op"]
        if op == "edge_upsert":
            self.edge_upsert(_id(ev["src"]), _id(ev["dst"]))
        elif op == "edge_delete":
            self.edge_delete(_id(ev["src"]), _id(ev["dst"]))
        elif op == "node_upsert":
            self.node_upsert(_id(ev["id"]), ev["features"])
        elif op == "node_delete":
            self.node_delete(_id(ev["id"]))
        else:
            raise ValueError(f"unknown op {op!r}")

    def apply_event(self, ev: Any) -> None:
        """Apply one event object with an ``op`` attribute (``stream.events`` dataclasses)."""
        op = ev.op
        if op == "edge_upsert":
            self.edge_upsert(ev.src, ev.dst)
        elif op == "edge_delete":
            self.edge_delete(ev.src, ev.dst)
        elif op == "node_upsert":
            self.node_upsert(ev.id, ev.features)
        elif op == "node_delete":
            self.node_delete(ev.id)
        else:
            raise ValueError(f"unknown op {op!r}")


def _id(value: Any) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def fold_jsonl(path: str | Path, limit: int | None = None) -> GraphFold:
    """Fold (the first ``limit`` lines of) a JSONL event file."""
    fold = GraphFold()
    with open(path, "rb") as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                break
            if line.strip():
                fold.apply_obj(json.loads(line))
    return fold


# ---------------------------------------------------------------------- sampling
def rank(seed: int, v: str, u: str) -> int:
    """``r(v, u)`` exactly as docs/design.md writes it."""
    return int.from_bytes(blake2b(f"{seed}:{v}:{u}".encode(), digest_size=8).digest(), "big")


def neighbourhoods(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    """``N(v) = {u != v : u->v or v->u}`` for every node (empty set for isolated nodes)."""
    nbrs: dict[str, set[str]] = {v: set() for v in nodes}
    for s, d in edges:
        if s == d:
            continue
        nbrs.setdefault(s, set()).add(d)
        nbrs.setdefault(d, set()).add(s)
    return nbrs


def bottom_k(seed: int, v: str, members: Iterable[str], k: int) -> list[str]:
    """``S_k(v)``: the ``k`` members with the smallest ``(r(v, u), u)``."""
    return sorted(members, key=lambda u: (rank(seed, v, u), u))[:k]


def layer_edge_lists(order: list[str], nbrs: Mapping[str, set[str]], seed: int, fanouts: Iterable[int],
                     uses_neighbours: Any = None) -> list[torch.Tensor]:
    """One ``[2, E]`` edge list ``u -> v`` (``u ∈ S_{k_l}(v)``) per layer over ``order``'s indices.

    ``uses_neighbours(degree)`` False means the node aggregates nothing (cold-start policy).
    """
    index = {v: i for i, v in enumerate(order)}
    ranked = {v: sorted(nbrs[v], key=lambda u: (rank(seed, v, u), u)) for v in order}
    out = []
    for k in fanouts:
        src: list[int] = []
        dst: list[int] = []
        for v in order:
            if uses_neighbours is not None and not uses_neighbours(len(nbrs[v])):
                continue
            for u in ranked[v][:k]:
                src.append(index[u])
                dst.append(index[v])
        out.append(torch.tensor([src, dst], dtype=torch.long).reshape(2, -1))
    return out


# ---------------------------------------------------------------------- the model
def _read_model(model_dir: str | Path) -> tuple[dict[str, Any], torch.nn.Module]:
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg["arch"]
    extra = {"heads": cfg.get("heads", 1)} if arch == "gat" else {}
    net = _PYG[arch](cfg["in_dim"], cfg["hidden_dim"], cfg["num_layers"], out_channels=cfg["out_dim"], **extra)
    state = torch.load(model_dir / "weights.pt", map_location="cpu", weights_only=True)
    net.load_state_dict(state)
    return cfg, net.double().eval()


def _uses_neighbours(cfg: Mapping[str, Any]) -> Any:
    policy = (cfg.get("cold_start") or {"policy": "plain"})
    if policy.get("policy", "plain") == "plain":
        return None
    if policy["policy"] == "feature_only":
        m = int(policy.get("min_neighbours", 1))
        return lambda degree: degree >= m
    raise ValueError(f"reference does not know cold_start policy {policy!r}")


def reference_embeddings(nodes: Iterable[str], edges: Iterable[tuple[str, str]],
                         features: Mapping[str, Any], model_dir: str | Path,
                         seed: int | None = None) -> dict[str, np.ndarray]:
    """Every existing node's final embedding, computed from scratch with PyG.

    Args:
        nodes: every existing node (isolated ones included).
        edges: the present directed edges ``(src, dst)``.
        features: ``h^0`` of the nodes that have features (others get zeros).
        model_dir: a model directory (``config.json`` + ``weights.pt``).
        seed: the sampling seed (default: the model's).
    """
    cfg, net = _read_model(model_dir)
    seed = cfg["seed"] if seed is None else seed
    order = sorted(set(nodes))
    if not order:
        return {}
    nbrs = neighbourhoods(order, [(s, d) for s, d in edges])
    assert set(nbrs) == set(order), "edges name nodes that do not exist"
    x = torch.zeros(len(order), cfg["in_dim"], dtype=torch.float64)
    for i, v in enumerate(order):
        if v in features:
            x[i] = torch.as_tensor(np.asarray(features[v], dtype=np.float32), dtype=torch.float64)
    edge_lists = layer_edge_lists(order, nbrs, seed, cfg["fanouts"], _uses_neighbours(cfg))
    last = len(net.convs) - 1
    with torch.no_grad():
        for l, conv in enumerate(net.convs):
            x = conv(x, edge_lists[l])
            if l < last:
                x = x.relu()
    return {v: x[i].numpy().astype(np.float64) for i, v in enumerate(order)}


def expected_modes(fold: GraphFold, model_dir: str | Path) -> dict[str, str]:
    """The ``mode`` each node's embedding should be published with."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    uses = _uses_neighbours(cfg)
    nbrs = neighbourhoods(fold.nodes, fold.edges)
    out = {}
    for v in fold.nodes:
        if uses is not None and not uses(len(nbrs[v])):
            out[v] = "feature_only"
        else:
            out[v] = "full" if v in fold.features else "cold_start"
    return out


def assert_embeddings_close(got: Mapping[str, Any], want: Mapping[str, Any], atol: float = ATOL,
                            what: str = "embeddings") -> None:
    """Same node set and every vector within ``atol`` (max abs), with a readable failure."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    assert not missing and not extra, f"{what}: missing nodes {missing[:10]}, unexpected nodes {extra[:10]}"
    worst, worst_node = 0.0, None
    for v, w in want.items():
        g = np.asarray(got[v], dtype=np.float64)
        w = np.asarray(w, dtype=np.float64)
        assert g.shape == w.shape, f"{what}: node {v!r} has shape {g.shape}, expected {w.shape}"
        err = float(np.abs(g - w).max()) if g.size else 0.0
        if err > worst:
            worst, worst_node = err, v
    assert worst <= atol, (f"{what}: node {worst_node!r} differs by {worst:.3g} > {atol} "
                           f"(got {np.asarray(got[worst_node])}, expected {np.asarray(want[worst_node])})")
