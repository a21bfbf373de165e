"""Typed against untyped: the engine bench's graph and stream served as an untyped graph and as a typed one,
side by side in one process.

The typed graph has the same nodes and edges: node ``i`` is a ``merchant``
when ``i`` is a multiple of 4, else an ``account``; an edge between two
accounts is ``account -sends-> account``, between two merchants
``merchant -links-> merchant``, and between an account and a merchant
``account -pays-> merchant`` (whichever way the untyped edge ran). Both
stores are bulk-loaded with the model's sampled-by index and backfilled;
then the same stream (``bench/engine.py``'s mix: edge upserts, deletes,
feature updates) runs through both in batches of ``--batch``, a batch of
each in turn, each ``store.apply`` + ``engine.recompute``. The models have
the same widths and fanouts: GraphSAGE 128 → 128 → 128 and its typed form
(a ``SAGEConv`` per edge type, summed). Target (issue #44): typed updates
per CPU-second at least 0.7 of the untyped ones.

    python -m bench.typed --events 20000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (code_fingerprint, log, machine_load, make_graph, model_dir, open_loaded_store)
from bench.engine import FANOUTS, BatchLog, run_batch, start_engine, stream_events, verify
from gnnstream.graph_state.bulk import BulkLoad
from gnnstream.graph_state.store import GraphStore
from gnnstream.model import load_model_dir, save_model_dir
from gnnstream.model.config import ModelConfig
from gnnstream.model.hetero import HeteroSAGE
from gnnstream.stream.events import EdgeDelete, EdgeUpsert, Event, NodeUpsert
from gnnstream.workers.engine.typed import GRAPH_SCHEMA_META, TypedLayout

TARGET_RATIO = 0.7


def schema(dim: int) -> dict[str, Any]:
    return {"node_types": {"account": dim, "merchant": dim},
            "relations": [{"src_type": "account", "rel": "pays", "dst_type": "merchant"},
                          {"src_type": "account", "rel": "sends", "dst_type": "account"},
                          {"src_type": "merchant", "rel": "links", "dst_type": "merchant"}]}


def kind(name: str) -> str:
    return "merchant" if int(name) % 4 == 0 else "account"


def typed_event(ev: Event) -> Event:
    """The typed event of one of the untyped graph's (the module's text)."""
    if isinstance(ev, NodeUpsert):
        return NodeUpsert(ev.id, ev.ts, ev.features, type=kind(ev.id))
    s, d = ev.src, ev.dst
    ks, kd = kind(s), kind(d)
    if ks != kd and ks == "merchant":  # pays runs from the account
        s, d, ks, kd = d, s, kd, ks
    rel = "pays" if ks != kd else ("sends" if ks == "account" else "links")
    if isinstance(ev, EdgeUpsert):
        return EdgeUpsert(s, d, ev.ts, ev.weight, src_type=ks, rel=rel, dst_type=kd)
    return EdgeDelete(s, d, ev.ts, src_type=ks, rel=rel, dst_type=kd)


def typed_model(path: Path, dim: int, seed: int = 0) -> Any:
    import torch
    config = ModelConfig(arch="sage", in_dim=0, hidden_dim=dim, out_dim=dim, num_layers=len(FANOUTS),
                         fanouts=FANOUTS, seed=0, name="typed", schema=schema(dim))
    torch.manual_seed(seed)
    net = HeteroSAGE(config.graph_schema, dim, dim, len(FANOUTS))
    save_model_dir(path, config, net.state_dict())
    return load_model_dir(path)


def load_typed(path: Path, graph: Any, model: Any) -> tuple[GraphStore, dict[str, Any]]:
    """A store of the typed graph: the schema bound, the graph's typed events bulk-loaded as the store's."""
    t, c = time.perf_counter(), time.process_time()
    store = GraphStore(path, seed=0, feature_dim=graph.features.shape[1])
    store.apply([], meta={GRAPH_SCHEMA_META: model.config.schema})
    layout = TypedLayout(model.config.graph_schema, store)
    load = BulkLoad(store, fanouts=FANOUTS)
    names = [graph.name(i) for i in range(graph.num_nodes)]
    load.add_nodes([f"{kind(n)}/{n}" for n in names], np.zeros(len(names)), graph.features)
    src, dst = [], []
    for s, d in zip(graph.src.tolist(), graph.dst.tolist()):
        for ev in layout.translate(typed_event(EdgeUpsert(names[s], names[d], 0.0))):
            src.append(ev.src)
            dst.append(ev.dst)
    load.add_edges(src, dst, np.ones(len(src)), np.zeros(len(src)))
    counts = load.finish()
    store.close()
    store = GraphStore(path)
    return store, {"seconds": round(time.perf_counter() - t, 3), "cpu_seconds": round(time.process_time() - c, 3),
                   "store_edges": len(src), "counts": counts}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.typed", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1 << 17, help="graph nodes")
    p.add_argument("--edges", type=int, default=1_200_000, help="directed edges")
    p.add_argument("--dim", type=int, default=128, help="feature and layer width")
    p.add_argument("--events", type=int, default=20_000, help="streamed events")
    p.add_argument("--batch", type=int, default=1_000, help="events per batch")
    p.add_argument("--seed", type=int, default=0, help="graph and stream seed")
    p.add_argument("--workdir", default=None, help="where the stores go (default: a temporary directory)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gnnstream-bench-typed-", dir=args.workdir))
    result: dict[str, Any] = {"benchmark": "typed", "config": vars(args), "code": code_fingerprint(),
                              "machine_load_at_start": machine_load()}
    graph = make_graph(args.nodes, args.edges, dim=args.dim, seed=args.seed)
    result["graph"] = graph.stats()
    untyped_model = model_dir(work / "untyped-model", dim=args.dim, fanouts=FANOUTS, seed=0)
    typed = typed_model(work / "typed-model", args.dim)
    log("loading the untyped graph")
    ustore, uload = open_loaded_store(work / "untyped", graph, dim=args.dim, bulk_fanouts=FANOUTS)
    log("loading the typed graph")
    tstore, tload = load_typed(work / "typed", graph, typed)
    try:
        uengine, usetup = start_engine(ustore, untyped_model, backfills=1)
        tengine, tsetup = start_engine(tstore, typed, backfills=1)
        events, counts = stream_events(graph, args.events, np.random.default_rng(args.seed + 1), 0.90, 0.05,
                                       1_750_000_000, args.batch)
        typed_events = [typed_event(ev) for ev in events]
        logs = {"untyped": BatchLog(uengine.num_layers), "typed": BatchLog(tengine.num_layers)}
        log(f"streaming {len(events)} events through both, a batch of each in turn")
        for start in range(0, len(events), args.batch):
            run_batch(ustore, uengine, events[start:start + args.batch], logs["untyped"])
            chunk = [e for ev in typed_events[start:start + args.batch] for e in tengine.typed.translate(ev)]
            run_batch(tstore, tengine, chunk, logs["typed"], counted=len(typed_events[start:start + args.batch]))
        for name, store, engine, load, setup in (("untyped", ustore, uengine, uload, usetup),
                                                 ("typed", tstore, tengine, tload, tsetup)):
            result[name] = {**logs[name].summary(), "load": load, "setup": setup, "verify": verify(store, engine)}
        result["event_counts"] = counts
    finally:
        ustore.close()
        tstore.close()
    u, t = result["untyped"]["updates_per_cpu_second"], result["typed"]["updates_per_cpu_second"]
    ratio = round(t / u, 3) if u else None
    result["targets"] = {"typed_over_untyped_updates_per_cpu_second": ratio, "target": TARGET_RATIO,
                         "pass": ratio is not None and ratio >= TARGET_RATIO,
                         "exact": result["untyped"]["verify"]["ok"] and result["typed"]["verify"]["ok"]}
    result["machine_load_at_end"] = machine_load()
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["targets"]["exact"] else 1)
