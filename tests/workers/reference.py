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

import contextlib
import gc
import heapq
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
from hashlib import blake2b
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import pytest
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
    "fold_embeddings",
    "staged_stages",
    "assert_embeddings_close",
    "fast_tempdir",
    "gnnstream_command",
    "run_gnnstream",
    "call_gnnstream",
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


@contextlib.contextmanager
def _fd_output(fd: int) -> Iterator[Callable[[], str]]:
    """What is written to file descriptor ``fd`` (1 or 2) below Python (RocksDB, torch) inside the block."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(fd)
        os.dup2(sink.fileno(), fd)
        try:
            yield lambda: (sink.seek(0), sink.read().decode(errors="replace"))[1]
        finally:
            os.dup2(saved, fd)
            os.close(saved)


def call_gnnstream(*argv: Any) -> subprocess.CompletedProcess:
    """``gnnstream ARGV`` run in this process, without the start-up of a new interpreter: its exit status,
    stdout and stderr as :func:`run_gnnstream` gives them (with the log records of WARNING and above, as the
    command logs them in a process of its own, and what native code writes to file descriptors 1 and 2), in
    the same environment. For what needs no process of its own (no lock held here, no crash, no fork, no
    server or signal handler left behind)."""
    from gnnstream.workers.cli import main
    from gnnstream.workers.settings import LOG_FORMAT
    out, err = io.StringIO(), io.StringIO()
    log = logging.StreamHandler(err)
    log.setLevel(logging.WARNING)
    log.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.addHandler(log)
    collector = gc.get_threshold()  # the command tunes the collector for a process of its own
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.MonkeyPatch.context() as env, \
                _fd_output(1) as native_out, _fd_output(2) as native_err:
            env.setenv("GNNSTREAM_NO_PROGRESS", "1")
            env.setenv("COLUMNS", "200")
            try:
                status = main([str(a) for a in argv])
            except SystemExit as exc:  # argparse's usage errors
                status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            stdout, stderr = native_out() + out.getvalue(), native_err() + err.getvalue()
    finally:
        root.removeHandler(log)
        gc.set_threshold(*collector)
    return subprocess.CompletedProcess(list(argv), status, stdout, stderr)


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

    Event time: ``T`` is the largest ``ts`` seen; with ``edge_ttl`` an edge
    ``e`` is present only while ``t(e) > T - ttl`` (checked after every event),
    ``t(e)`` being the largest ``ts`` of its upserts since it was last created,
    and an upsert with ``ts <= T - ttl`` on arrival is late: it creates its
    endpoints and nothing else. ``first[v]`` is the smallest ``ts`` of the
    upserts naming ``v`` since it was last created.
    """

    def __init__(self, edge_ttl: float = 0) -> None:
        self.nodes: set[str] = set()
        self.edges: set[tuple[str, str]] = set()
        self.features: dict[str, np.ndarray] = {}
        self.ttl = edge_ttl
        self.T: float | None = None
        self.edge_time: dict[tuple[str, str], float] = {}
        self.first: dict[str, float] = {}
        self.late = 0
        self.expired = 0
        self._times: list[tuple[float, tuple[str, str]]] = []  # a heap of (t(e), e), stale entries skipped

    def _name(self, node: str, ts: float) -> None:
        if node not in self.nodes:
            self.nodes.add(node)
            self.first[node] = ts
        else:
            self.first[node] = min(self.first[node], ts)

    def _tick(self, ts: float) -> None:
        self.T = ts if self.T is None else max(self.T, ts)
        while self.ttl and self._times and self._times[0][0] <= self.T - self.ttl:
            t, e = heapq.heappop(self._times)
            if e in self.edges and self.edge_time[e] == t:  # the edge's present time: it falls out
                self.edges.discard(e)
                del self.edge_time[e]
                self.expired += 1

    def edge_upsert(self, src: str, dst: str, ts: float = 0) -> None:
        self._name(src, ts)
        self._name(dst, ts)
        if self.ttl and self.T is not None and ts <= self.T - self.ttl:
            self.late += 1
        else:
            self.edge_time[(src, dst)] = t = max(ts, self.edge_time.get((src, dst), ts))
            self.edges.add((src, dst))
            if self.ttl:
                heapq.heappush(self._times, (t, (src, dst)))
        self._tick(ts)

    def edge_delete(self, src: str, dst: str, ts: float = 0) -> None:
        self.edges.discard((src, dst))
        self.edge_time.pop((src, dst), None)
        self._tick(ts)

    def node_upsert(self, node: str, features: Iterable[float], ts: float = 0) -> None:
        self._name(node, ts)
        self.features[node] = np.asarray(list(features), dtype=np.float32)
        self._tick(ts)

    def node_delete(self, node: str, ts: float = 0) -> None:
        self.nodes.discard(node)
        self.features.pop(node, None)
        self.first.pop(node, None)
        self.edges = {(s, d) for s, d in self.edges if s != node and d != node}
        self.edge_time = {e: t for e, t in self.edge_time.items() if e in self.edges}
        self._tick(ts)

    def ages(self) -> dict[str, float]:
        """``age(v) = T - first(v)`` of every node."""
        return {v: self.T - self.first[v] for v in self.nodes}

    def apply_obj(self, ev: Mapping[str, Any]) -> None:
        """Apply one event given as a JSON object (the JSONL schema)."""
        op, ts = ev["op"], ev.get("ts", 0)
        if op == "edge_upsert":
            self.edge_upsert(_id(ev["src"]), _id(ev["dst"]), ts)
        elif op == "edge_delete":
            self.edge_delete(_id(ev["src"]), _id(ev["dst"]), ts)
        elif op == "node_upsert":
            self.node_upsert(_id(ev["id"]), ev["features"], ts)
        elif op == "node_delete":
            self.node_delete(_id(ev["id"]), ts)
        else:
            raise ValueError(f"unknown op {op!r}")

    def apply_event(self, ev: Any) -> None:
        """Apply one event object with an ``op`` attribute (``stream.events`` dataclasses)."""
        op = ev.op
        if op == "edge_upsert":
            self.edge_upsert(ev.src, ev.dst, ev.ts)
        elif op == "edge_delete":
            self.edge_delete(ev.src, ev.dst, ev.ts)
        elif op == "node_upsert":
            self.node_upsert(ev.id, ev.features, ev.ts)
        elif op == "node_delete":
            self.node_delete(ev.id, ev.ts)
        else:
            raise ValueError(f"unknown op {op!r}")


