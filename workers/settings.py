"""Worker settings: the one place that reads the environment.

Every option of ``gnnstream run`` has a ``GNNSTREAM_*`` environment variable;
a command-line flag wins over the variable, the variable over the default.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, fields
from typing import Any

from stream.backends import DEFAULT_KAFKA_CLIENT, KAFKA_CLIENTS

__all__ = ["WorkerSettings", "add_worker_arguments", "settings_from_args", "ENV_PREFIX"]

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
    group: str = "gnnstream"
    worker_id: str = ""
    partitions: int = 4
    batch_size: int = 1000
    max_batch_size: int = 10_000
    batch_wait_ms: int = 200
    output_format: str = "json"
    metrics_port: int = 9108
    metrics_host: str = "127.0.0.1"
    query_port: int = 0
    query_host: str = "127.0.0.1"
    hub_bound: int = 50_000
    max_staleness_s: float = 5.0
    session_timeout_ms: int = 6000
    max_event_bytes: int = 1 << 20
    broker_wait_s: float = 0.0
    on_offset_reset: str = "fail"
    drain_timeout_s: float = 20.0
    min_change: float = 0.0

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)} (got {value!r}); set "
                                 f"--{name.replace('_', '-')} or {_env_name(name)}")
        for name in ("batch_size", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)!r}); set "
                                 f"--{name.replace('_', '-')} or {_env_name(name)}")
        for name in ("broker_wait_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)!r}); set "
                                 f"--{name.replace('_', '-')} or {_env_name(name)}")
        if not 0 <= self.min_change < math.inf:  # NaN fails too
            raise ValueError(f"min_change must be a finite number >= 0 (got {self.min_change!r}); set "
                             f"--min-change or {_env_name('min_change')}")


_HELP = {
    "bootstrap": "Kafka bootstrap servers host:port[,host:port]",
    "kafka_client": "Kafka client library: kafka-python (pure Python) or confluent (confluent-kafka, librdkafka)",
    "state": "graph state directory (RocksDB), the source of truth",
    "model": "model directory (config.json + weights.pt); default: the one the state uses",
    "events_topic": "topic of graph events",
    "output_topic": "topic embeddings are published to (default: the model version's own topic, "
                    "node-embeddings.NAME.vVERSION; see docs/operations.md, Model rollout)",
    "control_topic": "topic where workers record their progress and `gnnstream rollout` its steps, for "
                     "`gnnstream rollout status` (empty = do not record)",
    "dlq_topic": "dead-letter topic for invalid events",
    "group": "the group of workers that share the output: a Kafka consumer group over the output topic's "
             "partitions; each worker of it keeps the whole graph and publishes the nodes of the partitions it is "
             "assigned (see docs/scaling.md)",
    "worker_id": "this worker's name within its group, sent in the gnnstream.worker header of every message it "
                 "publishes (default: host name and state directory name)",
    "partitions": "partitions of topics created when missing",
    "batch_size": "events per micro-batch under light load (the first poll's size and the smallest target)",
    "max_batch_size": "largest micro-batch: under a backlog the batch target doubles after every full poll up "
                      "to this (updates of one node within a batch coalesce); below batch_size, batch_size",
    "batch_wait_ms": "max wait for a micro-batch to fill, in ms",
    "output_format": "embedding encoding: json or binary (raw float32, see stream/updates.py)",
    "metrics_port": "port of the Prometheus /metrics and /healthz endpoint (0 = off)",
    "metrics_host": "address the /metrics and /healthz endpoint binds (0.0.0.0 = every interface)",
    "query_port": "port of the query API (GET /v1/embeddings/ID, POST /v1/infer, GET /v1/nodes/ID/sample), "
                  "served by a process of its own from the worker's state (0 = off; see README)",
    "query_host": "address the query API binds (0.0.0.0 = every interface)",
    "hub_bound": "dependents above which a hub's propagation is deferred and coalesced",
    "max_staleness_s": "longest a deferred hub propagation may wait, in seconds",
    "session_timeout_ms": "consumer-group session timeout in ms",
    "max_event_bytes": "events larger than this go to the dead-letter topic",
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


_CHOICES = {"kafka_client": KAFKA_CLIENTS, "output_format": ("json", "binary"),
            "on_offset_reset": ("fail", "earliest", "latest")}


def _env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def add_worker_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """Add a flag per setting (``--batch-size`` …), defaulting to its environment variable."""
    for f in fields(WorkerSettings):
        if only is not None and f.name not in only:
            continue
        env = _env_name(f.name)
        kind = type(f.default) if f.default is not None else str
        # a string default is parsed by argparse like the flag: a bad value is a usage error, not a traceback
        default = os.environ.get(env, f.default)
        flag = "--" + f.name.replace("_", "-")
        extra: dict[str, Any] = {}
        if f.name in _CHOICES:
            extra["choices"] = list(_CHOICES[f.name])
        parser.add_argument(flag, dest=f.name, type=kind, default=default,
                            help=f"{_HELP[f.name]} (env {env}; default {f.default if f.default != '' else 'unset'})",
                            **extra)


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    values = {f.name: getattr(args, f.name) for f in fields(WorkerSettings) if hasattr(args, f.name)}
    return WorkerSettings(**values)
