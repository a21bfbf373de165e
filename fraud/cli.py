"""The example's command, ``gnnstream score`` (its models are trained with ``gnnstream train``).

The command line finds them through the ``gnnstream.commands`` entry point
(``pyproject.toml``): the package never imports the example.
"""

from __future__ import annotations

import argparse
import json
import signal
from typing import Any

from gnnstream.workers.settings import add_worker_arguments, finite_number

__all__ = ["add_commands"]


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, allow_nan=False))


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
    """Add ``score`` to the ``gnnstream`` subcommands ``sub``."""
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