def _id(value: Any) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def fold_jsonl(path: str | Path, limit: int | None = None, edge_ttl: float = 0) -> GraphFold:
    """Fold (the first ``limit`` lines of) a JSONL event file."""
    fold = GraphFold(edge_ttl)
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
                     uses_neighbours: Any = None, stages: Mapping[str, str] | None = None) -> list[torch.Tensor]:
    """One ``[2, E]`` edge list ``u -> v`` (``u`` sampled by ``v`` at that layer) per layer over ``order``'s indices.

    ``uses_neighbours(degree)`` False means the node aggregates nothing (cold-start policy); ``stages`` (the
    staged policy) names each node's stage: ``feature_only`` samples nothing, ``expanded`` samples the
    bottom-k of ``X_k(v) = (N(v) ∪ ⋃_{u ∈ N(v)} S_k(u)) \\ {v}``, ``full`` samples ``S_k(v)``.
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
            stage = "full" if stages is None else stages[v]
            if stage == "feature_only":
                continue
            if stage == "expanded":
                pool = set(nbrs[v]).union(*(ranked[u][:k] for u in nbrs[v])) - {v}
                sample = bottom_k(seed, v, pool, k)
            else:
                sample = ranked[v][:k]
            for u in sample:
                src.append(index[u])
                dst.append(index[v])
        out.append(torch.tensor([src, dst], dtype=torch.long).reshape(2, -1))
    return out


def staged_stages(cfg: Mapping[str, Any], nbrs: Mapping[str, set[str]], ages: Mapping[str, float]) -> dict[str, str] | None:
    """Each node's stage under a ``staged`` cold-start policy (None for another policy)."""
    policy = cfg.get("cold_start") or {}
    if policy.get("policy") != "staged":
        return None
    f, e, m = policy["feature_only_s"], policy["expand_s"], policy["min_neighbours"]
    out = {}
    for v, n in nbrs.items():
        age = ages[v]
        out[v] = "feature_only" if age < f else "expanded" if age < e and len(n) < m else "full"
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
    if policy.get("policy", "plain") in ("plain", "staged"):
        return None
    if policy["policy"] == "feature_only":
        m = int(policy.get("min_neighbours", 1))
        return lambda degree: degree >= m
    raise ValueError(f"reference does not know cold_start policy {policy!r}")


def reference_embeddings(nodes: Iterable[str], edges: Iterable[tuple[str, str]],
                         features: Mapping[str, Any], model_dir: str | Path,
                         seed: int | None = None, ages: Mapping[str, float] | None = None) -> dict[str, np.ndarray]:
    """Every existing node's final embedding, computed from scratch with PyG.

    Args:
        nodes: every existing node (isolated ones included).
        edges: the present directed edges ``(src, dst)``.
        features: ``h^0`` of the nodes that have features (others get zeros).
        model_dir: a model directory (``config.json`` + ``weights.pt``).
        seed: the sampling seed (default: the model's).
        ages: ``age(v)`` of every node, for a staged cold-start policy.
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
    stages = staged_stages(cfg, nbrs, ages) if ages is not None else None
    edge_lists = layer_edge_lists(order, nbrs, seed, cfg["fanouts"], _uses_neighbours(cfg), stages)
    last = len(net.convs) - 1
    with torch.no_grad():
        for l, conv in enumerate(net.convs):
            x = conv(x, edge_lists[l])
            if l < last:
                x = x.relu()
    return {v: x[i].numpy().astype(np.float64) for i, v in enumerate(order)}


def fold_embeddings(fold: GraphFold, model_dir: str | Path) -> dict[str, np.ndarray]:
    """:func:`reference_embeddings` of a folded graph at its stream time (ages included)."""
    ages = fold.ages() if fold.T is not None else {v: 0.0 for v in fold.nodes}
    return reference_embeddings(fold.nodes, fold.edges, fold.features, model_dir, ages=ages)


def expected_modes(fold: GraphFold, model_dir: str | Path) -> dict[str, str]:
    """The ``mode`` each node's embedding should be published with."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    uses = _uses_neighbours(cfg)
    nbrs = neighbourhoods(fold.nodes, fold.edges)
    stages = staged_stages(cfg, nbrs, fold.ages() if fold.T is not None else {v: 0.0 for v in fold.nodes})
    out = {}
    for v in fold.nodes:
        if stages is not None:
            out[v] = stages[v] if v in fold.features else "cold_start"
            continue
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
