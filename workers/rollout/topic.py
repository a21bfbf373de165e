"""The rollout topic: reading and recording its records, and the view of a rollout they add up to.

The rollout topic (``gnnstream-rollout``, one partition) is a log of JSON
records keyed ``worker/MODEL/WORKER`` (a worker's progress, every few
seconds), ``backfill/MODEL`` (``start``'s progress), ``marker/N`` (each marker
appended) and ``canary`` (the scorer's report): only the latest record of a
key counts, so the topic may be compacted. It only informs: the markers in
the events topic decide.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from gnnstream.stream.backends import DEFAULT_KAFKA_CLIENT, open_producer, read_to_end
from gnnstream.stream.errors import retrying
from gnnstream.stream.rollout import CONTROL_TOPIC, Marker, marker_rank

__all__ = ["RolloutError", "read_rollout", "record_in_topic", "named_topic", "VersionView", "RolloutView"]

logger = logging.getLogger(__name__)


class RolloutError(ValueError):
    """A rollout command refused: nothing was changed."""


def read_rollout(bootstrap: str, *, topic: str = CONTROL_TOPIC, kafka_client: str = DEFAULT_KAFKA_CLIENT,
                 timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Every record of the rollout topic, oldest first (an empty list when it does not exist)."""
    from gnnstream.stream.exceptions import NoPartitionsError
    from gnnstream.stream.kafka import ensure_topics
    ensure_topics(bootstrap, {named_topic(topic): 1})
    try:
        records = read_to_end(kafka_client, bootstrap, topic, timeout_s=timeout_s)
    except NoPartitionsError:
        return []
    except TimeoutError as exc:
        raise RolloutError(str(exc)) from None
    out: list[dict[str, Any]] = []
    for r in records:
        try:
            record = orjson.loads(r.value or b"null")
        except orjson.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def named_topic(topic: str) -> str:
    """``topic``, or a RolloutError when it is empty (``--control-topic ''`` means "do not record")."""
    if not topic:
        raise RolloutError("--control-topic is empty, so there is no rollout topic to read or record in: name it "
                           "(default gnnstream-rollout); `rollout start --no-record` records nothing")
    return topic


def record_in_topic(bootstrap: str, kafka_client: str, topic: str, key: str, value: dict[str, Any]) -> None:
    from gnnstream.stream.kafka import ensure_topics
    ensure_topics(bootstrap, {named_topic(topic): 1})
    producer = open_producer(kafka_client, bootstrap)

    def send() -> None:
        producer.send(topic, key.encode(), orjson.dumps(value))
        producer.flush(30.0)

    try:
        retrying(send, f"recording {key} in topic {topic!r}")
    finally:
        producer.close()


@dataclass
class VersionView:
    """What the rollout topic says of one version."""

    model: str
    topic: str | None = None
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    backfill: dict[str, Any] | None = None
    retired: int | None = None  # the marker that retired it

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "topic": self.topic, "workers": self.workers, "backfill": self.backfill,
                "retired": self.retired}


@dataclass
class RolloutView:
    """The state of a rollout as its topic records it."""

    versions: dict[str, VersionView] = field(default_factory=dict)
    markers: list[dict[str, Any]] = field(default_factory=list)
    canary: dict[str, Any] | None = None

    @classmethod
    def of(cls, records: list[dict[str, Any]]) -> RolloutView:
        view = cls()
        for r in records:
            kind, model = r.get("kind"), r.get("model")
            if kind == "marker":
                same = [m for m in view.markers if m.get("rollout") == r.get("rollout")]
                if same and _rank(same[0]) >= _rank(r):  # two commands raced for a number: workers follow the last
                    continue
                view.markers = [m for m in view.markers if m not in same] + [r]
                if r.get("retire") and r["retire"] in view.versions:
                    view.versions[r["retire"]].retired = r.get("rollout")
            elif kind in ("worker", "backfill") and isinstance(model, str):
                version = view.versions.setdefault(model, VersionView(model))
                version.topic = r.get("topic") or version.topic
                if kind == "worker":
                    version.workers[str(r.get("worker"))] = r
                else:
                    version.backfill = r
            elif kind == "canary":
                view.canary = r
        return view

    @property
    def serving(self) -> str | None:
        """The serving version: the last marker's; what the workers report when they passed a later one (a
        command that appended its markers and failed before recording them) or none is recorded."""
        reports = [w for v in self.versions.values() for w in v.workers.values()]
        ahead = max(reports, key=lambda w: (w.get("rollout") or 0, w.get("at", 0)), default=None)
        if self.markers and (ahead is None or (ahead.get("rollout") or 0) <= self.markers[-1]["rollout"]):
            return self.markers[-1]["serving"]
        return ahead.get("serving") if ahead else None

    @property
    def next_rollout(self) -> int:
        numbers = [m.get("rollout", 0) for m in self.markers]
        numbers += [w.get("rollout") or 0 for v in self.versions.values() for w in v.workers.values()]
        return max(numbers, default=0) + 1

    def to_json(self) -> dict[str, Any]:
        return {"serving": self.serving, "versions": {m: v.to_json() for m, v in self.versions.items()},
                "markers": self.markers, "canary": self.canary}



def _rank(r: dict[str, Any]) -> tuple[int, float, str, str]:
    return marker_rank(Marker(int(r.get("rollout", 0)), str(r.get("serving")), r.get("retire"),
                              float(r.get("at", 0.0))))

