"""Backfill benchmark: full recompute of every embedding vs PyG's full-graph forward.

Issue: "full recompute time of backfill on a synthetic power-law graph (2^17
nodes, about 1.2 M directed edges, 2-layer GraphSAGE, 128 dims) and PyG's
full-graph forward on the same graph in the same run".

Steps (all in one process, side by side):

1. generate the seeded power-law graph (:mod:`bench.common`) and load it into a
   fresh :class:`GraphStore` through ``store.apply`` in batches;
2. ``init_model_dir(arch="sage", in_dim=128, hidden=128, out_dim=128, layers=2,
   fanouts=[25, 10], seed=0)``; time ``Engine(store, load_model_dir(dir))``
   (builds the sampled-by index for the fanouts) and ``engine.backfill()``;
3. PyG ``torch_geometric.nn.models.GraphSAGE`` with the same state dict:
   (a) forward over the full edge list (both directions: ``N(v)`` of docs/design.md),
   (b) the same two convs over the per-layer sampled edge lists built from
   ``store.sample`` (layer 0 uses ``S_25``, layer 1 ``S_10``): exactly our
   computation, whose output is compared with the stored embeddings.

Usage::

    python -m bench.backfill                          # full size (2^17 nodes, 1.2 M edges)
    python -m bench.backfill --nodes 4096 --edges 40000  # quick

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


from bench.common import (
    add_graph_args, close_run, GcTimer, code_fingerprint, current_rss_mib, emit, log, machine_load,
    make_graph, model_dir, open_loaded_store,
)
from gnnstream.workers.engine import Engine
from gnnstream.workers.heap import tune_collector
from gnnstream.graph_state.page_log import read_final_rows

FANOUTS = (25, 10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_graph_args(p, seed_help="graph seed", stores="store")
    p.add_argument("--repeat", type=int, default=3, help="timed PyG forwards per variant (after one warm-up)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the backfill and print the top functions on stderr (slows it down)")
    p.add_argument("--profile-out", default=None, metavar="FILE", help="with --profile, also save the stats to FILE")
    return p.parse_args(argv)


def _time_forward(fn, repeat: int) -> dict[str, float]:
    """Warm-up once, then ``repeat`` timed calls; first (cold) and steady-state numbers."""
    t = time.perf_counter()
    out = fn()
    cold = time.perf_counter() - t
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        runs.append(time.perf_counter() - t)
    return {"first_seconds": round(cold, 4),
            "median_seconds": round(statistics.median(runs), 4) if runs else round(cold, 4),
            "min_seconds": round(min(runs), 4) if runs else round(cold, 4),
            "repeat": repeat}, out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch
    from torch_geometric.nn.models import GraphSAGE

    tune_collector()  # as the gnnstream command does
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="gnnstream-bench-backfill-", dir=args.workdir))
    result: dict = {"benchmark": "backfill", "sizes": {}, "config": {
        "arch": "sage", "layers": len(FANOUTS), "fanouts": list(FANOUTS), "dim": args.dim,
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "load_batch": args.load_batch, "profiled": args.profile,
    }, "code": code_fingerprint(), "machine_load_at_start": machine_load()}
    try:
        graph = make_graph(args.nodes, args.edges, dim=args.dim, gamma=args.gamma, seed=args.seed)
        result["graph"] = graph.stats()
        loaded_model = model_dir(work / "model", dim=args.dim, fanouts=FANOUTS, seed=0)
        log("loading the graph into the store")
        store, result["load"] = open_loaded_store(work / "state", graph, dim=args.dim, batch=args.load_batch,
                                                  cache_dir=args.store_cache)
        try:
            result["rss_mib_after_load"] = current_rss_mib()

            # ---------------------------------------------------------------- ours
            log("Engine(store, model): sampled-by index for the fanouts")
            t, c = time.perf_counter(), time.process_time()
            engine = Engine(store, loaded_model)
            init_s, init_cpu = time.perf_counter() - t, time.process_time() - c
            log(f"engine ready ({init_s:.1f}s); backfill")
            prof = cProfile.Profile() if args.profile else None
            t, c = time.perf_counter(), time.process_time()
            if prof:
                prof.enable()
            with GcTimer() as gct:
                stats = engine.backfill(progress=lambda done: log(f"backfill: layer {done}/{engine.num_layers} done"))
            if prof:
                prof.disable()
            backfill_s, backfill_cpu = time.perf_counter() - t, time.process_time() - c
            log(f"backfill done ({backfill_s:.1f}s)")
            if prof and args.profile_out:
                prof.dump_stats(args.profile_out)
                log(f"profile saved to {args.profile_out} (python -m pstats {args.profile_out})")
            if prof:
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
                print(buf.getvalue(), file=sys.stderr)
            num_nodes = store.num_nodes()
            result["sizes"] = {"nodes": num_nodes, "directed_edges": graph.num_edges,
                               "neighbour_pairs": result["graph"]["neighbour_pairs"]}
            result["ours"] = {
                "engine_init_seconds": round(init_s, 3),
                "engine_init_cpu_seconds": round(init_cpu, 3),
                "backfill_seconds": round(backfill_s, 3),
                "backfill_cpu_seconds": round(backfill_cpu, 3),
                "backfill_gc_seconds": round(gct.seconds, 3),
                "backfill_stats_seconds": round(stats.seconds, 3),
                "init_plus_backfill_seconds": round(init_s + backfill_s, 3),
                "nodes_per_second": round(num_nodes / backfill_s, 1),
                "recomputed_per_layer": stats.recomputed,
                "sampled_neighbours": stats.sampled_neighbours,
            }
            result["rss_mib_after_backfill"] = current_rss_mib()

            # ---------------------------------------------------------------- stored embeddings
            names = [graph.name(i) for i in range(graph.num_nodes)]
            iids = [store.iid(n) for n in names]
            ours, present = read_final_rows(store, iids, args.dim)
            missing = int((~present).sum())
            ours[~present] = np.nan

            # ---------------------------------------------------------------- PyG
            weights = torch.load(Path(loaded_model.path) / "weights.pt", map_location="cpu", weights_only=True)
            pyg = GraphSAGE(args.dim, args.dim, num_layers=len(FANOUTS), out_channels=args.dim)
            pyg.load_state_dict(weights)
            pyg.eval()
            x = torch.from_numpy(graph.features)

            a, b = graph.undirected_pairs()
            full_ei = torch.from_numpy(np.stack([np.concatenate([a, b]), np.concatenate([b, a])]))
            log(f"PyG GraphSAGE forward, full edge list ({full_ei.shape[1]} directed messages)")
            with torch.no_grad():
                full_t, full_out = _time_forward(lambda: pyg(x, full_ei), args.repeat)
            result["rss_mib_after_pyg_full"] = current_rss_mib()
            full_out = full_out.numpy()

            log("sampled per-layer edge lists from store.sample")
            t = time.perf_counter()
            layer_ei = []
            for k in FANOUTS:
                src: list[int] = []
                dst: list[int] = []
                for i, n in enumerate(names):
                    s = store.sample(n, k)
                    src.extend(int(u) for u in s)  # node i is named str(i)
                    dst.extend([i] * len(s))
                layer_ei.append(torch.tensor([src, dst], dtype=torch.int64))
            build_s = time.perf_counter() - t

            def sampled_forward():
                h = x
                for l, conv in enumerate(pyg.convs):
                    h = conv(h, layer_ei[l])
                    if l < len(pyg.convs) - 1:
                        h = pyg.act(h)
                return h

            log("PyG GraphSAGE convs over the sampled edge lists")
            with torch.no_grad():
                samp_t, samp_out = _time_forward(sampled_forward, args.repeat)
            diff = np.abs(ours - samp_out.numpy())
            max_diff = float(np.nanmax(diff)) if missing < len(iids) else float("nan")
            result["pyg"] = {
                "full_graph": {**full_t, "messages_per_layer": int(full_ei.shape[1]),
                               "what": "GraphSAGE.forward(x, edge_index) over every neighbour pair, both directions"},
                "sampled": {**samp_t, "build_edge_lists_seconds": round(build_s, 3),
                            "messages_per_layer": [int(e.shape[1]) for e in layer_ei],
                            "what": "the same GraphSAGE's convs + act, layer l over the S_{k_l} edge list"},
            }
            result["ratios"] = {
                "backfill_over_pyg_full_first": round(backfill_s / full_t["first_seconds"], 2),
                "backfill_over_pyg_full_median": round(backfill_s / full_t["median_seconds"], 2),
                "backfill_over_pyg_sampled_median": round(backfill_s / samp_t["median_seconds"], 2),
            }
            result["correctness"] = {
                "reference": "PyG SAGEConv on the sampled per-layer edge lists",
                "max_abs_diff": max_diff,
                "atol": 1e-4,
                "missing_embeddings": missing,
                "ok": bool(missing == 0 and max_diff < 1e-4),
                # sanity: the full neighbourhood differs from the sampled one wherever degree > fanout
                "max_abs_diff_vs_pyg_full_graph": float(np.nanmax(np.abs(ours - full_out))),
            }
        finally:
            store.close()
    finally:
        close_run(result, work, args.keep)
    return result


if __name__ == "__main__":
    emit(main())
