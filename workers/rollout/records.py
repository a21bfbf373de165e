"""What a worker records of a rollout: in its state, the marker it passed; in the rollout topic, its progress.

A worker stores the serving version and the number of the last rollout marker
it passed with the offsets past the marker (one write), and reports its
progress to the rollout topic every few seconds (:func:`worker_report`), which
`gnnstream rollout status` shows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import numpy as np
import orjson

from gnnstream.graph_state import keys
from gnnstream.graph_state.transaction import Transaction
from gnnstream.stream.rollout import Marker

if TYPE_CHECKING:
    from gnnstream.graph_state.store import GraphStore

__all__ = ["SERVING_META", "ROLLOUT_META", "stored_rollout", "record_rollout", "WorkerProgress", "worker_report"]

SERVING_META = keys.META_SERVING  # the serving version as of the last marker passed
ROLLOUT_META = keys.META_ROLLOUT  # the number of that marker
_LATENCY_WINDOW_S = 60.0  # the latency a worker reports: batches published within this window


def stored_rollout(store: GraphStore, model_tag: str) -> tuple[str, int]:
    """``(serving version, last marker passed)`` recorded in the state; a state that passed none serves its
    own model."""
    meta = store.column("meta")
    serving, number = meta.get(SERVING_META), meta.get(ROLLOUT_META)
    return (serving.decode() if serving else model_tag), (int(number) if number else 0)


def record_rollout(tx: Transaction, marker: Marker) -> None:
    """Add the state's record of having passed ``marker`` to ``tx`` (committed with the offsets past it)."""
    tx.set_meta(SERVING_META, marker.serving.encode())
    tx.set_meta(ROLLOUT_META, str(marker.rollout).encode())



@dataclass(frozen=True)
class WorkerProgress:
    """What a worker reports of itself (its status is ``stopped`` once it stops)."""

    model: str | None  # the model version it computes
    worker: str
    topic: str  # its output topic
    status: str
    serving: str | None  # the serving version as of the last marker it passed
    rollout: int  # that marker's number
    applied: int
    published: int
    held: bool  # some partition is held at a rollout marker
    latencies: Iterable[tuple[float, float]] = ()  # (publish time, pipeline latency) of recent batches


def worker_report(progress: WorkerProgress, lag: int | None) -> tuple[bytes, bytes]:
    """A worker's progress record: key and value."""
    p = progress
    now = time.time()
    recent = np.asarray([latency for at, latency in p.latencies if at >= now - _LATENCY_WINDOW_S])
    p50, p99 = (np.percentile(recent, [50, 99]).round(3).tolist() if len(recent) else (None, None))
    value = {"kind": "worker", "model": p.model, "worker": p.worker, "topic": p.topic, "status": p.status,
             "serving": p.serving, "rollout": p.rollout, "lag": lag, "applied": p.applied,
             "published": p.published, "latency_p50_s": p50, "latency_p99_s": p99,
             "latency_batches": len(recent), "held": p.held, "at": now}
    return f"worker/{p.model}/{p.worker}".encode(), orjson.dumps(value)
