"""Worker settings: the one place that reads the environment.

Every option of ``gnnstream run`` has a ``GNNSTREAM_*`` environment variable;
a command-line flag wins over the variable, the variable over the default.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import stat
from dataclasses import dataclass, fields
from typing import Any, Callable

from gnnstream.stream.backends import DEFAULT_KAFKA_CLIENT, KAFKA_CLIENTS
from gnnstream.stream.clients import MAX_MESSAGE_BYTES

__all__ = ["WorkerSettings", "add_worker_arguments", "settings_from_args", "ENV_PREFIX", "whole_number",
           "fanout_list", "model_name", "model_version", "LOG_FORMAT", "configure_logging", "events_path",
           "finite_number", "port_number", "schema_file"]

ENV_PREFIX = "GNNSTREAM_"


@dataclass(frozen=True)
class WorkerSettings:
    """Configuration of one streaming worker."""

    bootstrap: str = "localhost:9092"
    kafka_client: str = DEFAULT_KAFKA_CLIENT
    state: str = "./state"
    model: str | None = None
    events_topic: str = "graph-events"
    output_topic: str = ""
    control_topic: str = "gnnstream-rollout"
    dlq_topic: str = "graph-events-dlq"
    transaction_topic: str = "transaction-scores"
    group: str = "gnnstream"
    worker_id: str = ""
    partitions: int = 4
    batch_size: int = 1000
    max_batch_size: int = 10_000
    batch_wait_ms: int = 200
    max_latency_ms: int = 1000
    output_format: str = "json"
    metrics_port: int = 9108
    metrics_host: str = "127.0.0.1"
    query_port: int = 0
    query_host: str = "127.0.0.1"
    hub_bound: int = 50_000
    max_staleness_s: float = 5.0
    session_timeout_ms: int = 6000
    max_event_bytes: int = 1 << 20
    max_message_bytes: int = MAX_MESSAGE_BYTES
    broker_wait_s: float = 0.0
    on_offset_reset: str = "fail"
    drain_timeout_s: float = 20.0
    min_change: float = 0.0
    edge_ttl: int | None = None

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)} (got {value!r}); set "
                                 f"--{name.replace('_', '-')} or {_env_name(name)}")
        for name, (low, high, note) in _BOUNDS.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if not _within(value, low, high):
                kind = _OPTIONAL.get(name) or type(getattr(WorkerSettings, name))
                raise ValueError(f"{name} must be {_describe(kind, low, high, note)} (got {value!r}); set "
                                 f"--{name.replace('_', '-')} or {_env_name(name)}")


_HELP = {
    "edge_ttl": "the edge window in seconds of event time: an edge is kept while its latest ts is within this of "
                "the stream time; fixed when a state is created (0 = no window; default: as the state holds, no "
                "window for a new one)",
    "bootstrap": "Kafka bootstrap servers host:port[,host:port]",
    "kafka_client": "Kafka client library: kafka-python (pure Python) or confluent (confluent-kafka, librdkafka)",
    "state": "graph state directory (RocksDB), the source of truth",
    "model": "model directory (config.json + weights.pt); default: the one the state uses (a new state needs "
             "it)",
    "events_topic": "topic of graph events",
    "output_topic": "topic embeddings are published to (default: the model version's own topic, "
                    "node-embeddings.NAME.vVERSION; see docs/operations.md, Model rollout)",
    "control_topic": "topic where workers record their progress and `gnnstream rollout` its steps, for "
                     "`gnnstream rollout status` (empty = do not record)",
    "dlq_topic": "dead-letter topic for invalid events",
    "transaction_topic": "topic of the transaction scores of a typed model with a transaction head: a score per "
                         "applied edge_upsert of its scored relation (docs/design.md, Typed graphs)",
    "group": "the group of workers that share the output: a Kafka consumer group over the output topic's "
             "partitions; each worker of it keeps the whole graph and publishes the nodes of the partitions it is "
             "assigned (see docs/scaling.md)",
    "worker_id": "this worker's name within its group, sent in the gnnstream.worker header of every message it "
                 "publishes (default: host name and state directory name)",
    "partitions": "partitions of topics created when missing",
    "batch_size": "events per micro-batch under light load (the first poll's size and the smallest target)",
    "max_batch_size": "largest micro-batch: under a backlog the batch target doubles after every full poll up "
                      "to this (updates of one node within a batch coalesce); below batch_size, batch_size",
    "batch_wait_ms": "how long a poll waits for a first record when none is there, in ms (how often an idle "
                     "worker wakes); --max-latency-ms decides how long it waits for more",
    "max_latency_ms": "freshness bound of dynamic micro-batching, in ms: batches grow only as far as their "
                      "records' wait plus their predicted time stays within it, and a light poll waits for more "
                      "records up to half of it (0 = no bound: a poll takes what is there; docs/operations.md, "
                      "Batch size and the latency bound)",
    "output_format": "embedding encoding: json, binary (raw float32) or packed (many updates a message), see "
                     "stream/updates.py",
    "metrics_port": "port of the Prometheus /metrics and /healthz endpoint (0 = off)",
    "metrics_host": "address the /metrics and /healthz endpoint binds (0.0.0.0 = every interface)",
    "query_port": "port of the query API (GET /v1/embeddings/ID, POST /v1/infer, GET /v1/nodes/ID/sample), "
                  "served by a process of its own from the worker's state (0 = off; see README)",
    "query_host": "address the query API binds (0.0.0.0 = every interface)",
    "hub_bound": "dependents above which a hub's propagation is deferred and coalesced",
    "max_staleness_s": "longest a deferred hub propagation may wait, in seconds",
    "session_timeout_ms": "consumer-group session timeout in ms",
    "max_event_bytes": "events larger than this go to the dead-letter topic",
    "max_message_bytes": "largest record the worker's producers send (librdkafka message.max.bytes, kafka-python "
                         "max_request_size); keep it at most the broker's and the topics' max.message.bytes. "
                         "An embedding update must fit (checked at start); a dead letter that does not is cut "
                         "to fit",
    "broker_wait_s": "at start, give up after this many seconds without reaching Kafka (0 = keep retrying "
                     "for ever; /healthz answers 503 meanwhile)",
    "on_offset_reset": "what to do when a stored offset is past the end of its partition (the topic or "
                       "broker was replaced): fail = stop with an error, earliest = read the partition "
                       "from its start, latest = skip to its end",
    "drain_timeout_s": "on SIGTERM/SIGINT, at most this many seconds to finish and publish deferred hub work "
                       "before exiting; keep it below the orchestrator's stop grace period (a recompute pass "
                       "already started completes; what is left stays recorded and the next start does it; "
                       "a second signal skips the drain; 0 = do not drain)",
    "min_change": "output volume control: publish a node's update only when its embedding moved by more than "
                  "this relative L2 change since the version last published for it (||new - last|| > "
                  "min_change * ||last||); deletes, mode changes and each node's first update after a start are "
                  "always published, the store and verify stay exact (0 = publish every update; see "
                  "docs/design.md)",
}


_CHOICES = {"kafka_client": KAFKA_CLIENTS, "output_format": ("json", "binary", "packed"),
            "on_offset_reset": ("fail", "earliest", "latest")}


# the range of each numeric setting: (lowest, highest or None, what 0 means or "")
_BOUNDS: dict[str, tuple[float, float | None, str]] = {
    "partitions": (1, None, ""),
    "batch_size": (1, None, ""),
    "max_batch_size": (1, None, ""),
    "batch_wait_ms": (0, None, ""),
    "max_latency_ms": (0, None, "0 = no bound"),
    "metrics_port": (0, 65535, "0 = off"),
    "query_port": (0, 65535, "0 = off"),
    "hub_bound": (0, None, ""),
    "max_staleness_s": (0, None, ""),
    "session_timeout_ms": (1, 3_600_000, ""),  # librdkafka's range
    "max_event_bytes": (1, None, ""),
    "max_message_bytes": (4096, 1_000_000_000, ""),  # librdkafka's range, less room for a dead letter's headers
    "broker_wait_s": (0, None, "0 = keep retrying"),
    "drain_timeout_s": (0, None, "0 = do not drain"),
    "min_change": (0, None, ""),
    "edge_ttl": (0, None, "0 = no window"),
}
_OPTIONAL = {"edge_ttl": int}  # settings whose default None means "as the state holds", with their type


def _within(value: float, low: float, high: float | None) -> bool:
    return math.isfinite(value) and value >= low and (high is None or value <= high)  # NaN fails too


def _describe(kind: type, low: float, high: float | None, note: str = "") -> str:
    what = "a finite number" if kind is float else "a port" if high == 65535 else "an integer"
    span = f"in {low}..{high}" if high is not None else f">= {low}"
    return f"{what} {span}" + (f" ({note})" if note else "")


class _FromEnv(str):
    """A flag's default taken from its environment variable, so that a bad value names the variable."""

    env = ""


