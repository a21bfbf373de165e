"""Shared helpers of the benchmarks: a seeded synthetic power-law graph, a fast
loader into a :class:`GraphStore`, peak-RSS and progress reporting.

The graph is a directed Chung-Lu graph: node ``i`` gets an out-weight and an
in-weight drawn (through two independent permutations) from the power-law
sequence ``w_j = (j + 1) ** (-1 / (gamma - 1))``; each directed edge picks its
source with probability proportional to the out-weights and its destination
proportional to the in-weights. Self-loops and duplicate directed edges are
dropped and generation continues until exactly ``edges`` distinct directed
edges exist, so the expected degree sequence has a power-law tail of exponent
``gamma`` (hubs of several thousand neighbours at 2^17 nodes / 1.2 M edges).
The same arguments give the same graph on any machine (numpy PCG64).

Node ``i`` is named ``str(i)``. Everything here prints progress on stderr
only; the benchmarks print one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.events import EdgeDelete, EdgeUpsert, NodeUpsert

__all__ = [
    "close_run",
    "FULL_NODES",
    "FULL_EDGES",
    "FEATURE_DIM",
    "SyntheticGraph",
    "make_graph",
    "load_graph",
    "open_loaded_store",
    "Progress",
    "log",
    "peak_rss_mib",
    "current_rss_mib",
    "emit",
    "percentile",
    "machine_load",
    "code_fingerprint",
    "GcTimer",
    "CpuSampler",
    "EdgeDelete",
    "EdgeUpsert",
    "NodeUpsert",
]

FULL_NODES = 1 << 17
FULL_EDGES = 1_200_000
FEATURE_DIM = 128
_T0 = time.perf_counter()


# ---------------------------------------------------------------------- reporting
def log(msg: str) -> None:
    """One progress line on stderr, stamped with seconds since the bench started."""
    print(f"[{time.perf_counter() - _T0:8.1f}s] {msg}", file=sys.stderr, flush=True)


class Progress:
    """A throttled ``label: done/total (rate/s)`` line on stderr."""

    def __init__(self, label: str, total: int | None = None, unit: str = "ev", every: float = 5.0):
        self.label, self.total, self.unit, self.every = label, total, unit, every
        self.done = 0
        self.start = self._last = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self._last >= self.every:
            self._last = now
            self._print(now)

    def close(self) -> None:
        self._print(time.perf_counter())

    def _print(self, now: float) -> None:
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        total = f"/{self.total}" if self.total is not None else ""
        log(f"{self.label}: {self.done}{total} {self.unit} ({rate:,.0f} {self.unit}/s, {elapsed:.1f}s)")


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (MiB; ru_maxrss is KiB on Linux)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)


def current_rss_mib() -> float:
    """Current resident set size (MiB), from /proc/self/statm; 0 where unavailable."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def machine_load() -> dict[str, Any]:
    """1/5/15-minute load averages and CPU count: other processes on the machine inflate wall times."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        one = five = fifteen = -1.0
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "loadavg_15m": round(fifteen, 2),
            "cpus": os.cpu_count()}


# ---------------------------------------------------------------------- where the CPU goes
def _ticks_by_role(extra: dict[int, str]) -> dict[str, int]:
    """CPU ticks (user + system) so far of this process and its children, by role.

    Roles: ``worker`` (this process: the benches run the worker in it), the
    ``delivery process``, the ``query server``, the ``broker``, any other
    Python child (``event producer``), and the pids named in ``extra``.
    """
    me = os.getpid()
    out: dict[str, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            continue
        if pid != me and int(fields[1]) != me:
            continue
        role = ("worker" if pid == me else extra.get(pid) or
                ("delivery process" if b"gnnstream.stream.delivery" in cmd else "query server" if b"gnnstream.workers.query.server" in cmd
                 else "broker" if b"tansu" in cmd else "event producer" if b"multiprocessing" in cmd else None))
        if role:
            out[role] = out.get(role, 0) + int(fields[11]) + int(fields[12])
    return out


class CpuSampler:
    """Per-role CPU of a bench's processes (see ``_ticks_by_role``), sampled every ``every`` seconds
    in a thread; ``roles`` names further child pids, and may be filled in while it runs."""

    def __init__(self, every: float = 0.5):
        self.every = every
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.mark()
            self._stop.wait(self.every)

    def mark(self) -> float:
        """Take a sample now (from any thread); returns its time, the edge of a window for ``cores``."""
        ticks = _ticks_by_role(self.roles)
        now = time.time()
        self.samples.append((now, ticks))
        return now

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def cores(self, start: float, end: float) -> dict[str, float]:
        """Cores used by each role (and ``total``) between the samples nearest inside ``[start, end]``
        (``time.time()``); empty when fewer than two samples fall inside."""
        inside = sorted((t, ticks) for t, ticks in self.samples if start <= t <= end)
        if len(inside) < 2:
            return {}
        (t0, a), (t1, b) = inside[0], inside[-1]
        hz = os.sysconf("SC_CLK_TCK")
        cores = {role: round((b.get(role, 0) - a.get(role, 0)) / hz / (t1 - t0), 3) for role in sorted(b)}
        cores["total"] = round(sum(cores.values()), 3)
        return cores


class GcTimer:
    """Wall time spent in the cyclic garbage collector while active (via ``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._start = 0.0

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections[info.get("generation", 0)] += 1

    def __enter__(self) -> "GcTimer":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)


