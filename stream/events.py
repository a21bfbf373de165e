"""Graph events: the schema of a ``graph-events`` message and of a JSONL line.

Four operations exist (see DESIGN.md); anything else is rejected with a short
machine-readable reason so that it can be routed to the dead-letter topic::

    {"op":"edge_upsert","src":"a1","dst":"b2","ts":1700000000,"weight":3.5}
    {"op":"edge_delete","src":"a1","dst":"b2","ts":1700000100}
    {"op":"node_upsert","id":"a1","ts":1700000000,"features":[0.1, ...]}
    {"op":"node_delete","id":"a1","ts":1700000200}

Node ids are strings; JSON integers are accepted and canonicalised to their
decimal string. The decoder is strict: unknown fields, wrong types, NaN/inf,
empty ids and the like are all errors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Union

__all__ = [
    "EdgeUpsert",
    "EdgeDelete",
    "NodeUpsert",
    "NodeDelete",
    "Event",
    "InvalidEvent",
    "MAX_ID_BYTES",
    "decode_event",
    "decode_event_json",
    "encode_event",
    "event_key",
]

MAX_ID_BYTES = 256


@dataclass(frozen=True, slots=True)
class EdgeUpsert:
    """Create or update the directed edge ``src -> dst``."""

    src: str
    dst: str
    ts: float
    weight: float = 1.0
    op: ClassVar[str] = "edge_upsert"


@dataclass(frozen=True, slots=True)
class EdgeDelete:
    """Remove the directed edge ``src -> dst`` (a no-op when absent)."""

    src: str
    dst: str
    ts: float
    op: ClassVar[str] = "edge_delete"


@dataclass(frozen=True, slots=True)
class NodeUpsert:
    """Create node ``id`` or replace its features."""

    id: str
    ts: float
    features: tuple[float, ...]
    op: ClassVar[str] = "node_upsert"


@dataclass(frozen=True, slots=True)
class NodeDelete:
    """Remove node ``id``, its features and all its edges (a no-op when absent)."""

    id: str
    ts: float
    op: ClassVar[str] = "node_delete"


Event = Union[EdgeUpsert, EdgeDelete, NodeUpsert, NodeDelete]


class InvalidEvent(ValueError):
    """An event that does not follow the schema.

    Attributes:
        reason: a short stable code (``not_json``, ``unknown_op`` ...) used as a
            metric label and in dead-letter headers.
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # op: (required, optional)
    "edge_upsert": (frozenset({"op", "src", "dst", "ts"}), frozenset({"weight"})),
    "edge_delete": (frozenset({"op", "src", "dst", "ts"}), frozenset()),
    "node_upsert": (frozenset({"op", "id", "ts", "features"}), frozenset()),
    "node_delete": (frozenset({"op", "id", "ts"}), frozenset()),
}


def _node_id(value: Any, field: str) -> str:
    if isinstance(value, bool):
        raise InvalidEvent("bad_id", f"{field} must be a string or integer (got bool)")
    if isinstance(value, int):
        return str(value)
    if not isinstance(value, str):
        raise InvalidEvent("bad_id", f"{field} must be a string or integer (got {type(value).__name__})")
    if not value:
        raise InvalidEvent("empty_id", f"{field} is empty")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise InvalidEvent("bad_id", f"{field} is longer than {MAX_ID_BYTES} bytes")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidEvent("bad_id", f"{field} is not valid unicode") from None
    return value


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidEvent("bad_type", f"{field} must be a number (got {type(value).__name__})")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidEvent("not_finite", f"{field} is not finite")
    return number


def _timestamp(value: Any) -> float:
    ts = _number(value, "ts")
    if ts < 0:
        raise InvalidEvent("bad_ts", f"ts must be >= 0 (got {ts})")
    return ts


def _features(value: Any) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise InvalidEvent("bad_type", f"features must be a list (got {type(value).__name__})")
    if not value:
        raise InvalidEvent("bad_features", "features is empty")
    return tuple(_number(x, "features[]") for x in value)


def decode_event(obj: Any) -> Event:
    """Validate a decoded JSON value and build the event it describes.

    Args:
        obj: the parsed JSON value of one message or line.

    Returns:
        One of :class:`EdgeUpsert`, :class:`EdgeDelete`, :class:`NodeUpsert`,
        :class:`NodeDelete`.

    Raises:
        InvalidEvent: with a reason code when ``obj`` is not exactly an event.
    """
    if not isinstance(obj, dict):
        raise InvalidEvent("not_object", f"event must be a JSON object (got {type(obj).__name__})")
    op = obj.get("op")
    if op is None:
        raise InvalidEvent("missing_field", "op is missing")
    if not isinstance(op, str) or op not in _FIELDS:
        raise InvalidEvent("unknown_op", f"op {op!r} is not one of {sorted(_FIELDS)}")
    required, optional = _FIELDS[op]
    keys = obj.keys()
    missing = required - keys
    if missing:
        raise InvalidEvent("missing_field", f"{op} needs {', '.join(sorted(missing))}")
    extra = keys - required - optional
    if extra:
        raise InvalidEvent("unknown_field", f"{op} does not take {', '.join(sorted(extra))}")
    ts = _timestamp(obj["ts"])
    if op == "edge_upsert":
        weight = _number(obj["weight"], "weight") if "weight" in obj else 1.0
        return EdgeUpsert(_node_id(obj["src"], "src"), _node_id(obj["dst"], "dst"), ts, weight)
    if op == "edge_delete":
        return EdgeDelete(_node_id(obj["src"], "src"), _node_id(obj["dst"], "dst"), ts)
    if op == "node_upsert":
        return NodeUpsert(_node_id(obj["id"], "id"), ts, _features(obj["features"]))
    return NodeDelete(_node_id(obj["id"], "id"), ts)


def _reject_constant(name: str) -> float:
    raise InvalidEvent("not_finite", f"{name} is not valid JSON")


def decode_event_json(data: bytes | str) -> Event:
    """Parse and validate one JSON-encoded event.

    Raises:
        InvalidEvent: ``not_utf8``, ``not_json`` or any reason of :func:`decode_event`.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidEvent("not_utf8", str(exc)) from None
    try:
        obj = json.loads(data, parse_constant=_reject_constant)
    except InvalidEvent:
        raise
    except (ValueError, RecursionError) as exc:
        raise InvalidEvent("not_json", str(exc)[:200]) from None
    return decode_event(obj)


def encode_event(event: Event) -> bytes:
    """Serialise an event to its canonical JSON bytes."""
    obj: dict[str, Any] = {"op": event.op}
    if isinstance(event, (EdgeUpsert, EdgeDelete)):
        obj["src"], obj["dst"] = event.src, event.dst
    else:
        obj["id"] = event.id
    obj["ts"] = int(event.ts) if float(event.ts).is_integer() else event.ts
    if isinstance(event, EdgeUpsert):
        obj["weight"] = event.weight
    elif isinstance(event, NodeUpsert):
        obj["features"] = list(event.features)
    return json.dumps(obj, separators=(",", ":")).encode()


def event_key(event: Event) -> bytes:
    """The Kafka message key of an event: its ``src`` or ``id``."""
    return (event.src if isinstance(event, (EdgeUpsert, EdgeDelete)) else event.id).encode()