def _bounded(kind: type, low: float, high: float | None = None, note: str = "") -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not _within(value, low, high):
            where = f" from {text.env}" if isinstance(text, _FromEnv) else ""
            raise argparse.ArgumentTypeError(f"expected {_describe(kind, low, high, note)} (got {text!r}{where})")
        return value
    return parse


def whole_number(low: int, high: int | None = None, note: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``low..high`` (``high`` None: no limit); ``note`` says what a value
    means, e.g. ``"0 = all"``."""
    return _bounded(int, low, high, note)


def finite_number(low: float, note: str = "") -> Callable[[str], float]:
    """An argparse ``type``: a finite float ``>= low`` (NaN and infinities are refused)."""
    return _bounded(float, low, None, note)


def port_number(zero: str | None) -> Callable[[str], int]:
    """An argparse ``type``: a TCP port, 1..65535, or 0..65535 where ``zero`` says what 0 means."""
    return _bounded(int, 0 if zero else 1, 65535, f"0 = {zero}" if zero else "")


def fanout_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 25,10 (got {text!r})") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative fanouts like 25,10 (got {text!r})")
    return values


def model_name(text: str) -> str:
    from gnnstream.stream.rollout import version_topic
    try:
        version_topic(f"{text}:1")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a name of letters, digits, '.', '_' or '-' like otc-sage "
                                         f"(got {text!r})") from None
    return text


def model_version(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative whole number like 2 (got {text!r})")
    return int(text)


def schema_file(path: str) -> dict[str, Any]:
    """The graph schema in a JSON file (``schema.json``), checked as a model checks it."""
    import json

    from gnnstream.model.exceptions import InvalidModelConfig
    from gnnstream.model.schema import GraphSchema
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return GraphSchema.from_dict(data).to_dict()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read schema file {path!r}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"schema file {path!r} is not JSON ({exc})") from None
    except InvalidModelConfig as exc:
        raise argparse.ArgumentTypeError(f"{path}: {exc}") from None


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int) -> None:
    """Log records of ``level`` and above on stderr, in the one format of every gnnstream process."""
    logging.basicConfig(level=level, format=LOG_FORMAT)


def events_path(path: str) -> str:
    """Refuse an events path that exists but is no regular file (a directory, a device, a pipe)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return path  # a missing file is reported by the command, before it creates anything
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "no regular file")
        raise ValueError(f"events file {path!r} is {kind}; name a regular file of JSON lines, one event each")
    return path



