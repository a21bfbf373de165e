"""Scale benchmark: does the engine's incremental cost stay flat as the graph grows 8×?

Two graphs of the engine bench's kind (seeded directed Chung-Lu power-law,
128-dim features, 2-layer GraphSAGE 128 → 128 → 128, fanouts 25,10): the
large one with ``2^--large-log2`` nodes and ``--large-edges`` directed edges,
the small one with ``2^--small-log2`` nodes and as many edges per node. Each
size runs in a process of its own (so each has its own peak RSS) and reports:

- bulk load (``graph_state.bulk.BulkLoad``, with the sampled-by index of the
  model's fanouts, ``--load-workers`` processes): seconds and directed edges
  per second;
- engine start on the loaded, reopened store (``Engine(store, model)``:
  sampled-by index, name map, row checks) in seconds;
- backfill seconds;
- ``--events`` streamed events (90 % edge upserts, 5 % edge deletes, 5 %
  feature updates, as ``bench/engine.py``) in batches of ``--batch``:
  updates/s and p50 / p99 batch latency;
- peak RSS of the process.

The small graph is loaded and backfilled first, then the large one, each
while the other waits. The two streams then run in lock step, one batch of
each in turn, so both see the machine as it is at that moment: the ratio of
their updates/s is measured side by side, batch by batch, not minutes apart.

The JSON on stdout holds both sizes and the ratio of the large graph's
updates/s to the small one's. Progress goes to stderr.

    python -m bench.scale                                   # 2^20 and 2^17 nodes
    python -m bench.scale --large-log2 14 --large-edges 150000 --small-log2 12 --events 2000   # quick
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    ROOT, Progress, code_fingerprint, current_rss_mib, emit, log, machine_load, make_graph, model_dir, close_run,
    open_loaded_store,
)
from bench.engine import BatchLog, run_batch, stream_events
from gnnstream.workers.engine import Engine
from gnnstream.workers.heap import freeze_warm_heap, tune_collector

FANOUTS = (25, 10)
DIM = 128
TARGET_LOAD_EDGES_PER_SECOND = 200_000  # on a 2-core machine
TARGET_START_SECONDS = 10.0
TARGET_PEAK_RSS_MIB = 8 * 1024
TARGET_RATIO = 0.67


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--large-log2", type=int, default=20, help="log2 of the large graph's nodes")
    p.add_argument("--large-edges", type=int, default=10_000_000, help="directed edges of the large graph")
    p.add_argument("--small-log2", type=int, default=17, help="log2 of the small graph's nodes (same edges per node)")
    p.add_argument("--events", type=int, default=50_000, help="streamed events per size")
    p.add_argument("--batch", type=int, default=1_000, help="events per streamed batch")
    p.add_argument("--seed", type=int, default=0, help="graph and event seed")
    p.add_argument("--load-workers", type=int, default=None,
                   help="processes of the bulk load (default: one per core; 1: the size's process alone)")
    p.add_argument("--workdir", default=None, help="directory for the temporary stores (default: system temp)")
    p.add_argument("--store-cache", default=None,
                   help="directory keeping loaded copies of the graphs; later runs copy them instead of loading "
                        "(the load figures are then the first run's)")
    p.add_argument("--one", nargs=2, type=int, metavar=("NODES", "EDGES"), help=argparse.SUPPRESS)
    p.add_argument("--lockstep", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def one_size(nodes: int, edges: int, args: argparse.Namespace) -> dict[str, Any]:
    """Load, start, backfill and stream one graph (the ``--one`` child).

    With ``--lockstep`` it says ``ready`` on stdout before the stream, then
    runs a batch for each line read from stdin and answers ``done`` after it.
    """
    tune_collector()
    work = Path(tempfile.mkdtemp(prefix="gnnstream-bench-scale-", dir=args.workdir))
    out: dict[str, Any] = {"nodes": nodes, "edges_requested": edges}
    try:
        graph = make_graph(nodes, edges, dim=DIM, seed=args.seed)
        out["graph"] = graph.stats()
        loaded_model = model_dir(work / "model", dim=DIM, fanouts=FANOUTS, seed=0)
        store, load = open_loaded_store(work / "state", graph, dim=DIM, cache_dir=args.store_cache,
                                        bulk_fanouts=FANOUTS, bulk_workers=args.load_workers)
        out["load"] = load
        out["rss_mib_after_load"] = current_rss_mib()
        try:
            t = time.perf_counter()
            engine = Engine(store, loaded_model)
            out["engine_start_seconds"] = round(time.perf_counter() - t, 3)
            log(f"engine started ({out['engine_start_seconds']}s); backfill")
            t = time.perf_counter()
            engine.backfill()
            out["backfill_seconds"] = round(time.perf_counter() - t, 3)
            out["rss_mib_after_backfill"] = current_rss_mib()
            freeze_warm_heap()
            rng = np.random.default_rng(args.seed + 1)
            events, counts = stream_events(graph, args.events, rng, 0.90, 0.05, 1_750_000_000, args.batch)
            out["event_counts"] = counts
            stream = BatchLog(engine.num_layers)
            _say("ready", args.lockstep)
            bar = Progress("stream", len(events))
            for start in range(0, len(events), args.batch):
                chunk = events[start:start + args.batch]
                if args.lockstep and not sys.stdin.readline():
                    raise SystemExit("the lock-step parent went away")
                run_batch(store, engine, chunk, stream)
                _say("done", args.lockstep)
                bar.update(len(chunk))
            bar.close()
            summary = stream.summary()
            out["stream"] = {key: summary[key] for key in (
                "events", "updates_per_second", "batch_latency_p50_ms", "batch_latency_p99_ms", "apply_p50_ms",
                "recompute_p50_ms", "recomputed_per_event_per_layer", "published_per_event")}
            for key in ("apply_ms_per_batch_by_phase", "recompute_ms_per_batch_by_phase"):
                out["stream"][key] = summary[key]
        finally:
            store.close()
    finally:
        close_run(out, work, keep=False)
    return out


def _say(word: str, lockstep: bool) -> None:
    if lockstep:
        sys.stdout.write(word + "\n")
        sys.stdout.flush()


def _expect(child: subprocess.Popen, word: str) -> None:
    line = child.stdout.readline().strip()
    if line != word:
        child.kill()
        raise SystemExit(f"a size's process said {line!r} where {word!r} was expected (exit {child.wait()})")


def run_lockstep(sizes: list[tuple[str, int, int]], args: argparse.Namespace) -> dict[str, Any]:
    """Load and backfill each size in turn (the others wait), then stream one batch of each in turn."""
    children: dict[str, subprocess.Popen] = {}
    try:
        for name, nodes, edges in sizes:
            log(f"{name}: {nodes} nodes, {edges} edges, in a process of its own")
            cmd = [sys.executable, "-m", "bench.scale", "--one", str(nodes), str(edges), "--lockstep", "--events",
                   str(args.events), "--batch", str(args.batch), "--seed", str(args.seed)]
            for flag, value in (("--workdir", args.workdir), ("--store-cache", args.store_cache),
                                ("--load-workers", args.load_workers)):
                if value:
                    cmd += [flag, str(value)]
            children[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
            _expect(children[name], "ready")
        log("streaming both sizes in lock step")
        for _ in range(0, args.events, args.batch):
            for child in children.values():
                child.stdin.write("go\n")
                child.stdin.flush()
                _expect(child, "done")
        results = {}
        for name, child in children.items():
            child.stdin.close()
            out = child.stdout.read()
            if child.wait() != 0:
                raise SystemExit(f"the {name} size's process failed (exit {child.returncode})")
            results[name] = json.loads(out.strip().splitlines()[-1])
        return results
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.one:
        result = one_size(args.one[0], args.one[1], args)
        print(json.dumps(result))
        return result
    large_nodes = 1 << args.large_log2
    small_nodes = 1 << args.small_log2
    small_edges = round(args.large_edges * small_nodes / large_nodes)
    result: dict[str, Any] = {"benchmark": "scale", "config": {
        "graph": "seeded directed Chung-Lu power-law (gamma 2.5), as bench/engine.py", "dim": DIM,
        "model": "sage 128-128-128", "fanouts": list(FANOUTS), "events": args.events, "batch": args.batch,
        "sizes": {"large": [large_nodes, args.large_edges], "small": [small_nodes, small_edges]},
    }, "code": code_fingerprint(), "machine_load_at_start": machine_load()}
    result.update(run_lockstep([("small", small_nodes, small_edges), ("large", large_nodes, args.large_edges)], args))
    large, small = result["large"], result["small"]
    ratio = large["stream"]["updates_per_second"] / small["stream"]["updates_per_second"]
    result["summary"] = {
        "bulk_load_edges_per_second": large["load"]["edges_per_second"],
        "bulk_load_from_cache": large["load"].get("from_cache", False),
        "backfill_seconds": large["backfill_seconds"],
        "engine_start_seconds": large["engine_start_seconds"],
        "updates_per_second_large": large["stream"]["updates_per_second"],
        "updates_per_second_small": small["stream"]["updates_per_second"],
        "ratio_large_over_small": round(ratio, 3),
        "peak_rss_mib_large": large["peak_rss_mib"],
        "targets": {
            "bulk_load_edges_per_second": [TARGET_LOAD_EDGES_PER_SECOND,
                                           large["load"]["edges_per_second"] >= TARGET_LOAD_EDGES_PER_SECOND],
            "engine_start_seconds": [TARGET_START_SECONDS, large["engine_start_seconds"] <= TARGET_START_SECONDS],
            "peak_rss_mib": [TARGET_PEAK_RSS_MIB, large["peak_rss_mib"] <= TARGET_PEAK_RSS_MIB],
            "ratio_large_over_small": [TARGET_RATIO, ratio >= TARGET_RATIO],
        },
    }
    result["batch_latency_p50_ms"] = {n: result[n]["stream"]["batch_latency_p50_ms"] for n in ("small", "large")}
    result["batch_latency_p99_ms"] = {n: result[n]["stream"]["batch_latency_p99_ms"] for n in ("small", "large")}
    result["machine_load_at_end"] = machine_load()
    emit(result)
    return result


if __name__ == "__main__":
    main()
