"""The model commands of the command line: ``model init``, ``model import``, ``model export`` and ``train``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gnnstream.workers.settings import (events_path, fanout_list, finite_number, model_name, model_version, schema_file,
                                        whole_number)

__all__ = ["add_model_commands"]


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, allow_nan=False))


def _model_init(args: argparse.Namespace) -> int:
    from gnnstream.model import init_model_dir
    cold = _cold_start(args)
    cfg = init_model_dir(args.dir, arch=args.arch, in_dim=args.in_dim, hidden=args.hidden, out_dim=args.out_dim,
                         layers=args.layers, fanouts=args.fanouts, seed=args.seed, heads=args.heads,
                         name=args.name, version=args.version, cold_start=cold, overwrite=args.force)
    _print_json(cfg.to_dict())
    return 0


def _cold_start(args: argparse.Namespace) -> dict[str, Any]:
    cold: dict[str, Any] = {"policy": args.cold_start}
    if args.cold_start == "feature_only":
        cold["min_neighbours"] = args.min_neighbours
    if args.cold_start == "staged":
        cold.update(feature_only_s=args.feature_only_s, expand_s=args.expand_s, min_neighbours=args.min_neighbours)
    return cold


def _model_import(args: argparse.Namespace) -> int:
    from gnnstream.model.pyg import import_checkpoint
    cfg = import_checkpoint(args.checkpoint, args.dir, arch=args.arch, fanouts=args.fanouts, seed=args.seed,
                            cold_start=_cold_start(args), name=args.name, version=args.version, aggr=args.aggr,
                            act=args.act, schema=args.schema, overwrite=args.force)
    _print_json(cfg.to_dict())
    return 0


def _model_export(args: argparse.Namespace) -> int:
    from gnnstream.model.export import export_model
    _print_json(export_model(args.dir, args.out, args.format))
    return 0


def _train(args: argparse.Namespace) -> int:
    if args.schema is not None:
        return _train_typed(args)
    from gnnstream.workers.offline.train import train_model
    summary = train_model(events_path(args.events), args.labels, args.out, arch=args.arch, hidden=args.hidden,
                          out_dim=args.out_dim, fanouts=args.fanouts, heads=args.heads, seed=args.seed,
                          epochs=args.epochs, lr=args.lr, train_fraction=args.train_fraction,
                          cold_start=_cold_start(args), edge_ttl=args.edge_ttl, name=args.name, version=args.version,
                          overwrite=args.force)
    _warn_skipped(summary, args.events)
    _print_json(summary)
    return 0


def _warn_skipped(summary: dict[str, Any], events: str) -> None:
    """One warning on stderr for the lines of ``events`` training skipped (invalid, or features of another width
    than the first node_upsert's), as apply warns."""
    if summary.get("invalid_lines"):
        print(f"gnnstream: warning: skipped {summary['invalid_lines']} invalid lines of {events} (invalid_lines in "
              f"the summary)", file=sys.stderr)


def _train_typed(args: argparse.Namespace) -> int:
    from gnnstream.workers.offline.typed_train import train_typed_model
    for flag, value, default in (("--arch", args.arch, "sage"), ("--cold-start", args.cold_start, "plain"),
                                 ("--edge-ttl", args.edge_ttl, 0), ("--heads", args.heads, 1)):
        if value != default:
            raise ValueError(f"{flag} {value} does not apply to a typed model (--schema): it is a GraphSAGE with "
                             f"the plain cold-start policy, without an edge window")
    summary = train_typed_model(events_path(args.events), args.labels, args.schema, args.out, hidden=args.hidden,
                                out_dim=args.out_dim, fanouts=args.fanouts, seed=args.seed, epochs=args.epochs,
                                lr=args.lr, train_fraction=args.train_fraction, slices=args.slices,
                                alert_rate=args.alert_rate, name=args.name, version=args.version,
                                overwrite=args.force)
    _warn_skipped(summary, args.events)
    _print_json(summary)
    return 0


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1 like 0.7 (got {text!r})") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1, both excluded (got {text!r})")
    return value