def code_fingerprint() -> dict[str, Any]:
    """What code was measured: git HEAD, locally modified files, and hashes of the hot sources.

    Other people edit the engine and store while benchmarks run; this makes two
    results comparable (or not).
    """
    out: dict[str, Any] = {}
    try:
        out["git_head"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                         text=True, timeout=10).stdout.strip() or None
        status = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout
        out["modified_files"] = sorted(line[3:] for line in status.splitlines() if line.strip())
    except (OSError, subprocess.SubprocessError):
        out["git_head"] = None
    hashes = {}
    for rel in ("graph_state", "workers/engine", "model"):  # the code the engine's numbers depend on
        digest = hashlib.sha256()
        for path in sorted((ROOT / rel).glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        hashes[rel] = digest.hexdigest()[:12]
    out["sha256_12"] = hashes
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100, linear interpolation) of ``values``; 0 for none."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else 0.0


def emit(result: dict[str, Any]) -> None:
    """Print the benchmark's one JSON object on stdout."""
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------- the graph
@dataclass
class SyntheticGraph:
    """A directed power-law graph with node features.

    Attributes:
        num_nodes: ``N``; node ``i`` is named ``str(i)``.
        src, dst: the distinct directed edges (int64, no self-loops), in generation order.
        features: ``[N, dim]`` float32 node features.
        out_cdf, in_cdf: cumulative endpoint probabilities (for drawing more
            power-law-distributed endpoints, e.g. for streamed events).
        gamma, seed: the generator's parameters.
    """

    num_nodes: int
    src: np.ndarray
    dst: np.ndarray
    features: np.ndarray
    out_cdf: np.ndarray
    in_cdf: np.ndarray
    gamma: float
    seed: int

    @property
    def num_edges(self) -> int:
        return int(len(self.src))

    @staticmethod
    def name(i: int) -> str:
        return str(i)

    def draw_endpoints(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` (src, dst) pairs from the generator's power-law distribution (self-loops possible)."""
        src = np.minimum(np.searchsorted(self.out_cdf, rng.random(n), side="right"), self.num_nodes - 1)
        dst = np.minimum(np.searchsorted(self.in_cdf, rng.random(n), side="right"), self.num_nodes - 1)
        return src.astype(np.int64), dst.astype(np.int64)

    def undirected_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct neighbour pairs ``(a, b)``, ``a < b``: ``N(v)`` of docs/design.md collapsed."""
        a = np.minimum(self.src, self.dst)
        b = np.maximum(self.src, self.dst)
        keep = a != b
        codes = np.unique(a[keep] * self.num_nodes + b[keep])
        return codes // self.num_nodes, codes % self.num_nodes

    def degrees(self) -> np.ndarray:
        """``|N(v)|`` of every node (both directions, duplicates collapsed)."""
        a, b = self.undirected_pairs()
        return np.bincount(np.concatenate([a, b]), minlength=self.num_nodes)

    def stats(self) -> dict[str, Any]:
        deg = self.degrees()
        return {
            "nodes": self.num_nodes,
            "directed_edges": self.num_edges,
            "neighbour_pairs": int(deg.sum() // 2),
            "reciprocal_edge_pairs": int(self.num_edges - deg.sum() // 2),
            "feature_dim": int(self.features.shape[1]),
            "gamma": self.gamma,
            "seed": self.seed,
            "degree_max": int(deg.max()) if len(deg) else 0,
            "degree_mean": round(float(deg.mean()), 3) if len(deg) else 0.0,
            "degree_p50": float(np.percentile(deg, 50)) if len(deg) else 0.0,
            "degree_p99": float(np.percentile(deg, 99)) if len(deg) else 0.0,
            "isolated_nodes": int((deg == 0).sum()),
        }


def add_graph_args(p: argparse.ArgumentParser, *, seed_help: str, stores: str) -> None:
    """The synthetic-graph, store and run options shared by ``bench/backfill.py`` and ``bench/engine.py``.

    Args:
        seed_help: what ``--seed`` seeds.
        stores: "store" or "stores", for the help texts.
    """
    p.add_argument("--nodes", type=int, default=FULL_NODES, help="number of nodes")
    p.add_argument("--edges", type=int, default=FULL_EDGES, help="distinct directed edges")
    p.add_argument("--dim", type=int, default=FEATURE_DIM, help="feature / hidden / output dim")
    p.add_argument("--gamma", type=float, default=2.5, help="power-law exponent")
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--load-batch", type=int, default=10_000, help="events per store.apply while loading")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--workdir", default=None, help=f"directory for the temporary {stores} (default: system temp)")
    p.add_argument("--keep", action="store_true", help=f"keep the {stores} and model directory")
    p.add_argument("--store-cache", default=None,
                   help="directory keeping a loaded copy of the graph store; later runs copy it instead of loading")


def make_graph(nodes: int = FULL_NODES, edges: int = FULL_EDGES, *, dim: int = FEATURE_DIM,
               gamma: float = 2.5, seed: int = 0) -> SyntheticGraph:
    """Generate a seeded directed Chung-Lu power-law graph with ``edges`` distinct directed edges.

    Args:
        nodes: number of nodes (every one gets features, even if isolated).
        edges: number of distinct directed edges (self-loops excluded).
        dim: feature dimension; features are standard normal float32.
        gamma: power-law exponent of the expected degree distribution (> 2).
        seed: the numpy seed.
    """
    if nodes < 2 or edges < 0 or edges > nodes * (nodes - 1) // 4:
        raise ValueError(f"Expected at least 2 nodes and at most N(N-1)/4 edges (got {nodes}, {edges})")
    if gamma <= 2.0:
        raise ValueError(f"Expected gamma > 2 (got {gamma})")
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    base = (np.arange(nodes, dtype=np.float64) + 1.0) ** (-1.0 / (gamma - 1.0))
    out_w = base[rng.permutation(nodes)]
    in_w = base[rng.permutation(nodes)]
    out_cdf = np.cumsum(out_w) / out_w.sum()
    in_cdf = np.cumsum(in_w) / in_w.sum()
    graph = SyntheticGraph(nodes, np.zeros(0, np.int64), np.zeros(0, np.int64),
                           np.zeros((0, dim), np.float32), out_cdf, in_cdf, gamma, seed)
    codes = np.zeros(0, dtype=np.int64)
    order = np.zeros(0, dtype=np.int64)
    drawn = 0
    while len(codes) < edges:
        want = int((edges - len(codes)) * 1.15) + 1024
        s, d = graph.draw_endpoints(rng, want)
        keep = s != d
        new = s[keep] * nodes + d[keep]
        allc = np.concatenate([codes, new])
        allo = np.concatenate([order, drawn + np.arange(len(new), dtype=np.int64)])
        drawn += len(new)
        codes, first = np.unique(allc, return_index=True)  # keeps the first draw of each edge
        order = allo[first]
    keep_idx = np.argsort(order, kind="stable")[:edges]  # generation order, first `edges` distinct
    codes = codes[keep_idx]
    graph.src = codes // nodes
    graph.dst = codes % nodes
    graph.features = rng.standard_normal((nodes, dim), dtype=np.float32)
    log(f"generated power-law graph: {nodes} nodes, {edges} directed edges, gamma={gamma} "
        f"({time.perf_counter() - t0:.1f}s)")
    return graph


# ---------------------------------------------------------------------- loading
def graph_events(graph: SyntheticGraph, batch: int = 10_000, ts0: int = 1_700_000_000,
                 edge_seconds: bool = False) -> Iterator[list[Any]]:
    """The graph as event batches: a ``node_upsert`` per node, then an ``edge_upsert`` per edge (a second apart
    with ``edge_seconds``, else a second per batch)."""
    name = graph.name
    ts = ts0
    for start in range(0, graph.num_nodes, batch):
        rows = graph.features[start:start + batch].tolist()
        yield [NodeUpsert(name(start + i), ts, tuple(row)) for i, row in enumerate(rows)]
    ts += 1
    src, dst = graph.src.tolist(), graph.dst.tolist()
    for start in range(0, len(src), batch):
        yield [EdgeUpsert(name(s), name(d), ts + (start + i if edge_seconds else (start + i) // batch), 1.0)
               for i, (s, d) in enumerate(zip(src[start:start + batch], dst[start:start + batch]))]


def bulk_load_graph(store: GraphStore, graph: SyntheticGraph, fanouts: tuple[int, ...] = (),
                    ts0: int = 1_700_000_000, workers: int | None = None) -> dict[str, Any]:
    """Load the whole graph into the empty ``store`` as table files (:class:`gnnstream.graph_state.bulk.BulkLoad`
    with ``workers`` processes, default one per core): the events of :func:`graph_events` as columns, with the
    sampled-by index of ``fanouts``.

    Returns:
        ``seconds``, ``cpu_seconds`` (this process), ``edges_per_second`` (directed edges over the whole load),
        ``workers``, ``worker_cpu_seconds`` and ``worker_peak_rss_mib`` (the forked workers: CPU together, the
        largest peak, counting the pages they share with this process), the load's counts.
    """
    from gnnstream.graph_state.bulk import BulkLoad
    t0, c0 = time.perf_counter(), time.process_time()
    w0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = BulkLoad(store, fanouts=fanouts, workers=workers)
    names = [graph.name(i) for i in range(graph.num_nodes)]
    load.add_nodes(names, np.full(graph.num_nodes, ts0), graph.features)
    ts = ts0 + 1 + np.arange(graph.num_edges) // 10_000
    load.add_edges(list(map(names.__getitem__, graph.src.tolist())), list(map(names.__getitem__, graph.dst.tolist())),
                   np.ones(graph.num_edges), ts)
    counts = load.finish(progress=lambda step: log(f"bulk load: {step} ({time.perf_counter() - t0:.1f}s)"))
    seconds = time.perf_counter() - t0
    w1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"seconds": round(seconds, 3), "cpu_seconds": round(time.process_time() - c0, 3),
            "edges_per_second": round(graph.num_edges / seconds, 1), "bulk": True, "workers": load.workers,
            "worker_cpu_seconds": round(w1.ru_utime + w1.ru_stime - w0.ru_utime - w0.ru_stime, 3),
            "worker_peak_rss_mib": round(w1.ru_maxrss / 1024.0, 1), **counts}


def load_graph(store: GraphStore, graph: SyntheticGraph, *, batch: int = 10_000,
               edge_seconds: bool = False) -> dict[str, float]:
    """Apply the whole graph to ``store`` through :meth:`GraphStore.apply` in batches.

    Returns:
        ``seconds`` (total wall), ``cpu_seconds`` (this process), ``apply_node_seconds``
        and ``apply_edge_seconds`` (time inside ``apply`` for the feature and the
        edge batches), ``gc_seconds`` (cyclic GC pauses), ``events``.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    bar = Progress("load", graph.num_nodes + graph.num_edges)
    node_s = edge_s = 0.0
    events = 0
    with GcTimer() as gct:
        for chunk in graph_events(graph, batch, edge_seconds=edge_seconds):
            t = time.perf_counter()
            store.apply(chunk)
            dt = time.perf_counter() - t
            if chunk and chunk[0].op == "node_upsert":
                node_s += dt
            else:
                edge_s += dt
            events += len(chunk)
            bar.update(len(chunk))
    bar.close()
    seconds = time.perf_counter() - t0
    return {"seconds": round(seconds, 3), "cpu_seconds": round(time.process_time() - c0, 3),
            "apply_node_seconds": round(node_s, 3), "apply_edge_seconds": round(edge_s, 3),
            "gc_seconds": round(gct.seconds, 3), "gc_collections_by_generation": gct.collections,
            "events": events, "events_per_second": round(events / seconds, 1) if seconds else None}


def _store_code_hash() -> str:
    """Hash of the store's source: a cached store is only reused by the code that wrote it."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "graph_state").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def open_loaded_store(path: str | os.PathLike[str], graph: SyntheticGraph, *, dim: int, batch: int = 10_000,
                      cache_dir: str | os.PathLike[str] | None = None,
                      bulk_fanouts: tuple[int, ...] | None = None, bulk_workers: int | None = None,
                      edge_ttl: int | None = None) -> tuple[GraphStore, dict[str, Any]]:
    """A store at ``path`` holding ``graph``, closed after loading and reopened.

    With ``edge_ttl`` (0: no window) the store is created with that edge window and the edges are loaded a
    second of event time apart (:func:`graph_events` with ``edge_seconds``), so that a window expires them
    one by one as stream time moves on.

    The store is loaded through :func:`load_graph` (with ``bulk_fanouts``, through
    :func:`bulk_load_graph` with those fanouts and ``bulk_workers``), closed, and opened again, as
    ``gnnstream graph load`` followed by another command would: whatever comes
    next (engine, backfill) starts with cold in-memory caches. With
    ``cache_dir`` a loaded copy is kept there (keyed by the graph parameters and
    a hash of ``graph_state/*.py``) and later runs copy it instead of loading;
    the returned stats then say ``from_cache`` and repeat the original load's
    numbers.
    """
    path = Path(path)
    key = (f"graph-n{graph.num_nodes}-e{graph.num_edges}-g{graph.gamma}-s{graph.seed}-d{dim}"
           f"-b{'bulk' + '.'.join(map(str, bulk_fanouts)) if bulk_fanouts is not None else batch}"
           f"{'' if edge_ttl is None else f'-ttl{edge_ttl}'}-{_store_code_hash()}")
    cached = Path(cache_dir) / key if cache_dir else None
    if cached is not None and (cached / "load.json").exists():
        t = time.perf_counter()
        shutil.copytree(cached / "state", path)
        info = json.loads((cached / "load.json").read_text())
        info.update(from_cache=True, cache=str(cached), copy_seconds=round(time.perf_counter() - t, 3))
        log(f"copied the loaded store from {cached} ({info['copy_seconds']}s)")
    else:
        store = GraphStore(path, seed=0, feature_dim=dim, edge_ttl=edge_ttl)
        try:
            info = load_graph(store, graph, batch=batch, edge_seconds=edge_ttl is not None) if bulk_fanouts is None else \
                bulk_load_graph(store, graph, bulk_fanouts, workers=bulk_workers)
        finally:
            store.close()
        info["from_cache"] = False
        if cached is not None:
            tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(path, tmp / "state")
            (tmp / "load.json").write_text(json.dumps(info))
            shutil.rmtree(cached, ignore_errors=True)
            os.replace(tmp, cached)
            log(f"cached the loaded store in {cached}")
    t = time.perf_counter()
    store = GraphStore(path, seed=0, feature_dim=dim)
    info["reopen_seconds"] = round(time.perf_counter() - t, 3)
    return store, info


def model_dir(path: str | os.PathLike[str], *, dim: int = FEATURE_DIM, fanouts: Sequence[int] = (25, 10),
              seed: int = 0) -> Any:
    """The benchmark model: 2-layer GraphSAGE-mean, ``dim`` everywhere, PyG-compatible weights."""
    from gnnstream.model.directory import init_model_dir, load_model_dir

    init_model_dir(path, arch="sage", in_dim=dim, hidden=dim, out_dim=dim, layers=len(fanouts),
                   fanouts=list(fanouts), seed=seed, overwrite=True)
    return load_model_dir(path)


def close_run(result: dict, work: Path, keep: bool) -> None:
    """Record peak memory and load, then keep or remove the scratch directory."""
    result["peak_rss_mib"] = peak_rss_mib()
    result["machine_load_at_end"] = machine_load()
    if keep:
        log(f"kept {work}")
        result["workdir"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
