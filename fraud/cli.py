"""The example's commands, ``gnnstream train`` and ``gnnstream score``.

The command line finds them through the ``gnnstream.commands`` entry point
(``pyproject.toml``): the package never imports the example.
"""

from __future__ import annotations

import argparse
import json
import signal
from typing import Any

from gnnstream.workers.settings import add_worker_arguments, fanout_list, finite_number, model_name, model_version

__all__ = ["add_commands"]


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, allow_nan=False))


def _train(args: argparse.Namespace) -> int:
    from gnnstream.fraud.train import train_fraud_model
    _print_json(train_fraud_model(args.events, args.out, train_fraction=args.train_fraction, hidden=args.hidden,
                             out_dim=args.out_dim, fanouts=args.fanouts, seed=args.seed, epochs=args.epochs,
                             name=args.name, version=args.version, overwrite=args.force))
    return 0


def _score(args: argparse.Namespace) -> int:
    from gnnstream.fraud.scorer import FraudScorer
    if args.output_topic and len(args.model) > 1:
        raise ValueError(f"--output-topic reads one topic, for one --model (got {len(args.model)}); leave it out "
                         f"to read each model's version topic")
    scorer = FraudScorer(args.bootstrap, args.model, in_topic=args.output_topic or None, out_topic=args.scores_topic,
                         canary=args.canary, canary_topic=args.canary_topic, group=args.scorer_group,
                         control_topic=args.control_topic or None, kafka_client=args.kafka_client)
    signal.signal(signal.SIGTERM, scorer.stop)
    signal.signal(signal.SIGINT, scorer.stop)
    _print_json(scorer.run(max_idle_s=args.exit_when_idle))
    return 0


def add_commands(sub: Any) -> None:
    """Add ``train`` and ``score`` to the ``gnnstream`` subcommands ``sub``."""
    def _train_fraction(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number between 0 and 1 like 0.7 (got {text!r})") from None
        if not 0 < value < 1:
            raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1, both excluded (got {text!r})")
        return value

    def _epochs(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number of epochs like 300 (got {text!r})") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected at least 1 epoch (got {text!r})")
        return value

    p = sub.add_parser("train", help="train a GraphSAGE model and a logistic fraud head on Bitcoin OTC")
    p.add_argument("--events", required=True, metavar="FILE.csv", help="SNAP signed-network CSV (Bitcoin OTC)")
    p.add_argument("--out", required=True, metavar="MODEL_DIR", help="model directory to write (servable by run)")
    p.add_argument("--force", action="store_true", help="overwrite an existing non-empty MODEL_DIR")
    p.add_argument("--train-fraction", type=_train_fraction, default=0.7,
                   help="first fraction of ratings by time, between 0 and 1 (default 0.7)")
    p.add_argument("--hidden", type=int, default=64, help="hidden width of the GraphSAGE layers (default 64)")
    p.add_argument("--out-dim", type=int, default=32, help="embedding dimension (default 32)")
    p.add_argument("--fanouts", type=fanout_list, default=[25, 10],
                   help="per-layer neighbour sample sizes, one per layer (default 25,10)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights and of the model's neighbour sampling (default 0)")
    p.add_argument("--epochs", type=_epochs, default=300, help="training epochs, at least 1 (default 300)")
    p.add_argument("--name", type=model_name, default="otc-sage",
                   help="model name; the model is published as NAME:VERSION, to node-embeddings.NAME.vVERSION "
                        "(default otc-sage)")
    p.add_argument("--version", type=model_version, default=1,
                   help="model version, a non-negative integer (default 1); train the next version with a new "
                        "--version (and e.g. another --seed) to roll it out beside the current one")
    p.set_defaults(func=_train)

    def _canary(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a fraction of nodes between 0 and 1 like 0.05 "
                                             f"(got {text!r})") from None
        if not 0 <= value <= 1:
            raise argparse.ArgumentTypeError(f"expected a fraction of nodes between 0 and 1 (got {text!r})")
        return value

    p = sub.add_parser("score", help="fraud scorer: consume embeddings, publish fraud scores",
                       description="Score the serving embeddings of each model version given with --model "
                                   "(read from its version topic, node-embeddings.NAME.vVERSION) with its fraud "
                                   "head and publish one score per update; with --canary, also score the other "
                                   "versions for a fraction of the nodes and report how the scores differ.")
    add_worker_arguments(p, only=("bootstrap", "kafka_client", "control_topic"))
    p.add_argument("--model", required=True, action="append", metavar="DIR",
                   help="model directory with head.json (gnnstream train); repeat it for each version being "
                        "rolled out (the scorer follows the serving one)")
    p.add_argument("--output-topic", default=None, metavar="TOPIC",
                   help="read embeddings from this topic instead of the model's version topic (one --model only)")
    p.add_argument("--canary", type=_canary, default=0.0, metavar="FRACTION",
                   help="fraction of nodes (0 to 1, by a hash of the node id) whose updates of every --model "
                        "are scored, to compare the versions' scores (default 0: none)")
    p.add_argument("--canary-topic", default=None, metavar="TOPIC",
                   help="topic of every score of the canary nodes, tagged with model and role (default "
                        "SCORES_TOPIC.canary)")
    p.add_argument("--scores-topic", default="fraud-scores", metavar="TOPIC",
                   help="topic the serving scores are published to (default fraud-scores)")
    p.add_argument("--scorer-group", default="gnnstream-fraud-scorer",
                   help="consumer group of the scorer (default gnnstream-fraud-scorer)")
    p.add_argument("--exit-when-idle", type=finite_number(0), default=None, metavar="SECONDS",
                   help="stop (and print the summary) after this many seconds without an update (default: never)")
    p.set_defaults(func=_score)

