"""The ``gnnstream`` command line.

Every command prints a JSON summary on stdout (progress goes to stderr), so
it can be scripted; ``gnnstream COMMAND --help`` explains each option.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Callable, Sequence

from workers.heap import tune_collector

__all__ = ["main", "build_parser"]

logger = logging.getLogger(__name__)


def _fanouts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 25,10 (got {text!r})") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative fanouts like 25,10 (got {text!r})")
    return values


def _print(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


# ---------------------------------------------------------------------- handlers
def _graph_load(args: argparse.Namespace) -> int:
    from workers.offline import load_events
    _print(load_events(args.state, args.events, seed=args.seed, batch=args.batch))
    return 0


def _graph_show(args: argparse.Namespace) -> int:
    from graph_state.store import GraphStore
    with GraphStore(args.state) as store:
        if not store.exists(args.node):
            print(f"node {args.node!r} does not exist in {args.state}", file=sys.stderr)
            return 1
        feats = store.features(args.node)
        _print({
            "id": args.node,
            "degree": store.degree(args.node),
            "neighbors": store.neighbors(args.node)[: args.limit],
            "sample": store.sample(args.node, args.fanout),
            "fanout": args.fanout,
            "features": None if feats is None else [float(x) for x in feats],
            "seed": store.seed,
        })
    return 0


def _model_init(args: argparse.Namespace) -> int:
    from model import init_model_dir
    cold = {"policy": args.cold_start}
    if args.cold_start == "feature_only":
        cold["min_neighbours"] = args.min_neighbours
    cfg = init_model_dir(args.dir, arch=args.arch, in_dim=args.in_dim, hidden=args.hidden, out_dim=args.out_dim,
                         layers=args.layers, fanouts=args.fanouts, seed=args.seed, heads=args.heads,
                         name=args.name, version=args.version, cold_start=cold, overwrite=args.force)
    _print(cfg.to_dict())
    return 0


def _backfill(args: argparse.Namespace) -> int:
    from workers.offline import backfill
    _print(backfill(args.state, args.model, publish=args.publish))
    return 0


def _embeddings(args: argparse.Namespace) -> int:
    from workers.offline import export_embeddings
    if args.out == "-":
        count = export_embeddings(args.state, sys.stdout)
    else:
        with open(args.out, "w") as fh:
            count = export_embeddings(args.state, fh)
    print(json.dumps({"embeddings": count, "out": args.out}), file=sys.stderr)
    return 0


def _apply(args: argparse.Namespace) -> int:
    from workers.offline import apply_events
    _print(apply_events(args.state, args.model, args.events, batch=args.batch, seed=args.seed, hub_bound=args.hub_bound))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from workers.offline import verify
    summary = verify(args.state, args.model, atol=args.atol)
    _print(summary)
    return 0 if summary["ok"] else 1


def _events_from_snap(args: argparse.Namespace) -> int:
    from stream.events import encode_event
    from workers.datasets import read_snap, snap_events
    rows = read_snap(args.csv)
    if args.limit:
        rows = rows[: args.limit]
    count = 0
    with open(args.out, "wb") as fh:
        for ev in snap_events(rows, with_features=not args.no_features):
            fh.write(encode_event(ev) + b"\n")
            count += 1
    _print({"ratings": len(rows), "events": count, "out": args.out})
    return 0


def _broker(args: argparse.Namespace) -> int:
    from stream.broker import run_broker_foreground
    return run_broker_foreground(args.port)


def _run(args: argparse.Namespace) -> int:
    from workers.settings import settings_from_args
    from workers.worker import Worker
    worker = Worker(settings_from_args(args))
    worker.install_signal_handlers()
    _print(worker.run(max_idle_s=args.exit_when_idle))
    return 0


def _produce(args: argparse.Namespace) -> int:
    from workers.replay import produce_file
    _print(produce_file(args.bootstrap, args.file, topic=args.events_topic, fmt=args.format, rate=args.rate,
                        partitions=args.partitions, limit=args.limit))
    return 0


def _tail(args: argparse.Namespace) -> int:
    from workers.replay import tail_embeddings
    tail_embeddings(args.bootstrap, topic=args.output_topic, from_beginning=args.from_beginning,
                    max_messages=args.max, idle_s=args.idle)
    return 0


def _train(args: argparse.Namespace) -> int:
    from workers.train import train_fraud_model
    _print(train_fraud_model(args.events, args.out, train_fraction=args.train_fraction, hidden=args.hidden,
                             out_dim=args.out_dim, fanouts=args.fanouts, seed=args.seed, epochs=args.epochs))
    return 0


def _score(args: argparse.Namespace) -> int:
    import signal
    from workers.scorer import FraudScorer
    scorer = FraudScorer(args.bootstrap, args.model, in_topic=args.output_topic, out_topic=args.scores_topic,
                         group=args.scorer_group)
    signal.signal(signal.SIGTERM, scorer.stop)
    signal.signal(signal.SIGINT, scorer.stop)
    _print(scorer.run(max_idle_s=args.exit_when_idle))
    return 0


# ---------------------------------------------------------------------- parser
def _state_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state", required=True, metavar="DIR", help="graph state directory (RocksDB)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gnnstream",
        description="Streaming dynamic-graph GNN inference: keeps a graph in RocksDB, recomputes exactly "
                    "the node embeddings each edge event can change, and publishes them to Kafka.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    graph = sub.add_parser("graph", help="load and inspect the graph store")
    gsub = graph.add_subparsers(dest="graph_command", required=True, metavar="SUBCOMMAND")
    p = gsub.add_parser("load", help="apply a JSONL event file to the graph store (no embeddings)")
    _state_arg(p)
    p.add_argument("events", metavar="EVENTS.jsonl", help="one JSON event per line (see DESIGN.md)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed of a new store (default 0)")
    p.add_argument("--batch", type=int, default=1000, help="events per atomic batch (default 1000)")
    p.set_defaults(func=_graph_load)
    p = gsub.add_parser("show", help="print a node's neighbours, sample and features as JSON")
    _state_arg(p)
    p.add_argument("node", metavar="NODE", help="node id")
    p.add_argument("--fanout", type=int, default=10, help="sample size k to show (default 10)")
    p.add_argument("--limit", type=int, default=100, help="at most this many neighbours (default 100)")
    p.set_defaults(func=_graph_show)

    mdl = sub.add_parser("model", help="create model directories")
    msub = mdl.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    p = msub.add_parser("init", help="create a randomly initialised model directory (config.json + weights.pt)")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--arch", choices=["sage", "gcn", "gat"], default="sage")
    p.add_argument("--in-dim", type=int, required=True, help="node feature dimension")
    p.add_argument("--hidden", type=int, default=64, help="hidden width (default 64)")
    p.add_argument("--out-dim", type=int, default=64, help="embedding dimension (default 64)")
    p.add_argument("--layers", type=int, default=2, help="number of layers (default 2)")
    p.add_argument("--fanouts", type=_fanouts, default=[25, 10], help="per-layer sample sizes (default 25,10)")
    p.add_argument("--seed", type=int, default=0, help="sampling and init seed (default 0)")
    p.add_argument("--heads", type=int, default=1, help="attention heads, gat only (default 1)")
    p.add_argument("--name", default="model", help="model name published as NAME:VERSION")
    p.add_argument("--version", type=int, default=1)
    p.add_argument("--cold-start", choices=["plain", "feature_only"], default="plain",
                   help="cold-start policy (default plain: the DESIGN.md contract)")
    p.add_argument("--min-neighbours", type=int, default=2, help="feature_only threshold (default 2)")
    p.add_argument("--force", action="store_true", help="overwrite an existing directory")
    p.set_defaults(func=_model_init)

    p = sub.add_parser("backfill", help="recompute every node's embedding from scratch")
    _state_arg(p)
    p.add_argument("--model", required=True, metavar="DIR", help="model directory")
    p.add_argument("--publish", action="store_true", help="also queue every embedding for publishing")
    p.set_defaults(func=_backfill)

    p = sub.add_parser("embeddings", help="export final embeddings as JSON lines")
    _state_arg(p)
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="output file, - for stdout")
    p.set_defaults(func=_embeddings)

    p = sub.add_parser("apply", help="apply an event file and recompute incrementally (resumable)")
    _state_arg(p)
    p.add_argument("events", metavar="EVENTS.jsonl")
    p.add_argument("--model", default=None, metavar="DIR", help="model directory (default: the one the state uses)")
    p.add_argument("--batch", type=int, default=1000, help="events per batch (default 1000)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed of a new store (default: the model's)")
    p.add_argument("--hub-bound", type=int, default=50_000,
                   help="dependents above which hub propagation is deferred and coalesced (default 50000)")
    p.set_defaults(func=_apply)

    p = sub.add_parser("verify", help="recompute from scratch in memory and compare with stored embeddings")
    _state_arg(p)
    p.add_argument("--model", default=None, metavar="DIR", help="model directory (default: the one the state uses)")
    p.add_argument("--atol", type=float, default=1e-4, help="max abs difference allowed (default 1e-4)")
    p.set_defaults(func=_verify)

    ev = sub.add_parser("events", help="build event files")
    esub = ev.add_subparsers(dest="events_command", required=True, metavar="SUBCOMMAND")
    p = esub.add_parser("from-snap", help="turn a SNAP signed-network CSV into JSONL events with node features")
    p.add_argument("csv", metavar="FILE.csv")
    p.add_argument("--out", required=True, metavar="EVENTS.jsonl")
    p.add_argument("--limit", type=int, default=0, help="only the first N ratings by time")
    p.add_argument("--no-features", action="store_true", help="edges only")
    p.set_defaults(func=_events_from_snap)

    _streaming_commands(sub)
    return parser


def _streaming_commands(sub: Any) -> None:
    from workers.settings import add_worker_arguments

    p = sub.add_parser("broker", help="run the embedded Kafka-protocol broker (Tansu) in the foreground; Ctrl-C stops it")
    p.add_argument("--port", type=int, default=None, help="loopback port (default: a free one, printed)")
    p.set_defaults(func=_broker)

    p = sub.add_parser("run", help="run the streaming worker: consume graph events, publish embeddings",
                       description="Consume graph events from Kafka, keep the graph in RocksDB, recompute exactly "
                                   "the embeddings each event changes and publish them. Every option falls back "
                                   "to the GNNSTREAM_* environment variable shown.")
    add_worker_arguments(p)
    p.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                   help="stop after this many seconds without events (default: run until SIGTERM/SIGINT)")
    p.set_defaults(func=_run)

    p = sub.add_parser("produce", help="produce events from a JSONL file or a SNAP CSV to Kafka")
    add_worker_arguments(p, only=("bootstrap", "events_topic", "partitions"))
    p.add_argument("file", metavar="FILE", help="JSONL events, or a SNAP signed-network CSV with --format snap")
    p.add_argument("--format", choices=["jsonl", "snap"], default="jsonl",
                   help="jsonl (default) or snap: replayed in time order with derived node features")
    p.add_argument("--rate", type=float, default=0.0, help="events per second (default 0: as fast as possible)")
    p.add_argument("--limit", type=int, default=0, help="only the first N events")
    p.set_defaults(func=_produce)

    p = sub.add_parser("train", help="train a GraphSAGE model and a logistic fraud head on Bitcoin OTC")
    p.add_argument("--events", required=True, metavar="FILE.csv", help="SNAP signed-network CSV (Bitcoin OTC)")
    p.add_argument("--out", required=True, metavar="MODEL_DIR", help="model directory to write (servable by run)")
    p.add_argument("--train-fraction", type=float, default=0.7, help="first fraction of ratings by time (default 0.7)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--out-dim", type=int, default=32)
    p.add_argument("--fanouts", type=_fanouts, default=[25, 10])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=300)
    p.set_defaults(func=_train)

    p = sub.add_parser("score", help="fraud scorer: consume embeddings, publish fraud scores")
    add_worker_arguments(p, only=("bootstrap", "output_topic"))
    p.add_argument("--model", required=True, metavar="DIR", help="model directory with head.json (gnnstream train)")
    p.add_argument("--scores-topic", default="fraud-scores", help="topic scores are published to (default fraud-scores)")
    p.add_argument("--scorer-group", default="gnnstream-fraud-scorer", help="consumer group of the scorer")
    p.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS")
    p.set_defaults(func=_score)

    p = sub.add_parser("tail", help="print embedding updates readably")
    add_worker_arguments(p, only=("bootstrap", "output_topic"))
    p.add_argument("--from-beginning", action="store_true", help="start at the earliest update")
    p.add_argument("--max", type=int, default=0, help="stop after N updates (default: never)")
    p.add_argument("--idle", type=float, default=0.0, help="stop after this many idle seconds (default: never)")
    p.set_defaults(func=_tail)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tune_collector()
    from graph_state.exceptions import GraphStateError
    from model import ModelError
    from workers.engine import EngineError
    try:
        if getattr(args, "seed", None) is None and args.command == "apply" and args.model:
            from model import load_model_dir
            args.seed = load_model_dir(args.model).config.seed
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, GraphStateError, ModelError, EngineError) as exc:
        if args.verbose:
            raise
        print(f"gnnstream: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
