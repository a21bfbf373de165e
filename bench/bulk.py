"""Bulk load benchmark: directed edges/s and peak RSS of ``BulkLoad`` by number of workers, side by side.

The graph of ``bench/scale.py`` (seeded directed Chung-Lu power law, 128-dim
features, the sampled-by snapshot of fanouts 25,10) is generated once and
handed to each load as a file. Every load runs in a process of its own, so
each has its own peak RSS; the worker counts take turns, ``--repeat`` rounds
of them, so all see the machine in the same state. Each load is what
``bench/common.py`` ``bulk_load_graph`` times: node and edge columns taken in
(names interned), the graph worked out, the table files written and
ingested. Its workers are processes forked from it: their peak RSS counts
the pages they share with it.

The JSON on stdout holds every load, the median edges/s of each worker
count and its ratio to one worker's. Progress goes to stderr.

    python -m bench.bulk                                    # 2^18 nodes, 2.5 M edges; 1 and 2 workers
    python -m bench.bulk --log2 20 --edges 10000000 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    ROOT, SyntheticGraph, bulk_load_graph, close_run, code_fingerprint, emit, log, machine_load, make_graph,
)
from gnnstream.graph_state.store import GraphStore

FANOUTS = (25, 10)
DIM = 128


def _workers(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected worker counts like 1,2 (got {text!r})")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--log2", type=int, default=18, help="log2 of the graph's nodes")
    p.add_argument("--edges", type=int, default=2_500_000, help="directed edges of the graph")
    p.add_argument("--workers", type=_workers, default=[1, 2], help="worker counts to compare, comma-separated")
    p.add_argument("--repeat", type=int, default=2, help="rounds of loads, each worker count once a round")
    p.add_argument("--seed", type=int, default=0, help="graph seed")
    p.add_argument("--workdir", default=None, help="directory for the graph file and the states (default: system temp)")
    p.add_argument("--one", nargs=2, metavar=("WORKERS", "GRAPH"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def one_load(workers: int, graph_file: Path) -> dict[str, Any]:
    """Load the graph in ``graph_file`` into a new state with ``workers`` workers (the ``--one`` child)."""
    with np.load(graph_file) as saved:
        graph = SyntheticGraph(int(saved["nodes"]), saved["src"], saved["dst"], saved["features"],
                               np.zeros(0), np.zeros(0), float(saved["gamma"]), int(saved["seed"]))
    work = Path(tempfile.mkdtemp(prefix=f"load-{workers}-", dir=graph_file.parent))
    out: dict[str, Any] = {"workers": workers}
    try:
        with GraphStore(work / "state", seed=0, feature_dim=DIM) as store:
            out["load"] = bulk_load_graph(store, graph, FANOUTS, workers=workers)
    finally:
        close_run(out, work, keep=False)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.one:
        result = one_load(int(args.one[0]), Path(args.one[1]))
        print(json.dumps(result))
        return result
    nodes = 1 << args.log2
    result: dict[str, Any] = {"benchmark": "bulk", "config": {
        "graph": "seeded directed Chung-Lu power-law (gamma 2.5), as bench/scale.py", "dim": DIM,
        "fanouts": list(FANOUTS), "nodes": nodes, "edges": args.edges, "workers": args.workers,
        "repeat": args.repeat}, "code": code_fingerprint(), "machine_load_at_start": machine_load()}
    work = Path(tempfile.mkdtemp(prefix="gnnstream-bench-bulk-", dir=args.workdir))
    try:
        graph = make_graph(nodes, args.edges, dim=DIM, seed=args.seed)
        graph_file = work / "graph.npz"
        np.savez(graph_file, nodes=graph.num_nodes, src=graph.src, dst=graph.dst, features=graph.features,
                 gamma=graph.gamma, seed=graph.seed)
        del graph
        loads = []
        for round_ in range(args.repeat):
            for workers in args.workers:
                log(f"round {round_ + 1}: {workers} worker(s), in a process of its own")
                done = subprocess.run([sys.executable, "-m", "bench.bulk", "--one", str(workers), str(graph_file)],
                                      cwd=ROOT, stdout=subprocess.PIPE, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"the load with {workers} worker(s) failed (exit {done.returncode})")
                loads.append({"round": round_ + 1, **json.loads(done.stdout.strip().splitlines()[-1])})
                log(f"  {loads[-1]['load']['edges_per_second']:,.0f} edges/s, peak RSS "
                    f"{loads[-1]['peak_rss_mib']:,.0f} MiB (workers {loads[-1]['load']['worker_peak_rss_mib']:,.0f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["machine_load_at_end"] = machine_load()
    result["loads"] = loads
    by_workers: dict[str, Any] = {}
    for workers in args.workers:
        mine = [entry for entry in loads if entry["workers"] == workers]
        by_workers[str(workers)] = {
            "edges_per_second_median": statistics.median(e["load"]["edges_per_second"] for e in mine),
            "seconds_median": statistics.median(e["load"]["seconds"] for e in mine),
            "peak_rss_mib_max": max(e["peak_rss_mib"] for e in mine),
            "worker_peak_rss_mib_max": max(e["load"]["worker_peak_rss_mib"] for e in mine),
            "cpu_seconds_median": round(statistics.median(
                e["load"]["cpu_seconds"] + e["load"]["worker_cpu_seconds"] for e in mine), 3),
        }
    base = by_workers[str(args.workers[0])]["edges_per_second_median"]
    for entry in by_workers.values():
        entry["edges_per_second_over_first"] = round(entry["edges_per_second_median"] / base, 3)
    result["summary"] = by_workers
    emit(result)
    return result


if __name__ == "__main__":
    main()
