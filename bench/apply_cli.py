"""The command line against the engine: ``gnnstream apply``, run as a new user runs it, beside the engine alone.

The graph is a seeded R-MAT graph: each edge picks one quadrant of the
adjacency matrix per level (a, b, c, d = 0.57, 0.19, 0.19, 0.05) for
``--scale`` levels, node labels are shuffled, self-loops and repeated edges
are dropped; ``--edge-factor`` times 2^scale edges are drawn (about 585,000
distinct directed edges at 2^16). Features are 32-d standard normal. It is
written to an events file (``node_upsert`` of every node, then
``edge_upsert`` of every edge), loaded with ``gnnstream graph load --model``
into a state and embedded with ``gnnstream backfill``; the model comes from
``gnnstream model init --arch sage --in-dim 32 --hidden 128 --out-dim 128
--fanouts 25,10``. A stream file holds ``--events`` more events, drawn as
``bench/engine.py`` draws them (90 % edge upserts between R-MAT endpoints, 5 %
deletes of existing edges, 5 % new features).

Each measurement runs on a fresh copy of that state, in a process of its own:

(a) ``gnnstream apply --batch B`` of the stream file: whole-process wall time
    and CPU (``getrusage`` of the children), start-up and exit included, and
    the seconds by phase of its JSON summary; once with ``--batch``, once
    with ``--big-batch``;
(b) the engine alone as ``bench/engine.py`` streams: store and engine opened,
    one backfill (which fills the caches), heap frozen, then ``store.apply``
    + ``engine.recompute`` in batches of ``--batch`` on the same events
    (decoded before the clock starts); updates/s over the batches alone;
(c) the same without the backfill: the engine starts on the freshly opened
    state, as ``apply`` does, and its caches fill during the first batches;
(d) unless ``--no-shape``, (b) on ``bench/engine.py``'s Chung-Lu power-law
    graph with as many nodes and edges: what the R-MAT shape costs.

(a), (b) and (c) run ``--repeat`` times, interleaved, so that each sees the
machine as the others do. Also measured: the interpreter and imports alone,
and reading and decoding the stream file alone (``decode_event_json`` per
line). Reported: updates/s of each run and the median run's details, the
ratio (a) / (b) of each pair and their median, the same per CPU second, and
where (a)'s wall time goes.

``--cold`` measures instead whether ``apply`` keeps its pace as the graph
grows: two graphs of the same edge factor, 2^``--small-scale`` and
2^``--large-scale`` nodes, and ``--cold-events`` streamed events each; every
run applies them with ``gnnstream apply`` to a fresh copy of the state,
whole process. Page cache ``cold``: the copy's files are dropped from the OS
page cache first (``posix_fadvise DONTNEED``); ``warm``: they are read
first. Reported per mode: updates/s of each size and large / small (per pair
of runs and their median, and per CPU second). ``--cold-graph chung-lu`` draws
both graphs with ``bench.common.make_graph`` instead, as ``bench/scale.py``
does (the seeded Chung-Lu power law of ``bench/engine.py``; here
``--edge-factor`` times 2^scale distinct directed edges and 32-d features),
where an event changes about as many rows at both sizes.

Prints one JSON object on stdout; progress goes to stderr.

    python -m bench.apply_cli                                         # 2^16, 100,000 events
    python -m bench.apply_cli --cold                                  # 2^14 and 2^17, 30,000 events
    python -m bench.apply_cli --cold --small-scale 17 --large-scale 20   # the acceptance sizes
    python -m bench.apply_cli --cold --small-scale 17 --large-scale 20 --cold-graph chung-lu
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (ROOT, SyntheticGraph, close_run, code_fingerprint, emit, graph_events, log, machine_load,
                          make_graph, open_loaded_store)
from bench.engine import BatchLog, _profile_report, run_batch, start_engine, stream_events
from gnnstream.stream.events import decode_event_json, encode_event

FANOUTS = (25, 10)
DIM = 32
HIDDEN = 128
RMAT = (0.57, 0.19, 0.19)  # a, b, c; d = 0.05
TARGET_RATIO = 0.7  # apply's whole-process updates/s over the engine bench's
TARGET_COLD_RATIO = 0.67  # large over small
GNNSTREAM = Path(sys.executable).with_name("gnnstream")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--scale", type=int, default=16, help="log2 of the nodes of the R-MAT graph")
    p.add_argument("--edge-factor", type=float, default=9.55, help="edges drawn per node (before dropping repeats)")
    p.add_argument("--events", type=int, default=100_000, help="streamed events")
    p.add_argument("--batch", type=int, default=1_000, help="events per batch (apply --batch and the engine's)")
    p.add_argument("--big-batch", type=int, default=5_000, help="apply --batch of the second apply run (0: none)")
    p.add_argument("--repeat", type=int, default=2, help="runs of (a), (b) and (c) each, interleaved (medians)")
    p.add_argument("--no-shape", action="store_true", help="skip the engine alone on the Chung-Lu graph")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the batches of the engine alone, cold; top functions on stderr")
    p.add_argument("--cold", action="store_true", help="measure apply at two graph sizes instead (see above)")
    p.add_argument("--small-scale", type=int, default=14, help="--cold: log2 of the small graph's nodes")
    p.add_argument("--large-scale", type=int, default=17, help="--cold: log2 of the large graph's nodes")
    p.add_argument("--cold-events", type=int, default=30_000, help="--cold: streamed events per size")
    p.add_argument("--cold-graph", choices=("rmat", "chung-lu"), default="rmat",
                   help="--cold: the graphs' kind (chung-lu: bench/scale.py's)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads of every measured process (OMP_NUM_THREADS; 0 = torch's default): 1 keeps "
                        "the comparison steadier on a machine others load")
    p.add_argument("--seed", type=int, default=0, help="graph and event seed")
    p.add_argument("--workdir", default=None, help="directory for the temporary states (default: system temp)")
    p.add_argument("--keep", action="store_true", help="keep the states, files and model directory")
    p.add_argument("--engine-alone", nargs=3, metavar=("STATE", "MODEL", "EVENTS"), help=argparse.SUPPRESS)
    p.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cold_graph != "rmat" and not args.cold:
        p.error("--cold-graph applies to --cold runs only")
    return args


# ---------------------------------------------------------------------- the R-MAT graph
@dataclasses.dataclass
class RMatGraph(SyntheticGraph):
    """A :class:`SyntheticGraph` whose edges, and the stream's endpoints, are R-MAT draws."""

    scale: int = 0
    labels: np.ndarray | None = None  # the shuffle of node labels

    def draw_endpoints(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        a, b, c = RMAT
        src = np.zeros(n, dtype=np.int64)
        dst = np.zeros(n, dtype=np.int64)
        for level in range(self.scale):
            r = rng.random(n)
            src |= (r >= a + b).astype(np.int64) << level
            dst |= (((r >= a) & (r < a + b)) | (r >= a + b + c)).astype(np.int64) << level
        return self.labels[src], self.labels[dst]

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        del out["gamma"]
        return {"kind": "R-MAT", "abcd": [*RMAT, round(1 - sum(RMAT), 6)], **out}


def make_rmat(scale: int, edge_factor: float, *, dim: int = DIM, seed: int = 0) -> RMatGraph:
    """``round(edge_factor * 2^scale)`` R-MAT edges over shuffled labels, without self-loops and repeats
    (the first draw of each edge kept, in draw order), and standard normal features."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    nodes = 1 << scale
    empty = np.zeros(0, dtype=np.int64)
    graph = RMatGraph(nodes, empty, empty, np.zeros((0, dim), np.float32), empty, empty, 0.0, seed,
                      scale=scale, labels=rng.permutation(nodes))
    src, dst = graph.draw_endpoints(rng, round(edge_factor * nodes))
    keep = src != dst
    codes = src[keep] * nodes + dst[keep]
    _, first = np.unique(codes, return_index=True)
    codes = codes[np.sort(first)]
    graph.src, graph.dst = codes // nodes, codes % nodes
    graph.features = rng.standard_normal((nodes, dim), dtype=np.float32)
    log(f"generated R-MAT graph: {nodes} nodes, {graph.num_edges} directed edges ({time.perf_counter() - t0:.1f}s)")
    return graph


def cold_graph(kind: str, scale: int, edge_factor: float, seed: int) -> SyntheticGraph:
    """A ``--cold`` graph of 2^``scale`` nodes: ``kind`` ``rmat`` (:func:`make_rmat`) or ``chung-lu``
    (``bench.common.make_graph``, ``round(edge_factor * 2^scale)`` distinct directed edges)."""
    if kind == "rmat":
        return make_rmat(scale, edge_factor, seed=seed)
    return make_graph(1 << scale, round(edge_factor * (1 << scale)), dim=DIM, seed=seed)


def write_events(path: Path, batches: Any) -> int:
    """Write event batches as JSON lines; returns the number written."""
    count = 0
    with open(path, "wb") as fh:
        for chunk in batches:
            fh.writelines(encode_event(ev) + b"\n" for ev in chunk)
            count += len(chunk)
    return count


# ---------------------------------------------------------------------- processes
def gnnstream(*args: Any, stderr: Path) -> dict[str, Any]:
    """Run the ``gnnstream`` command; its JSON summary with ``wall_seconds`` and ``cpu_seconds`` of the
    whole process (start-up and exit included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    with open(stderr, "ab") as err:
        done = subprocess.run([str(GNNSTREAM), *map(str, args)], stdout=subprocess.PIPE, stderr=err)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"gnnstream {args[0]} failed (exit {done.returncode}); see {stderr}")
    out = json.loads(done.stdout) if done.stdout.strip() else {}
    out["wall_seconds"] = round(wall, 3)
    out["cpu_seconds"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 3)
    return out


def python_child(*args: str) -> dict[str, Any]:
    """Run ``python -m bench.apply_cli ARGS`` (one measurement in a fresh process); its JSON."""
    done = subprocess.run([sys.executable, "-m", "bench.apply_cli", *args], stdout=subprocess.PIPE, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"bench.apply_cli {' '.join(args)} failed (exit {done.returncode})")
    return json.loads(done.stdout)


def imports_seconds(runs: int = 3) -> dict[str, float]:
    """Wall and CPU of an interpreter that imports what ``gnnstream apply`` imports, and exits (the median of
    ``runs``)."""
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import gnnstream.workers.cli, gnnstream.workers.offline.jobs"],
                       check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        walls.append(time.perf_counter() - t)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return {"wall_seconds": round(float(np.median(walls)), 3), "cpu_seconds": round(float(np.median(cpus)), 3)}


def page_cache(state: Path, mode: str) -> None:
    """``cold``: drop the state's files from the OS page cache; ``warm``: read them into it."""
    for path in state.rglob("*"):
        if not path.is_file():
            continue
        if mode == "warm":
            with open(path, "rb") as fh:
                while fh.read(1 << 24):
                    pass
        else:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---------------------------------------------------------------------- building a state
def build(work: Path, graph: SyntheticGraph, events: int, batch: int, seed: int, name: str) -> dict[str, Any]:
    """Events files, model directory and state of ``graph`` (through the command line), and the stream file."""
    base = work / name
    base.mkdir()
    model, state = base / "model", base / "state"
    log(f"{name}: writing the graph and {events} stream events")
    t = time.perf_counter()
    lines = write_events(base / "graph.jsonl", graph_events(graph))
    stream, counts = stream_events(graph, events, np.random.default_rng(seed + 1), 0.90, 0.05, 1_750_000_000, batch)
    write_events(base / "stream.jsonl", [stream])
    info: dict[str, Any] = {"graph": graph.stats(), "graph_lines": lines, "event_counts": counts,
                            "write_seconds": round(time.perf_counter() - t, 3)}
    err = base / "stderr.log"
    gnnstream("model", "init", model, "--arch", "sage", "--in-dim", DIM, "--hidden", HIDDEN, "--out-dim", HIDDEN,
              "--fanouts", ",".join(map(str, FANOUTS)), "--seed", 0, stderr=err)
    log(f"{name}: gnnstream graph load")
    info["graph_load"] = gnnstream("graph", "load", "--state", state, "--model", model, base / "graph.jsonl",
                                   stderr=err)
    log(f"{name}: gnnstream backfill")
    info["backfill"] = gnnstream("backfill", "--state", state, "--model", model, stderr=err)
    return info


def fresh_copy(work: Path, name: str, run: str) -> Path:
    copy = work / name / f"run-{run}"
    shutil.copytree(work / name / "state", copy)
    return copy


# ---------------------------------------------------------------------- the engine alone
def engine_alone(state: str, model: str, events_path: str, batch: int, warm: bool,
                 profile: bool) -> dict[str, Any]:
    """(b) with ``warm``, else (c): the stream's batches through ``store.apply`` + ``engine.recompute`` in this
    process (the ``--engine-alone`` child)."""
    from gnnstream.graph_state.store import GraphStore
    from gnnstream.model import load_model_dir
    from gnnstream.workers.heap import tune_collector

    tune_collector()  # as the gnnstream command does
    with open(events_path, "rb") as fh:
        events = [decode_event_json(line) for line in fh]
    t = time.perf_counter()
    store = GraphStore(state)
    try:
        engine, setup = start_engine(store, load_model_dir(model), backfills=1 if warm else 0)
        setup["start_seconds"] = round(time.perf_counter() - t, 3)
        stream = BatchLog(engine.num_layers)
        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        for start in range(0, len(events), batch):
            run_batch(store, engine, events[start:start + batch], stream)
        if prof:
            prof.disable()
        _profile_report(prof, f"engine alone, {'warm' if warm else 'cold'}")
        out = {"setup": setup, **stream.summary(), "pending_after": engine.pending()}
        first = sum(stream.latencies[:10])  # while the caches fill, if they are cold
        out["first_10_batches_seconds"] = round(first, 3)
        out["first_10_batches_over_median"] = round(first / (10 * float(np.median(stream.latencies))), 2)
        return out
    finally:
        store.close()


def shape_run(work: Path, graph: RMatGraph, args: argparse.Namespace) -> dict[str, Any]:
    """(d): the engine alone, warm, on the engine bench's kind of graph with as many nodes and edges."""
    other = make_graph(graph.num_nodes, graph.num_edges, dim=DIM, seed=args.seed)
    base = work / "chung-lu"
    base.mkdir()
    stream, counts = stream_events(other, args.events, np.random.default_rng(args.seed + 1), 0.90, 0.05,
                                   1_750_000_000, args.batch)
    write_events(base / "stream.jsonl", [stream])
    store, load = open_loaded_store(base / "state", other, dim=DIM, bulk_fanouts=FANOUTS)
    store.close()
    out = python_child("--engine-alone", str(base / "state"), str(work / "rmat" / "model"),
                       str(base / "stream.jsonl"), "--batch", str(args.batch), "--warm")
    return {"graph": other.stats(), "event_counts": counts, "engine_alone_warm": _brief(out)}


# ---------------------------------------------------------------------- the runs
def parse_seconds(path: Path) -> dict[str, Any]:
    """Reading the stream file, and decoding its lines with ``decode_event_json``, alone."""
    t = time.perf_counter()
    with open(path, "rb") as fh:
        lines = fh.readlines()
    read = time.perf_counter() - t
    t = time.perf_counter()
    for line in lines:
        decode_event_json(line)
    decode = time.perf_counter() - t
    return {"read_seconds": round(read, 3), "decode_seconds": round(decode, 3),
            "decode_us_per_event": round(1e6 * decode / len(lines), 2), "bytes": path.stat().st_size}


def apply_run(work: Path, name: str, batch: int, run: str) -> dict[str, Any]:
    state = fresh_copy(work, name, run)
    log(f"{name}: gnnstream apply --batch {batch} ({run})")
    out = gnnstream("apply", "--state", state, "--batch", batch, work / name / "stream.jsonl",
                    stderr=work / name / "stderr.log")
    out["updates_per_second"] = round(out["events"] / out["wall_seconds"], 1)
    out["updates_per_cpu_second"] = round(out["events"] / out["cpu_seconds"], 1)
    shutil.rmtree(state)
    return out


def breakdown(run: dict[str, Any], imports: dict[str, float]) -> dict[str, float]:
    """Where the whole-process wall time of an apply run went, in seconds: the phases of its summary, and the
    rest of the process (interpreter, imports, exit), of which the imports alone take about what ``imports``
    measured."""
    return {**run["seconds_by_phase"], "outside_the_command": round(run["wall_seconds"] - run["seconds"], 3),
            "of_which_interpreter_and_imports": imports["wall_seconds"]}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median updates/s (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["updates_per_second"])[(len(runs) - 1) // 2]


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    """What the result keeps of an engine-alone run."""
    keep = ("setup", "updates_per_second", "cpu_seconds", "updates_per_cpu_second", "apply_seconds",
            "recompute_seconds", "batch_latency_p50_ms", "first_10_batches_seconds", "first_10_batches_over_median",
            "apply_ms_per_batch_by_phase", "recompute_ms_per_batch_by_phase", "recomputed_per_event_per_layer",
            "published_per_event", "pending_after")
    return {key: run[key] for key in keep}


def default_run(work: Path, args: argparse.Namespace, result: dict[str, Any]) -> None:
    graph = make_rmat(args.scale, args.edge_factor, seed=args.seed)
    result["setup"] = setup = build(work, graph, args.events, args.batch, args.seed, "rmat")
    stream = work / "rmat" / "stream.jsonl"
    result["imports"] = imports = imports_seconds()
    result["parse"] = parse_seconds(stream)

    def alone(warm: bool, run: int) -> dict[str, Any]:
        label = "warm" if warm else "cold"
        state = fresh_copy(work, "rmat", f"engine-{label}-{run}")
        log(f"rmat: engine alone, {label} ({run + 1}/{args.repeat})")
        out = python_child("--engine-alone", str(state), str(work / "rmat" / "model"), str(stream),
                           "--batch", str(args.batch), *(["--warm"] if warm else []),
                           *(["--profile"] if args.profile and not warm and run == 0 else []))
        shutil.rmtree(state)
        return _brief(out)

    runs: dict[str, list[dict[str, Any]]] = {"apply": [], "engine_alone_warm": [], "engine_alone_cold": [],
                                              "apply_big_batch": []}
    for run in range(args.repeat):  # interleaved: each kind sees the machine as the others do
        runs["engine_alone_warm"].append(alone(True, run))
        runs["apply"].append(apply_run(work, "rmat", args.batch, f"apply-{run}"))
        runs["engine_alone_cold"].append(alone(False, run))
        if args.big_batch:
            runs["apply_big_batch"].append(apply_run(work, "rmat", args.big_batch, f"apply-big-{run}"))
    for name, found in runs.items():
        if found:
            result[name] = {"updates_per_second_runs": [r["updates_per_second"] for r in found],
                            "median_run": _median_run(found)}
    cli, warm = result["apply"]["median_run"], result["engine_alone_warm"]["median_run"]
    result["breakdown_seconds"] = {"apply": breakdown(cli, imports)}
    if args.big_batch:
        result["breakdown_seconds"]["apply_big_batch"] = breakdown(result["apply_big_batch"]["median_run"], imports)
    if not args.no_shape:
        result["shape"] = shape_run(work, graph, args)
    ratios = [a["updates_per_second"] / b["updates_per_second"]
              for a, b in zip(runs["apply"], runs["engine_alone_warm"])]
    ratio = float(np.median(ratios))
    result["summary"] = {
        "apply_updates_per_second": cli["updates_per_second"],
        "engine_alone_updates_per_second": warm["updates_per_second"],
        "apply_over_engine_alone_runs": [round(r, 3) for r in ratios],
        "apply_over_engine_alone": round(ratio, 3),
        "apply_over_engine_alone_per_cpu_second": round(cli["updates_per_cpu_second"]
                                                        / warm["updates_per_cpu_second"], 3),
        "target": TARGET_RATIO, "pass": ratio >= TARGET_RATIO,
        "graph_load_seconds": setup["graph_load"]["wall_seconds"],
        "backfill_command_seconds": setup["backfill"]["wall_seconds"],
    }


def cold_run(work: Path, args: argparse.Namespace, result: dict[str, Any]) -> None:
    sizes = {"small": args.small_scale, "large": args.large_scale}
    for name, scale in sizes.items():
        graph = cold_graph(args.cold_graph, scale, args.edge_factor, args.seed)
        result[name] = {"setup": build(work, graph, args.cold_events, args.batch, args.seed, name)}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in range(args.repeat):
        for mode in ("cold", "warm"):
            for name in sizes:  # the sizes one after the other, in each mode
                state = fresh_copy(work, name, f"{mode}-{run}")
                page_cache(state, mode)
                log(f"{name}: gnnstream apply, page cache {mode} ({run + 1}/{args.repeat})")
                out = gnnstream("apply", "--state", state, "--batch", args.batch, work / name / "stream.jsonl",
                                stderr=work / name / "stderr.log")
                out["updates_per_second"] = round(out["events"] / out["wall_seconds"], 1)
                out["updates_per_cpu_second"] = round(out["events"] / out["cpu_seconds"], 1)
                out["published_per_event"] = round(out["published"] / out["events"], 3)
                runs.setdefault((mode, name), []).append(out)
                shutil.rmtree(state)
    result["summary"] = {}
    for mode in ("cold", "warm"):
        for name in sizes:
            found = runs[(mode, name)]
            result[name][mode] = {"updates_per_second_runs": [r["updates_per_second"] for r in found],
                                  "median_run": _median_run(found)}
        ratios = [big["updates_per_second"] / small["updates_per_second"]
                  for small, big in zip(runs[(mode, "small")], runs[(mode, "large")])]
        small, large = (result[name][mode]["median_run"] for name in sizes)
        ratio = float(np.median(ratios))
        result["summary"][mode] = {
            "small": small["updates_per_second"], "large": large["updates_per_second"],
            "large_over_small_runs": [round(r, 3) for r in ratios], "large_over_small": round(ratio, 3),
            "large_over_small_per_cpu_second": round(large["updates_per_cpu_second"]
                                                     / small["updates_per_cpu_second"], 3),
            "target": TARGET_COLD_RATIO, "pass": ratio >= TARGET_COLD_RATIO}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.engine_alone:
        out = engine_alone(*args.engine_alone, batch=args.batch, warm=args.warm, profile=args.profile)
        print(json.dumps(out))
        return out
    if not GNNSTREAM.exists():
        raise SystemExit(f"no gnnstream command beside {sys.executable}; install the package (pip install -e .)")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every command and child
    work = Path(tempfile.mkdtemp(prefix="gnnstream-bench-apply-cli-", dir=args.workdir))
    result: dict[str, Any] = {"benchmark": "apply_cli", "config": {
        "graph": "R-MAT", "edge_factor": args.edge_factor, "dim": DIM,
        "model": f"sage {DIM}-{HIDDEN}-{HIDDEN}", "fanouts": list(FANOUTS), "batch": args.batch,
        "torch_threads": args.threads or "default",
        "mode": "cold" if args.cold else "default",
    }, "code": code_fingerprint(), "machine_load_at_start": machine_load()}
    try:
        if args.cold:
            result["config"].update(sizes=[args.small_scale, args.large_scale], events=args.cold_events,
                                    graph="R-MAT" if args.cold_graph == "rmat" else "Chung-Lu")
            cold_run(work, args, result)
        else:
            result["config"].update(scale=args.scale, events=args.events, big_batch=args.big_batch)
            default_run(work, args, result)
    finally:
        close_run(result, work, args.keep)
    emit(result)
    return result


if __name__ == "__main__":
    main()
