"""``gnnstream rollout …``: the command line of the rollout commands (:mod:`gnnstream.workers.rollout.commands`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from gnnstream.workers.rollout.commands import format_status, promote, retire, rollback, start, status

__all__ = ["add_rollout_parser"]


def add_rollout_parser(sub: Any) -> None:
    """``gnnstream rollout …`` (its subcommands)."""
    from gnnstream.workers.settings import add_worker_arguments
    p = sub.add_parser("rollout", help="run a new model version beside the serving one; promote, roll back, "
                                       "retire (docs/operations.md)",
                       description="Roll a new model version out beside the serving one: `start` prepares its "
                                   "state from a copy of the live one, `gnnstream run` on that state publishes it "
                                   "to its own topic, `promote` makes it the version consumers act on from a point "
                                   "of the stream, `rollback` switches back, `retire` stops an old version. "
                                   "`status` shows where each stands. See docs/operations.md, Model rollout.")
    steps = p.add_subparsers(dest="step", metavar="STEP", required=True)

    def kafka(q: argparse.ArgumentParser, events: bool = True) -> None:
        add_worker_arguments(q, only=("bootstrap", "kafka_client", "control_topic",
                                      *(("events_topic",) if events else ())))

    q = steps.add_parser("start", help="copy the live state and compute a new model version on the copy")
    q.add_argument("--from", dest="live", required=True, metavar="LIVE_STATE",
                   help="state directory of the serving version's worker (it may be running)")
    q.add_argument("--state", required=True, metavar="NEW_STATE", help="new state directory for the new version")
    q.add_argument("--model", required=True, metavar="MODEL_DIR", help="the new version's model directory")
    q.add_argument("--no-record", action="store_true", help="do not record progress in the rollout topic "
                                                            "(no Kafka needed)")
    kafka(q, events=False)
    q.set_defaults(func=_start)
    q = steps.add_parser("status", help="each version's workers, the backfill, the serving version, the canary")
    q.add_argument("--json", action="store_true", help="print the whole view as JSON")
    kafka(q, events=False)
    q.set_defaults(func=_status)
    force = ("switch even when no worker of the version reports consuming (nothing is scored until one reaches "
             "the marker)")
    q = steps.add_parser("promote", help="make MODEL the serving version from now on in the stream")
    q.add_argument("model", metavar="MODEL", help="NAME:VERSION")
    q.add_argument("--force", action="store_true", help=force)
    kafka(q)
    q.set_defaults(func=_promote)
    q = steps.add_parser("rollback", help="make the version that served before the last promote serve again")
    q.add_argument("--force", action="store_true", help=force)
    kafka(q)
    q.set_defaults(func=_rollback)
    q = steps.add_parser("retire", help="stop computing MODEL (its workers stop at a marker); not the serving one")
    q.add_argument("model", metavar="MODEL", help="NAME:VERSION")
    kafka(q)
    q.set_defaults(func=_retire)


def _print(result: Any) -> None:
    print(json.dumps(result, indent=2, sort_keys=True))


def _start(args: argparse.Namespace) -> int:
    _print(start(args.live, args.state, args.model, bootstrap=None if args.no_record else args.bootstrap,
                 kafka_client=args.kafka_client, control_topic=args.control_topic))
    return 0


def _status(args: argparse.Namespace) -> int:
    view = status(bootstrap=args.bootstrap, control_topic=args.control_topic, kafka_client=args.kafka_client)
    print(json.dumps(view.to_json(), indent=2, sort_keys=True) if args.json else format_status(view))
    return 0


def _marker_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"bootstrap": args.bootstrap, "events_topic": args.events_topic, "control_topic": args.control_topic,
            "kafka_client": args.kafka_client}


def _promote(args: argparse.Namespace) -> int:
    _print(promote(args.model, force=args.force, **_marker_args(args)))
    return 0


def _rollback(args: argparse.Namespace) -> int:
    _print(rollback(force=args.force, **_marker_args(args)))
    return 0


def _retire(args: argparse.Namespace) -> int:
    _print(retire(args.model, **_marker_args(args)))
    return 0
