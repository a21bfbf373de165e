"""The ``gnnstream`` command line.

Every command prints a JSON summary on stdout (progress goes to stderr), so
it can be scripted; ``gnnstream COMMAND --help`` explains each option. An
error is one line on stderr, ``gnnstream: error: ...``, naming what failed
and what to do, with exit status 2 (``-v`` shows the traceback instead).
Files given with ``--out`` are replaced whole or not at all. A reader of
stdout that goes away (``| head``) ends the command quietly, with status 141
as for a command ended by SIGPIPE.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import select
import signal
import sys
from contextlib import contextmanager
from importlib.metadata import entry_points
from typing import IO, Any, Iterator, Sequence

from gnnstream.workers.atomic import atomic_output
from gnnstream.workers.heap import tune_collector
from gnnstream.workers.query.limits import add_arguments as add_http_limits, from_args as http_limits
from gnnstream.workers.offline.commands import add_model_commands
from gnnstream.workers.settings import configure_logging, events_path, finite_number, port_number, whole_number

__all__ = ["main", "build_parser"]

logger = logging.getLogger(__name__)

@contextmanager
def _output(path: str, mode: str = "w") -> Iterator[IO[Any]]:
    """``atomic_output``, with errors naming ``path`` (or its missing directory), not the temporary file."""
    target = os.path.realpath(path)
    prefix = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.")
    try:
        with atomic_output(path, mode) as fh:
            yield fh
    except OSError as exc:
        if not (isinstance(exc.filename, str) and exc.filename.startswith(prefix)):
            raise
        folder = os.path.dirname(path) or "."
        if isinstance(exc, FileNotFoundError) and not os.path.isdir(folder):
            raise FileNotFoundError(errno.ENOENT, f"cannot write {path!r}: no directory {folder!r}; create it "
                                                  f"first or name another path") from None
        exc.filename, exc.filename2 = path, None
        raise


def _print(obj: Any) -> None:
    print(json.dumps(obj, indent=2, allow_nan=False))


def _warn_invalid(summary: dict[str, Any], events: str) -> None:
    if summary.get("invalid"):
        reasons = ", ".join(f"{reason} {n}" for reason, n in summary["invalid_reasons"].items())
        where = f"; line numbers in {summary['report']}" if summary.get("report") else ""
        print(f"gnnstream: warning: skipped {summary['invalid']} invalid lines of {events} ({reasons}){where}",
              file=sys.stderr)


# ---------------------------------------------------------------------- handlers
def _graph_load(args: argparse.Namespace) -> int:
    from gnnstream.workers.offline.jobs import load_events
    summary = load_events(args.state, events_path(args.events), seed=args.seed, model_dir=args.model, batch=args.batch,
                          report=args.report, dead_letters=args.dead_letters, edge_ttl=args.edge_ttl,
                          workers=args.workers)
    _print(summary)
    _warn_invalid(summary, args.events)
    return 0


def _graph_show(args: argparse.Namespace) -> int:
    from gnnstream.workers.state import open_store
    with open_store(args.state, create=False, read_only=True) as store:
        if not store.exists(args.node):
            print(f"gnnstream: error: node {args.node!r} does not exist in state {args.state!r} (ids are matched "
                  f"exactly, as strings)", file=sys.stderr)
            return 2
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


def _backfill(args: argparse.Namespace) -> int:
    from gnnstream.workers.offline.jobs import backfill
    _print(backfill(args.state, args.model, publish=args.publish, device=args.device))
    return 0


def _embeddings(args: argparse.Namespace) -> int:
    from gnnstream.workers.offline.jobs import export_embeddings
    if args.out == "-":
        count = export_embeddings(args.state, sys.stdout)
    else:
        with _output(args.out) as fh:
            count = export_embeddings(args.state, fh)
    print(json.dumps({"embeddings": count, "out": args.out}), file=sys.stderr)
    return 0


def _apply(args: argparse.Namespace) -> int:
    from gnnstream.workers.offline.jobs import apply_events
    summary = apply_events(args.state, args.model, events_path(args.events), batch=args.batch, seed=args.seed,
                           hub_bound=args.hub_bound, report=args.report, dead_letters=args.dead_letters,
                           edge_ttl=args.edge_ttl)
    _print(summary)
    _warn_invalid(summary, args.events)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from gnnstream.workers.offline.jobs import VERIFY_EXIT, verify
    summary = verify(args.state, args.model, atol=args.atol)
    _print(summary)
    return VERIFY_EXIT[summary["status"]]


def _snapshot(args: argparse.Namespace) -> int:
    from gnnstream.graph_state.snapshot import snapshot
    _print(snapshot(args.state, args.out))
    return 0


def _events_from_snap(args: argparse.Namespace) -> int:
    from gnnstream.stream.events import encode_event
    from gnnstream.stream.snap import read_snap, snap_events
    rows = read_snap(args.csv)
    if args.limit:
        rows = rows[: args.limit]
    count = 0
    with _output(args.out, "wb") as fh:
        for ev in snap_events(rows, with_features=not args.no_features):
            fh.write(encode_event(ev) + b"\n")
            count += 1
    _print({"ratings": len(rows), "events": count, "out": args.out})
    return 0


def _broker(args: argparse.Namespace) -> int:
    from gnnstream.stream.broker import run_broker_foreground
    return run_broker_foreground(args.port)


def _run(args: argparse.Namespace) -> int:
    from gnnstream.workers.settings import settings_from_args
    from gnnstream.workers.runtime.worker import Worker
    worker = Worker(settings_from_args(args))
    worker.install_signal_handlers()
    _print(worker.run(max_idle_s=args.exit_when_idle))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from gnnstream.workers.query.server import bind, serve
    if not args.query_port:
        raise ValueError("serve needs a port: pass --query-port PORT or set GNNSTREAM_QUERY_PORT")
    sock = bind(args.query_host, args.query_port)
    before = signal.signal(signal.SIGTERM, lambda *_: None)  # the server stops on it and returns: exit 0
    try:
        serve(args.state, args.model, sock, refresh_s=args.refresh, limits=http_limits(args))
    finally:
        sock.close()
        signal.signal(signal.SIGTERM, before)
    return 0


def _produce(args: argparse.Namespace) -> int:
    from gnnstream.workers.offline.replay import produce_file
    _print(produce_file(args.bootstrap, args.file, topic=args.events_topic, fmt=args.format, rate=args.rate,
                        partitions=args.partitions, limit=args.limit, kafka_client=args.kafka_client))
    return 0


def _tail(args: argparse.Namespace) -> int:
    from gnnstream.workers.offline.replay import tail_embeddings, wait_for_topic
    topic = args.output_topic
    if not topic:
        from gnnstream.stream.rollout import version_topic
        from gnnstream.workers.rollout.commands import status
        from gnnstream.workers.rollout.topic import RolloutError
        model = args.model_id or status(bootstrap=args.bootstrap, control_topic=args.control_topic,
                                        kafka_client=args.kafka_client).serving
        if model is None:
            raise RolloutError(f"no worker has recorded a version in topic {args.control_topic!r} yet; name one "
                               f"with --model-id NAME:VERSION or the topic with --output-topic")
        topic = version_topic(model)
    wait_for_topic(args.bootstrap, topic, timeout_s=args.idle)
    tail_embeddings(args.bootstrap, topic=topic, from_beginning=args.from_beginning,
                    max_messages=args.max, idle_s=args.idle, kafka_client=args.kafka_client)
    return 0


# ---------------------------------------------------------------------- parser
def _state_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state", required=True, metavar="DIR", help="graph state directory (RocksDB)")


def _invalid_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", default=None, metavar="FILE.jsonl",
                   help="where the skipped lines are listed, one JSON object each with file, line, reason and "
                        "detail (default: STATE/invalid-NAME.jsonl for EVENTS file NAME.jsonl, written only "
                        "when a line is skipped)")
    p.add_argument("--dead-letters", default=None, metavar="FILE.jsonl",
                   help="also append each skipped line to this JSONL file: the line itself (value, or "
                        "value_base64 when not UTF-8) with file, line, reason and detail")


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
    p = gsub.add_parser("load", help="apply a JSONL event file to the graph store (no embeddings)",
                        description="Apply a JSONL event file to the graph store (created if missing), without "
                                    "embeddings. Invalid lines are skipped and counted, never a stop. Into a state "
                                    "that holds no graph yet, the events up to the first node_delete are written "
                                    "as RocksDB table files and ingested in one step (a load cut short leaves a "
                                    "state that refuses to open: delete it and load again); the rest goes in "
                                    "atomic batches.")
    _state_arg(p)
    p.add_argument("events", metavar="EVENTS.jsonl", help="one JSON event per line (see docs/design.md)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="model the state is for: a new state takes its sampling seed, features must have its "
                        "in_dim, and the state records it (the default of --model for apply, run, verify...)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed of a new state without --model (default 0); with --model it must be the "
                        "model's")
    p.add_argument("--batch", type=whole_number(1), default=1000,
                   help="events per atomic batch after the table files (default 1000)")
    p.add_argument("--workers", type=whole_number(1), default=None,
                   help="processes of a load into a new state, each writing a range of every family's table "
                        "files (default: one per core this process may use; 1: this process alone); the state is "
                        "the same for any number")
    _edge_ttl_arg(p)
    _invalid_args(p)
    p.set_defaults(func=_graph_load)
    p = gsub.add_parser("show", help="print a node's neighbours, sample and features as JSON (read-only)")
    _state_arg(p)
    p.add_argument("node", metavar="NODE", help="node id")
    p.add_argument("--fanout", type=whole_number(0), default=10, help="sample size k to show (default 10)")
    p.add_argument("--limit", type=whole_number(0), default=100, help="at most this many neighbours (default 100)")
    p.set_defaults(func=_graph_show)

    add_model_commands(sub)

    p = sub.add_parser("backfill", help="recompute every node's embedding from scratch",
                       description="Recompute every node's embedding from scratch with --model and store them. "
                                   "The one way to switch a state to another model (other commands refuse a "
                                   "model other than the one whose embeddings the state holds).")
    _state_arg(p)
    p.add_argument("--model", required=True, metavar="DIR", help="model directory (becomes the state's model)")
    p.add_argument("--publish", action="store_true", help="also queue every embedding for publishing")
    p.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="where the layers run: cpu (default) or cuda (a GPU torch can see; the same layers, "
                        "equal to the CPU's up to float rounding)")
    p.set_defaults(func=_backfill)

    p = sub.add_parser("embeddings", help="export final embeddings as JSON lines (read-only)")
    _state_arg(p)
    p.add_argument("--out", required=True, metavar="FILE.jsonl",
                   help="output file, replaced only once complete; - for stdout")
    p.set_defaults(func=_embeddings)

    p = sub.add_parser("apply", help="apply an event file and recompute incrementally (resumable)",
                       description="Apply an event file and recompute incrementally; rerunning continues where "
                                   "the last run stopped. Invalid lines (a node_upsert whose feature count is not "
                                   "the model's in_dim included) are skipped and counted, never a stop.")
    _state_arg(p)
    p.add_argument("events", metavar="EVENTS.jsonl", help="one JSON event per line (see docs/design.md)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="model directory (default: the one the state uses; needed to create a state; a model "
                        "other than the state's is refused: switch with backfill)")
    p.add_argument("--batch", type=whole_number(1), default=1000, help="events per batch (default 1000)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed; must be the model's (default: the model's)")
    p.add_argument("--hub-bound", type=whole_number(0), default=50_000,
                   help="dependents above which hub propagation is deferred and coalesced (default 50000)")
    _edge_ttl_arg(p)
    _invalid_args(p)
    p.set_defaults(func=_apply)

    p = sub.add_parser("verify", help="recompute from scratch in memory and compare with stored embeddings",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Recompute every embedding from scratch in memory and compare with the stored "
                                   "ones.\nThe state is opened read-only: verify never creates or changes it.",
                       epilog="exit status (and \"status\" in the JSON summary):\n"
                              "  0  ok        every stored embedding matches\n"
                              "  1  mismatch  a stored row differs, is missing, is not finite (NaN/inf) or fails\n"
                              "               its check, with no work pending to explain it\n"
                              "  2  error     no state there, another model than the state's, a locked state...\n"
                              "  3  pending   dirty marks wait (\"pending_dirty\": N) and every stored row is\n"
                              "               finite: let `gnnstream run` or `gnnstream apply` finish the work,\n"
                              "               then verify again")
    _state_arg(p)
    p.add_argument("--model", default=None, metavar="DIR",
                   help="model directory (default: the one the state uses); another model than the state's is "
                        "an error, not a switch")
    p.add_argument("--atol", type=finite_number(0), default=1e-4,
                   help="max abs difference allowed, a number >= 0 (default 1e-4)")
    p.set_defaults(func=_verify)

    p = sub.add_parser("snapshot", help="copy a state directory, also while a worker runs on it",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Copy the state directory --state to the new directory --out, which a new "
                                   "worker (or apply, serve,\nverify) can start from. It works beside a running "
                                   "worker: it takes no lock and writes\nnothing to --state. The copy holds the "
                                   "state as of one batch the worker had committed when\nthe snapshot started: "
                                   "its stored offsets say where. A worker started on the copy resumes\nfrom the "
                                   "copy's stored offsets (not from its consumer group's committed ones) and first "
                                   "finishes\nthe work the copy holds: dirty marks, outbox entries not yet "
                                   "published, and rows that changed\nin the row files while they were copied "
                                   "(found by their checksums and recomputed).",
                       epilog="The copy is written to a temporary directory beside --out and renamed once "
                              "complete: a failed\nsnapshot leaves nothing behind. To add a worker to a running "
                              "group, start it on the copy with\nthe group's --group and a --worker-id of its own "
                              "(docs/scaling.md).")
    _state_arg(p)
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the new state directory: must not exist, or be empty; not inside --state")
    p.set_defaults(func=_snapshot)

    from gnnstream.workers.rollout.cli import add_rollout_parser
    add_rollout_parser(sub)

    ev = sub.add_parser("events", help="build event files")
    esub = ev.add_subparsers(dest="events_command", required=True, metavar="SUBCOMMAND")
    p = esub.add_parser("from-snap", help="turn a SNAP signed-network CSV into JSONL events with node features")
    p.add_argument("csv", metavar="FILE.csv", help="SNAP signed-network CSV, plain or gzipped: lines "
                                                  "SOURCE,TARGET,RATING,TIME")
    p.add_argument("--out", required=True, metavar="EVENTS.jsonl", help="output file, replaced only once complete")
    p.add_argument("--limit", type=whole_number(0, None, "0 = all"), default=0,
                   help="only the first N ratings by time (default 0: all)")
    p.add_argument("--no-features", action="store_true", help="edges only")
    p.set_defaults(func=_events_from_snap)

    _streaming_commands(sub)
    for entry in entry_points(group="gnnstream.commands"):  # commands of packages built on this one
        entry.load()(sub)
    _describe(parser)
    return parser


def _describe(parser: argparse.ArgumentParser) -> None:
    """Give every command without a description of its own its one-line help as one, so that its ``--help``
    says what it does."""
    for action in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, command in action.choices.items():
            if not command.description and helps.get(name):
                text = helps[name]
                command.description = text[0].upper() + text[1:] + "."
            _describe(command)


def _edge_ttl_arg(p: argparse.ArgumentParser) -> None:
    from gnnstream.workers.settings import add_worker_arguments
    add_worker_arguments(p, only=("edge_ttl",))


def _streaming_commands(sub: Any) -> None:
    from gnnstream.workers.settings import add_worker_arguments

    p = sub.add_parser("broker", help="run the embedded Kafka-protocol broker (Tansu) in the foreground; Ctrl-C stops it")
    p.add_argument("--port", type=port_number(None), default=None,
                   help="loopback port, 1..65535 (default: a free one, printed)")
    p.set_defaults(func=_broker)

    p = sub.add_parser("run", help="run the streaming worker: consume graph events, publish embeddings",
                       description="Consume graph events from Kafka, keep the graph in RocksDB, recompute exactly "
                                   "the embeddings each event changes and publish them. Every option falls back "
                                   "to the GNNSTREAM_* environment variable shown.")
    add_worker_arguments(p)
    p.add_argument("--exit-when-idle", type=finite_number(0), default=None, metavar="SECONDS",
                   help="stop after this many seconds without events (default: run until SIGTERM/SIGINT)")
    p.set_defaults(func=_run)

    p = sub.add_parser("serve", help="serve the query API from a state, beside its worker (read-only)",
                       description="Serve GET /v1/embeddings/ID, POST /v1/infer (exact what-if inference) and "
                                   "GET /v1/nodes/ID/sample from a state directory, without writing it: next to a "
                                   "running worker (which `run --query-port` does for you) or on a stopped state.")
    add_worker_arguments(p, only=("state", "model", "query_port", "query_host"))
    p.add_argument("--refresh", type=finite_number(0.01), default=0.5, metavar="SECONDS",
                   help="how often to catch up with the worker's writes (default 0.5)")
    add_http_limits(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("produce", help="produce events from a JSONL file or a SNAP CSV to Kafka")
    add_worker_arguments(p, only=("bootstrap", "kafka_client", "events_topic", "partitions"))
    p.add_argument("file", metavar="FILE", help="JSONL events, or a SNAP signed-network CSV with --format snap")
    p.add_argument("--format", choices=["jsonl", "snap"], default="jsonl",
                   help="jsonl (default) or snap: replayed in time order with derived node features")
    p.add_argument("--rate", type=finite_number(0), default=0.0,
                   help="events per second (default 0: as fast as possible)")
    p.add_argument("--limit", type=whole_number(0, None, "0 = all"), default=0,
                   help="only the first N events (default 0: all)")
    p.set_defaults(func=_produce)

    p = sub.add_parser("tail", help="print embedding updates readably")
    add_worker_arguments(p, only=("bootstrap", "kafka_client", "output_topic", "control_topic"))
    p.add_argument("--model-id", default=None, metavar="NAME:VERSION",
                   help="print that version's updates (its topic); default: the serving version's, as the rollout "
                        "topic records it")
    p.add_argument("--from-beginning", action="store_true", help="start at the earliest update")
    p.add_argument("--max", type=whole_number(0, None, "0 = no limit"), default=0,
                   help="stop after N updates (default 0: never)")
    p.add_argument("--idle", type=finite_number(0, "0 = never"), default=0.0,
                   help="stop after this many seconds without an update, counted once the consumer has "
                        "partitions; a topic that still does not exist after this long is an error (default 0: "
                        "never; a missing topic is waited for)")
    p.set_defaults(func=_tail)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(logging.INFO if args.verbose else logging.WARNING)
    tune_collector()
    try:
        status = args.func(args)
        sys.stdout.flush()
        return status
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            return _STATUS_SIGPIPE
        message = _error_line(exc, args)
        if message is None or args.verbose:
            raise
        print(f"gnnstream: error: {message}", file=sys.stderr)
        return 2


_STATUS_SIGPIPE = 128 + signal.SIGPIPE  # what the shell reports for a command ended by SIGPIPE, as `cat | head`


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (``gnnstream ... | head``); then it is left quietly."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if not any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0)):
            return False
    except (OSError, ValueError, AttributeError):  # no file descriptor (captured), or no poll()
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)  # the interpreter's last flush at exit must not fail again
    os.dup2(devnull, fd)
    os.close(devnull)
    return True


# RocksDB reports errors as plain ``Exception`` whose text starts with its status
_ROCKSDB_STATUS = ("IO error", "Corruption", "Not implemented", "Invalid argument", "Resource busy", "NotFound",
                   "Operation aborted", "Operation timed out", "Try again", "Shutdown in progress",
                   "Result incomplete", "Operation expired", "No space")


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _error_line(exc: BaseException, args: argparse.Namespace) -> str | None:
    """The one-line message for an error the user can act on; None for anything else (a bug: traceback)."""
    from gnnstream.graph_state.exceptions import GraphStateError
    from gnnstream.model import ModelError
    from gnnstream.stream.exceptions import StreamError
    from gnnstream.workers.engine import EngineError
    try:
        from kafka.errors import KafkaError
    except ImportError:  # pragma: no cover - kafka-python is a dependency
        KafkaError = StreamError
    state = getattr(args, "state", None)
    text = _one_line(exc)
    if isinstance(exc, (GraphStateError, ModelError, EngineError, StreamError)):
        return text
    if isinstance(exc, KafkaError):
        where = f" at {args.bootstrap}" if getattr(args, "bootstrap", None) else ""
        name = type(exc).__name__
        detail = text if name in text else f"{name}: {text}" if text else name  # kafka-python's text names it
        return f"Kafka: {detail}; check that the broker{where} is running and reachable, then run the command again"
    if isinstance(exc, OSError):
        code = exc.errno or next((c for c in (errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EDQUOT)
                                  if f"(os error {c})" in text), 0)  # rocksdict's OSError has no errno
        hint = {errno.ENOSPC: "free some space, then run the command again",
                errno.EDQUOT: "free some space, then run the command again",
                errno.EACCES: "check the owner and permissions of that path",
                errno.EPERM: "check the owner and permissions of that path",
                errno.EROFS: "the file system is read-only; RocksDB writes small files even to open a state, so "
                             "copy it to a writable directory"}.get(code)
        where = f"state directory {state!r}: " if state and code and not exc.filename else ""
        return f"{where}{text}; {hint}" if hint else text
    if type(exc) is Exception and (text.startswith(_ROCKSDB_STATUS) or "(os error " in text):
        return _rocksdb_line(text, state)  # RocksDB's status, or an OS error as rocksdict reports it
    if isinstance(exc, ValueError):
        return text
    return None


def _rocksdb_line(text: str, state: str | None) -> str:
    where = f"state directory {state!r}" if state else "the state directory"
    low = text.lower()
    if "lock" in low and ("resource temporarily unavailable" in low or "while lock" in low or "lock hold" in low):
        return (f"{where} is locked by another process ({text}); stop the other gnnstream process using it "
                f"(one process per state)")
    if text.startswith("Corruption") or "checksum" in low or "corrupt" in low:
        from gnnstream.graph_state.db import REMEDY, state_corrupted
        if state:
            return _one_line(state_corrupted(state, text))  # names the damaged file and the remedy
        return f"{where} is damaged ({text}); {REMEDY}"
    if "no space left" in low or "disk quota" in low:
        return (f"no space left writing {where} ({text}); free some space, then run the command again (it "
                f"resumes from the last committed batch)")
    if "writer has previous error" in low:  # RocksDB refuses every write after one failed, until reopened
        return (f"cannot write {where} ({text}): an earlier write failed, most often on a full disk; free some "
                f"space, then run the command again (it resumes from the last committed batch)")
    if "read-only file system" in low:
        return f"cannot write {where} ({text}): the file system is read-only; use a writable --state path"
    if "permission denied" in low:
        return f"cannot write {where} ({text}); check the owner and permissions of the directory"
    return f"RocksDB error in {where}: {text}"


if __name__ == "__main__":
    sys.exit(main())
