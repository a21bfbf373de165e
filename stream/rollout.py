"""Model versions on the wire: per-version topics, the serving header and rollout markers.

Every model version publishes to a topic of its own,
``node-embeddings.<name>.v<version>`` (:func:`version_topic`), so each
version's embeddings can be read alone. Which version *serves* (is the one a
scorer acts on) is decided in the events stream itself:

* ``gnnstream rollout promote|rollback|retire`` appends one **marker** to
  every partition of the events topic: key ``gnnstream.rollout``, header
  ``gnnstream.control: rollout``, value::

      {"rollout": 3, "serving": "otc-sage:2", "retire": null, "at": 1764700000.5}

  ``rollout`` numbers the markers; ``serving`` is the version that serves
  from the marker on; ``retire`` names a version that stops there.
* Every worker, whatever its version, ends a batch exactly at the markers
  (it holds back each partition at its marker until all partitions reach
  theirs), publishes what it computed before them, and only then moves past
  them. Each embedding message carries the headers ``gnnstream.serving``,
  the serving version when its batch was computed, and ``gnnstream.rollout``,
  the number of the last marker passed then (:func:`stamp_headers`).

So a message is the serving one when its ``gnnstream.serving`` header names
its own ``model`` (:func:`is_serving`): for every change of the graph
exactly one version's message is, the old version's before the markers and
the new one's after, whichever worker runs faster. A message without the
header (a producer other than the worker) counts as serving. The versions'
topics are not ordered against each other: a consumer of several orders a
node's serving messages by ``(gnnstream.rollout, version)``.

Two commands that race for one number put two different markers under it;
every worker follows the one :func:`marker_rank` puts last among those it
holds (the first marker of each partition), so all agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["CONTROL_HEADER", "CONTROL_KEY", "SERVING_HEADER", "ROLLOUT_HEADER", "CONTROL_TOPIC",
           "DEFAULT_OUTPUT_BASE", "Marker", "version_topic", "marker_of", "marker_rank", "encode_marker",
           "stamp_headers", "rollout_of", "is_serving"]

CONTROL_HEADER = "gnnstream.control"  # on a marker in the events topic: b"rollout"
CONTROL_KEY = b"gnnstream.rollout"  # the key of a marker
SERVING_HEADER = "gnnstream.serving"  # on every embedding message: the serving version when it was computed
ROLLOUT_HEADER = "gnnstream.rollout"  # on every embedding message: the number of the last marker passed then
CONTROL_TOPIC = "gnnstream-rollout"  # where the rollout commands and the workers record what they did
DEFAULT_OUTPUT_BASE = "node-embeddings"

_TOPIC_PART = re.compile(r"[A-Za-z0-9._-]+")


def version_topic(model_id: str, base: str = DEFAULT_OUTPUT_BASE) -> str:
    """The topic a version publishes to by default: ``otc-sage:2`` → ``node-embeddings.otc-sage.v2``; also
    the suffix of its workers' group (``gnnstream.otc-sage.v2``).

    Raises:
        ValueError: ``model_id`` is not ``name:version`` with a name Kafka accepts in a topic name.
    """
    name, sep, version = model_id.rpartition(":")
    if not sep or not _TOPIC_PART.fullmatch(name) or not version.isdigit():
        raise ValueError(f"model {model_id!r} is not NAME:VERSION with a name of letters, digits, '.', '_' or '-'")
    return f"{base}.{name}.v{int(version)}"


@dataclass(frozen=True)
class Marker:
    """A rollout marker: from it on, ``serving`` serves; ``retire`` (when set) stops at it."""

    rollout: int
    serving: str
    retire: str | None = None
    at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"rollout": self.rollout, "serving": self.serving, "retire": self.retire, "at": self.at}


def marker_rank(marker: Marker) -> tuple[int, float, str, str]:
    """The order among markers: by number, then (two commands that raced for one number) by time and content."""
    return marker.rollout, marker.at, marker.serving, marker.retire or ""


def stamp_headers(serving: str, rollout: int) -> list[tuple[str, bytes]]:
    """The headers of an embedding message computed while ``serving`` served, after marker ``rollout``."""
    return [(SERVING_HEADER, serving.encode()), (ROLLOUT_HEADER, str(rollout).encode())]


def rollout_of(headers: Any) -> int:
    """The ``gnnstream.rollout`` number of a message (0 without the header)."""
    for k, v in reversed(list(headers or ())):
        if k == ROLLOUT_HEADER:
            return int(v)
    return 0


def encode_marker(marker: Marker) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """``(key, value, headers)`` of the marker's message in the events topic."""
    return CONTROL_KEY, orjson.dumps(marker.to_json()), [(CONTROL_HEADER, b"rollout")]


def marker_of(key: bytes | None, value: bytes | None, headers: Any) -> Marker | None:
    """The marker a record of the events topic holds, ``None`` for an event (or anything else).

    A record is a marker when it carries the ``gnnstream.control: rollout``
    header and the marker key; its value must then decode, or this raises
    ``ValueError`` naming what is wrong.
    """
    if key != CONTROL_KEY or not any(k == CONTROL_HEADER and v == b"rollout" for k, v in headers or ()):
        return None
    try:
        data = orjson.loads(value or b"")
        marker = Marker(int(data["rollout"]), str(data["serving"]),
                        None if data.get("retire") is None else str(data["retire"]), float(data.get("at", 0.0)))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a rollout marker that does not decode ({exc}): {value!r:.200}") from None
    version_topic(marker.serving)  # a model id
    return marker


def is_serving(model: str, headers: Any) -> bool:
    """Whether a message of ``model`` with these headers is the serving one (see the module doc)."""
    for k, v in reversed(list(headers or ())):
        if k == SERVING_HEADER:
            return v.decode() == model
    return True