def _env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def add_worker_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """Add a flag per setting (``--batch-size`` …), defaulting to its environment variable."""
    for f in fields(WorkerSettings):
        if only is not None and f.name not in only:
            continue
        env = _env_name(f.name)
        kind = _OPTIONAL.get(f.name) or (type(f.default) if f.default is not None else str)
        # a string default is parsed by argparse like the flag: a bad value is a usage error, not a traceback
        default: Any = f.default
        if env in os.environ:
            default = _FromEnv(os.environ[env])
            default.env = env
        flag = "--" + f.name.replace("_", "-")
        extra: dict[str, Any] = {}
        if f.name in _CHOICES:
            extra["choices"] = list(_CHOICES[f.name])
        if f.name in _BOUNDS:
            kind = _bounded(kind, *_BOUNDS[f.name])
        if f.default not in (None, ""):
            shown = f"; default {f.default}"
        else:  # the help text says what happens when it is not set
            shown = "" if "default" in _HELP[f.name] else "; default unset"
        parser.add_argument(flag, dest=f.name, type=kind, default=default, help=f"{_HELP[f.name]} (env {env}{shown})",
                            **extra)


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    values = {f.name: getattr(args, f.name) for f in fields(WorkerSettings) if hasattr(args, f.name)}
    return WorkerSettings(**values)