def _model_identity_args(p: argparse.ArgumentParser) -> None:
    """--name, --version and the cold-start policy of a model directory being written."""
    p.add_argument("--name", type=model_name, default="model",
                   help="model name; the model is published as NAME:VERSION, to node-embeddings.NAME.vVERSION "
                        "(default model)")
    p.add_argument("--version", type=model_version, default=1,
                   help="model version, a non-negative integer (default 1)")
    p.add_argument("--cold-start", choices=["plain", "feature_only", "staged"], default="plain",
                   help="cold-start policy (default plain: the contract of docs/design.md; staged: by node age, "
                        "docs/design.md)")
    p.add_argument("--min-neighbours", type=int, default=2,
                   help="feature_only and staged: the neighbour count from which a node uses its neighbours "
                        "(default 2)")
    p.add_argument("--feature-only-s", type=finite_number(0), default=86_400.0,
                   help="staged: a node younger than this (seconds of event time) uses its features only "
                        "(default 86400)")
    p.add_argument("--expand-s", type=finite_number(0), default=259_200.0,
                   help="staged: a node younger than this with fewer than --min-neighbours neighbours samples "
                        "its neighbours' samples too (default 259200)")


def add_model_commands(sub: Any) -> None:
    """Add ``model`` (init, import, export) and ``train`` to the ``gnnstream`` subcommands ``sub``."""
    mdl = sub.add_parser("model", help="create, import and export model directories")
    msub = mdl.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    p = msub.add_parser("init", help="create a randomly initialised model directory (config.json + weights.pt)")
    p.add_argument("dir", metavar="DIR", help="the model directory to create (refused if it holds a model, "
                                             "unless --force)")
    p.add_argument("--arch", choices=["sage", "gcn", "gat"], default="sage",
                   help="layer type: sage (GraphSAGE), gcn or gat (default sage)")
    p.add_argument("--in-dim", type=int, required=True, help="node feature dimension")
    p.add_argument("--hidden", type=int, default=64, help="hidden width (default 64)")
    p.add_argument("--out-dim", type=int, default=64, help="embedding dimension (default 64)")
    p.add_argument("--layers", type=int, default=2, help="number of layers (default 2)")
    p.add_argument("--fanouts", type=fanout_list, default=[25, 10], help="per-layer sample sizes (default 25,10)")
    p.add_argument("--seed", type=int, default=0, help="sampling and init seed (default 0)")
    p.add_argument("--heads", type=int, default=1, help="attention heads, gat only (default 1)")
    _model_identity_args(p)
    p.add_argument("--force", action="store_true", help="overwrite an existing directory")
    p.set_defaults(func=_model_init)

    p = msub.add_parser("import", help="create a model directory from a PyTorch Geometric state_dict",
                        description="Create a model directory from a state_dict saved with torch.save(model."
                                    "state_dict(), PATH) from torch_geometric.nn.GraphSAGE, GCN or GAT, or from a "
                                    "module of SAGEConv, GCNConv or GATConv layers (ReLU between them). Dims and "
                                    "heads are read from the weights; the file is read with weights_only=True (no "
                                    "code runs). What would not be served exactly is refused, naming the option "
                                    "(see docs/models.md).")
    p.add_argument("checkpoint", metavar="STATE_DICT.pt", help="the saved state_dict")
    p.add_argument("dir", metavar="DIR", help="the model directory to create (refused if it holds a model, "
                                             "unless --force)")
    p.add_argument("--arch", choices=["sage", "gcn", "gat"], required=True,
                   help="the layers: sage (SAGEConv, GraphSAGE), gcn (GCNConv, GCN) or gat (GATConv, GAT)")
    p.add_argument("--fanouts", type=fanout_list, required=True, help="per-layer sample sizes, one per layer")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--aggr", default="mean", help="SAGE aggregation the model was built with (default mean, the "
                                                 "only one served)")
    p.add_argument("--act", default="relu", help="activation between the layers (default relu, the only one "
                                                "served)")
    p.add_argument("--schema", type=schema_file, default=None, metavar="SCHEMA.json",
                   help="a typed model: the graph schema (node types, relations) whose metadata() the state_dict's "
                        "to_hetero(GraphSAGE(...), metadata, aggr='sum') was built with (docs/models.md)")
    _model_identity_args(p)
    p.add_argument("--force", action="store_true", help="overwrite an existing directory")
    p.set_defaults(func=_model_import)

    p = msub.add_parser("export", help="write the layers' forward pass as TorchScript or ONNX, with sampler.json",
                        description="Write the forward pass of the model's layers over (x [N, in_dim], "
                                    "edge_index_0 [2, E_0], ..., one sampled edge list per layer) with dynamic N "
                                    "and E, and sampler.json beside it (seed, fanouts, cold-start policy, rank "
                                    "formula, inputs). --format onnx needs the onnx extra.")
    p.add_argument("dir", metavar="DIR", help="the model directory")
    p.add_argument("--format", choices=["torchscript", "onnx"], required=True, help="torchscript or onnx")
    p.add_argument("--out", required=True, metavar="FILE", help="model file to write (e.g. model.pt, model.onnx)")
    p.set_defaults(func=_model_export)

    p = sub.add_parser("train", help="train a GNN and a scoring head on an event file and a labels file",
                       description="Train a GNN and a logistic scoring head on the first --train-fraction of the "
                                   "edge events (file order is time order) and write a model directory with "
                                   "head.json and train.json (held-out metrics: labelled nodes first seen, or "
                                   "labelled, after the cut, scored with the whole stream's embeddings). With "
                                   "--schema: a typed GraphSAGE and a transaction head on the first "
                                   "--train-fraction of the scored relation's transactions (held-out metrics: "
                                   "each later transaction scored with the graph as it stood before it, "
                                   "docs/models.md).")
    p.add_argument("--events", required=True, metavar="FILE",
                   help="JSON lines of the events schema, or a SNAP signed-network CSV (*.csv, *.csv.gz); with "
                        "--schema, JSON lines of a typed graph")
    p.add_argument("--labels", required=True, metavar="FILE.csv",
                   help="id,label[,ts] lines, label 0 or 1; ts: when the label is known (default: the node's "
                        "first event); with --schema, a CSV with txn_id and label columns")
    p.add_argument("--schema", type=schema_file, default=None, metavar="SCHEMA.json",
                   help="train a typed model over this graph schema, scoring its scored relation's transactions "
                        "(python -m gnnstream.fraud.payments writes one)")
    p.add_argument("--slices", type=whole_number(1), default=8,
                   help="with --schema: parts of the held-out window, each scored with the graph at its start "
                        "(default 8)")
    p.add_argument("--alert-rate", type=_fraction, default=0.01,
                   help="with --schema: the share of held-out transactions alerted on, for the precision "
                        "reported (default 0.01)")
    p.add_argument("--out", required=True, metavar="MODEL_DIR", help="model directory to write (servable by run)")
    p.add_argument("--force", action="store_true", help="overwrite an existing non-empty MODEL_DIR")
    p.add_argument("--train-fraction", type=_fraction, default=0.7,
                   help="first fraction of the edge events, between 0 and 1 (default 0.7)")
    p.add_argument("--arch", choices=["sage", "gcn", "gat"], default="sage", help="layer type (default sage)")
    p.add_argument("--hidden", type=whole_number(1), default=64, help="hidden width (default 64)")
    p.add_argument("--out-dim", type=whole_number(1), default=32, help="embedding dimension (default 32)")
    p.add_argument("--heads", type=whole_number(1), default=1, help="attention heads, gat only (default 1)")
    p.add_argument("--fanouts", type=fanout_list, default=[25, 10],
                   help="per-layer neighbour sample sizes, one per layer (default 25,10)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights and of the model's neighbour sampling (default 0)")
    p.add_argument("--epochs", type=whole_number(1), default=300, help="training epochs, at least 1 (default 300)")
    p.add_argument("--lr", type=finite_number(0), default=0.01, help="Adam learning rate (default 0.01)")
    p.add_argument("--edge-ttl", type=whole_number(0, None, "0 = no window"), default=0, metavar="SECONDS",
                   help="the edge window of the state that will serve the model (run --edge-ttl): training "
                        "samples the graph as that window shows it at the cut, with the cold-start stages of "
                        "the nodes' ages then (default 0: no window)")
    _model_identity_args(p)
    p.set_defaults(func=_train)
