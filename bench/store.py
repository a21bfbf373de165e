"""Graph-store benchmark: edge-upsert throughput and O(k) sample reads on a hub.

Builds a hub with ``--hub-degree`` neighbours (1,000,000 by default) from edge
upserts applied in batches of ``--batch`` (the upsert-throughput measurement),
adds ``--random-edges`` upserts between random existing nodes, then times
``sample(v, k)`` for a degree-10 node and for the hub, with the in-memory
caches warm and cold (``_invalidate_caches()`` before every cold read, so the
read goes to RocksDB). Prints one JSON object on stdout; progress goes to
stderr.

Usage::

    python -m bench.store                      # full size, a few minutes on 2 cores
    python -m bench.store --hub-degree 20000   # quick run
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import random
import resource
import sys
import tempfile
import time
from pathlib import Path


from bench.common import code_fingerprint, machine_load
from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.events import EdgeUpsert

logger = logging.getLogger("bench.store")

HUB = "hub"
DEG10 = "deg10"
DEG25 = "deg25"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hub-degree", type=int, default=1_000_000, help="neighbours of the hub (default 1,000,000)")
    p.add_argument("--batch", type=int, default=1_000, help="edge upserts per applied batch (default 1,000)")
    p.add_argument("--random-edges", type=int, default=50_000,
                   help="extra upserts between random existing nodes after the hub is built (default 50,000)")
    p.add_argument("--reads", type=int, default=2_000, help="timed sample reads per case (default 2,000)")
    p.add_argument("--fanouts", default="10,25", help="store fanouts, comma separated (default 10,25)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed and RNG seed (default 0)")
    p.add_argument("--dir", default=None, help="parent directory for the temporary store (default: system temp)")
    return p.parse_args(argv)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _apply_timed(store: GraphStore, batches, total: int, label: str) -> float:
    """Apply event batches; return the wall and process-CPU seconds spent inside ``store.apply``."""
    spent = cpu = 0.0
    done = 0
    next_report = 0.1
    for events in batches:
        c, t = time.process_time(), time.perf_counter()
        store.apply(events)
        spent += time.perf_counter() - t
        cpu += time.process_time() - c
        done += len(events)
        if done >= next_report * total:
            logger.info("%s: %d/%d upserts, %.0f/s", label, done, total, done / spent)
            next_report += 0.1
    return spent, cpu


def _hub_batches(n: int, size: int, rng: random.Random):
    ts = 1_700_000_000
    for start in range(0, n, size):
        yield [
            EdgeUpsert(HUB, f"u{i}", ts + i, rng.uniform(-10, 10)) if rng.random() < 0.5
            else EdgeUpsert(f"u{i}", HUB, ts + i, rng.uniform(-10, 10))
            for i in range(start, min(n, start + size))
        ]


def _random_batches(n: int, size: int, n_nodes: int, rng: random.Random):
    ts = 1_750_000_000
    for start in range(0, n, size):
        yield [
            EdgeUpsert(f"u{rng.randrange(n_nodes)}", f"u{rng.randrange(n_nodes)}", ts + i, rng.uniform(-10, 10))
            for i in range(start, min(n, start + size))
        ]


def _stats(times: list[float]) -> dict:
    times = sorted(times)
    n = len(times)
    return {
        "mean_us": round(sum(times) / n * 1e6, 2),
        "p50_us": round(times[n // 2] * 1e6, 2),
        "p99_us": round(times[min(n - 1, int(n * 0.99))] * 1e6, 2),
    }


def _time_reads(store: GraphStore, names: dict[str, str], k: int, n: int, cold: bool) -> dict:
    """Time ``sample(name, k)`` for every name, interleaved so that all see the same machine load.

    Wall time and this thread's CPU time are both recorded; the CPU time is
    what the read costs, unaffected by other processes taking the cores.
    """
    expected = {label: store.sample(name, k) for label, name in names.items()}
    wall: dict[str, list[float]] = {label: [] for label in names}
    cpu: dict[str, list[float]] = {label: [] for label in names}
    gc.collect()
    gc.disable()
    try:
        for _ in range(n):
            for label, name in names.items():
                if cold:
                    store._invalidate_caches()
                c, t = time.thread_time(), time.perf_counter()
                got = store.sample(name, k)
                t, c = time.perf_counter() - t, time.thread_time() - c
                wall[label].append(t)
                cpu[label].append(c)
                if got != expected[label]:
                    raise AssertionError(f"sample({name!r}, {k}) changed between reads")
    finally:
        gc.enable()
    out = {}
    for label in names:
        w, c = _stats(wall[label]), _stats(cpu[label])
        out[label] = {
            "reads_per_s": round(1e6 / w["mean_us"]),
            "reads_per_s_cpu": round(1e6 / c["mean_us"]) if c["mean_us"] else None,
            "wall": w,
            "cpu": c,
            "returned": len(expected[label]),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    rng = random.Random(args.seed)
    fanouts = [int(x) for x in args.fanouts.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="gnnstream-bench-", dir=args.dir) as tmp:
        store = GraphStore(Path(tmp) / "db", seed=args.seed)
        try:
            store.set_fanouts(fanouts)
            t0 = time.perf_counter()
            hub_s, hub_cpu = _apply_timed(store, _hub_batches(args.hub_degree, args.batch, rng), args.hub_degree, "hub")
            hub_wall = time.perf_counter() - t0
            for name, degree in ((DEG10, 10), (DEG25, 25)):  # leaves of their own: degrees stay exact
                store.apply([EdgeUpsert(name, f"{name}-{i}", 1, 1.0) if i % 2 else EdgeUpsert(f"{name}-{i}", name, 1, 1.0)
                             for i in range(degree)])
            assert store.degree(HUB) == args.hub_degree
            rnd_s, rnd_cpu = _apply_timed(store, _random_batches(args.random_edges, args.batch, args.hub_degree, rng),
                                          args.random_edges, "random") if args.random_edges else (0.0, 0.0)
            logger.info("counting the graph")
            assert store.degree(DEG10) == 10 and store.degree(DEG25) == 25
            n_nodes = store.num_nodes()
            n_edges = sum(1 for _ in store.column("edges").keys())
            rss_after_build = _rss_mib()

            reads: dict = {}
            ratios: dict = {}
            control: dict = {}
            for mode in ("warm", "cold"):
                for k in (10, 25):
                    logger.info("reads: %s k=%d", mode, k)
                    names = {"degree10": DEG10, "hub": HUB}
                    if k == 25:
                        names["degree25"] = DEG25  # like-for-like control: returns as many ids as the hub
                    case = _time_reads(store, names, k, args.reads, mode == "cold")
                    for label, stats in case.items():
                        reads[f"{mode}_k{k}_{label}"] = stats
                    ratios[f"{mode}_k{k}"] = {
                        clock: round(case["hub"][clock]["p50_us"] / case["degree10"][clock]["p50_us"], 3)
                        for clock in ("cpu", "wall")
                    }
                    if k == 25:
                        control[f"{mode}_k25"] = round(
                            case["hub"]["cpu"]["p50_us"] / case["degree25"]["cpu"]["p50_us"], 3)
        finally:
            store.close()
    result = {
        "benchmark": "graph_store",
        "python": platform.python_version(),
        "config": {"hub_degree": args.hub_degree, "batch": args.batch, "random_edges": args.random_edges,
                   "reads_per_case": args.reads, "fanouts": fanouts, "seed": args.seed},
        "graph": {"nodes": n_nodes, "edges": n_edges, "hub_degree": args.hub_degree},
        "upserts": {
            "hub_build_upserts_per_s": round(args.hub_degree / hub_s),
            "hub_build_upserts_per_cpu_s": round(args.hub_degree / hub_cpu),
            "hub_build_s": round(hub_s, 2),
            "hub_build_wall_s_incl_event_creation": round(hub_wall, 2),
            "random_upserts_per_s": round(args.random_edges / rnd_s) if rnd_s else None,
            "random_upserts_per_cpu_s": round(args.random_edges / rnd_cpu) if rnd_cpu else None,
            "random_s": round(rnd_s, 2),
        },
        "reads": reads,
        "hub_over_degree10_read_cost_p50": ratios,
        "max_read_cost_ratio_cpu": max(r["cpu"] for r in ratios.values()),
        "read_cost_ratio_ok": max(r["cpu"] for r in ratios.values()) <= 2.0,
        "hub_over_degree25_read_cost_p50_cpu": control,
        "peak_rss_mib": round(_rss_mib(), 1),
        "rss_after_build_mib": round(rss_after_build, 1),
        "code": code_fingerprint(),
        "machine_load_at_end": machine_load(),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
