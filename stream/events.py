"""Graph events: the schema of a ``graph-events`` message and of a JSONL line.

Four operations exist (see docs/design.md); anything else is rejected with a short
machine-readable reason so that it can be routed to the dead-letter topic::

    {"op":"edge_upsert","src":"a1","dst":"b2","ts":1700000000,"weight":3.5}
    {"op":"edge_delete","src":"a1","dst":"b2","ts":1700000100}
    {"op":"node_upsert","id":"a1","ts":1700000000,"features":[0.1, ...]}
    {"op":"node_delete","id":"a1","ts":1700000200}

A typed graph's events also name node types and relations (docs/design.md,
Typed graphs); :func:`decode_event_json` takes those fields with ``typed=True``
only, and :func:`check_schema` checks them against the model's schema::

    {"op":"node_upsert","type":"account","id":"a1","ts":1700000000,"features":[0.1, ...]}
    {"op":"edge_upsert","src_type":"account","src":"a1","rel":"pays","dst_type":"merchant","dst":"m9",
     "ts":1700000000,"features":[3.2, ...],"txn_id":"t77"}

An omitted type is ``node`` and an omitted relation ``edge``.

Node ids are strings; JSON integers are accepted and canonicalised to their
decimal string. The decoder is strict: unknown or duplicated fields, wrong
types (``true`` is not a number), NaN/inf, empty ids and the like are all
errors.

Whatever the input, :func:`decode_event_json` returns an event or raises
:class:`InvalidEvent`, never any other exception; :func:`check_features`,
which the worker, ``graph load`` and ``apply`` run on each decoded event,
raises it too. Its ``reason`` is one of
:data:`INVALID_EVENT_REASONS` (stable: used as a metric label and in
dead-letter headers):

========================  ====================================================
``empty``                 no message value (a Kafka tombstone) or zero bytes
``oversize``              larger than ``max_bytes`` (default
                          :data:`MAX_EVENT_BYTES`)
``not_utf8``              the bytes are not UTF-8
``not_json``              not one JSON value (syntax, nesting too deep, ...)
``not_object``            valid JSON but not an object
``duplicate_field``       a field appears twice in the object
``missing_field``         ``op`` or a field the op needs is absent
``unknown_op``            ``op`` is not one of the four operations
``unknown_field``         a field the op does not take
``bad_id``                an id that is not a string/integer, too long, bad
                          unicode
``empty_id``              an id that is ``""``
``bad_type``              a number that is not a number, features not a list
``not_finite``            NaN, Infinity or a number too large for a float; in
                          ``check_features`` (or ``check_schema``, of an
                          edge), a feature beyond ±1e15
``bad_ts``                a negative timestamp, or one more than
                          :data:`MAX_AHEAD_S` ahead of this machine's clock
                          (``GNNSTREAM_MAX_AHEAD_S``, default a day)
``bad_features``          an empty feature list
``wrong_feature_length``  in ``check_features``, a feature count that is not
                          the model's input width (in ``check_schema``: of
                          the node type, or of the relation's edge features)
``unknown_type``          in ``check_schema``, a node type or relation that is
                          not in the model's schema
========================  ====================================================
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, ClassVar, Union

import orjson

__all__ = [
    "EdgeUpsert",
    "EdgeDelete",
    "NodeUpsert",
    "NodeDelete",
    "Event",
    "InvalidEvent",
    "MAX_ID_BYTES",
    "MAX_EVENT_BYTES",
    "INVALID_EVENT_REASONS",
    "decode_event",
    "decode_event_json",
    "strict_json",
    "check_features",
    "check_schema",
    "MAX_FEATURE",
    "MAX_AHEAD_S",
    "UNTYPED_NODE",
    "UNTYPED_REL",
    "encode_event",
    "event_key",
]

MAX_ID_BYTES = 256
MAX_EVENT_BYTES = 1 << 20  # 1 MiB: the default size limit of one encoded event


def _max_ahead_s() -> float:
    raw = os.environ.get("GNNSTREAM_MAX_AHEAD_S", "86400")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        logging.getLogger(__name__).warning("GNNSTREAM_MAX_AHEAD_S=%r is not a number of seconds >= 0; a day it is",
                                            raw)
        value = 86_400.0
    return value or math.inf


# The furthest an event's ts may be ahead of the clock of the machine decoding it (GNNSTREAM_MAX_AHEAD_S, default
# a day; 0: no bound): stream time is the largest ts applied and never moves back, so one event from the far
# future would expire every edge and age every node.
MAX_AHEAD_S = _max_ahead_s()

INVALID_EVENT_REASONS = frozenset({
    "empty", "oversize", "not_utf8", "not_json", "not_object", "duplicate_field",
    "missing_field", "unknown_op", "unknown_field", "bad_id", "empty_id", "bad_type",
    "not_finite", "bad_ts", "bad_features", "wrong_feature_length", "unknown_type",
})
UNTYPED_NODE = "node"  # the type of a node an event names without one
UNTYPED_REL = "edge"  # the relation of an edge an event names without one
_MAX_NAME = 64  # the longest node type, relation or transaction id
_MAX_DETAIL = 200


@dataclass(frozen=True, slots=True)
class EdgeUpsert:
    """Create or update the directed edge ``src -> dst`` (of relation ``rel`` between the two types, with the
    edge's ``features`` and the transaction's ``txn_id`` where the relation has them)."""

    src: str
    dst: str
    ts: float
    weight: float = 1.0
    src_type: str = UNTYPED_NODE
    rel: str = UNTYPED_REL
    dst_type: str = UNTYPED_NODE
    features: tuple[float, ...] = ()
    txn_id: str | None = None
    op: ClassVar[str] = "edge_upsert"


@dataclass(frozen=True, slots=True)
class EdgeDelete:
    """Remove the directed edge ``src -> dst`` (of relation ``rel``; a no-op when absent)."""

    src: str
    dst: str
    ts: float
    src_type: str = UNTYPED_NODE
    rel: str = UNTYPED_REL
    dst_type: str = UNTYPED_NODE
    op: ClassVar[str] = "edge_delete"


@dataclass(frozen=True, slots=True)
class NodeUpsert:
    """Create node ``id`` (of ``type``) or replace its features."""

    id: str
    ts: float
    features: tuple[float, ...]
    type: str = UNTYPED_NODE
    op: ClassVar[str] = "node_upsert"


@dataclass(frozen=True, slots=True)
class NodeDelete:
    """Remove node ``id`` (of ``type``), its features and all its edges (a no-op when absent)."""

    id: str
    ts: float
    type: str = UNTYPED_NODE
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
_TYPED_FIELDS = {  # op: the optional fields of a typed graph's events
    "edge_upsert": frozenset({"src_type", "rel", "dst_type", "features", "txn_id"}),
    "edge_delete": frozenset({"src_type", "rel", "dst_type"}),
    "node_upsert": frozenset({"type"}),
    "node_delete": frozenset({"type"}),
}


def _short(value: Any) -> str:
    """A bounded, always-printable rendering of a value for an error detail."""
    text = repr(value) if isinstance(value, str) else f"<{type(value).__name__}>"
    return text if len(text) <= _MAX_DETAIL else text[:_MAX_DETAIL] + "..."


def _node_id(value: Any, field: str) -> str:
    if isinstance(value, bool):
        raise InvalidEvent("bad_id", f"{field} must be a string or integer (got bool)")
    if isinstance(value, (int, _Digits)):
        # bit_length bounds the digits before str() (which refuses > 4300 digits)
        if isinstance(value, _Digits) or value.bit_length() > 4 * MAX_ID_BYTES \
                or len(text := str(value)) > MAX_ID_BYTES:
            raise InvalidEvent("bad_id", f"{field} is an integer longer than {MAX_ID_BYTES} digits")
        return text
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
    try:
        number = float(value)
    except OverflowError:
        raise InvalidEvent("not_finite", f"{field} is too large for a float") from None
    if not math.isfinite(number):
        raise InvalidEvent("not_finite", f"{field} is not finite")
    return number


def _timestamp(value: Any) -> float:
    ts = _number(value, "ts")
    if ts < 0:
        raise InvalidEvent("bad_ts", f"ts must be >= 0 (got {ts})")
    if ts > time.time() + MAX_AHEAD_S:
        raise InvalidEvent("bad_ts", f"ts {ts:.6g} is more than {MAX_AHEAD_S:g} s ahead of this machine's clock "
                                     f"(ts is in seconds since the epoch; GNNSTREAM_MAX_AHEAD_S sets the bound)")
    return ts


def _features(value: Any) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise InvalidEvent("bad_type", f"features must be a list (got {type(value).__name__})")
    if not value:
        raise InvalidEvent("bad_features", "features is empty")
    return tuple(_number(x, "features[]") for x in value)


def _type_name(value: Any, field: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_NAME:
        raise InvalidEvent("bad_type", f"{field} must be a non-empty string of at most {_MAX_NAME} characters "
                                       f"(got {_short(value)})")
    return value


def decode_event(obj: Any, typed: bool = False) -> Event:
    """Validate a decoded JSON value and build the event it describes.

    Args:
        obj: the parsed JSON value of one message or line.
        typed: take the fields of a typed graph's events (node types, relations, edge features, txn_id).

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
    if not isinstance(op, str):
        raise InvalidEvent("unknown_op", f"op must be a string (got {type(op).__name__})")
    if op not in _FIELDS:
        raise InvalidEvent("unknown_op", f"op {_short(op)} is not one of {sorted(_FIELDS)}")
    required, optional = _FIELDS[op]
    if typed:
        optional = optional | _TYPED_FIELDS[op]
    keys = obj.keys()
    missing = required - keys
    if missing:
        raise InvalidEvent("missing_field", f"{op} needs {', '.join(sorted(missing))}")
    extra = keys - required - optional
    if extra:
        names = sorted(_short(k) for k in extra)
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise InvalidEvent("unknown_field", f"{op} does not take {', '.join(names[:3])}{more}")
    ts = _timestamp(obj["ts"])
    names = {f: _type_name(obj[f], f) for f in ("type", "src_type", "rel", "dst_type", "txn_id") if f in obj}
    if op == "edge_upsert":
        weight = _number(obj["weight"], "weight") if "weight" in obj else 1.0
        features = _features(obj["features"]) if "features" in obj else ()
        return EdgeUpsert(_node_id(obj["src"], "src"), _node_id(obj["dst"], "dst"), ts, weight, features=features,
                          **names)
    if op == "edge_delete":
        return EdgeDelete(_node_id(obj["src"], "src"), _node_id(obj["dst"], "dst"), ts, **names)
    if op == "node_upsert":
        return NodeUpsert(_node_id(obj["id"], "id"), ts, _features(obj["features"]), **names)
    return NodeDelete(_node_id(obj["id"], "id"), ts, **names)


MAX_FEATURE = 1e15
"""The largest feature magnitude a model takes: the layers' sums over neighbours and weights grow a feature by
several orders of magnitude, and must stay finite in float32 (at most about 3.4e38)."""


def check_features(ev: Event, dim: int, expected: str = "the model expects") -> None:
    """Refuse a ``node_upsert`` whose features a model of ``dim`` inputs cannot take (other events pass).

    Args:
        expected: who expects ``dim``, for the message (``"the model expects"``).

    Raises:
        InvalidEvent: ``wrong_feature_length``, or ``not_finite`` for a feature beyond ±:data:`MAX_FEATURE`.
    """
    if not isinstance(ev, NodeUpsert):
        return
    if len(ev.features) != dim:
        raise InvalidEvent("wrong_feature_length", f"node {ev.id!r} has {len(ev.features)} features, {expected} {dim}")
    if max(map(abs, ev.features)) > MAX_FEATURE:
        raise InvalidEvent("not_finite", f"a feature of node {ev.id!r} is beyond ±{MAX_FEATURE:g}, where the "
                                         f"model's sums could overflow float32")


def check_schema(ev: Event, node_types: Mapping[str, int], relations: Mapping[tuple[str, str, str], int]) -> None:
    """Refuse an event of a typed graph that its schema does not take.

    Args:
        node_types: feature width by node type.
        relations: edge-feature width by relation ``(src_type, rel, dst_type)`` (0: none).

    Raises:
        InvalidEvent: ``unknown_type`` for a node type or relation outside the schema, ``wrong_feature_length``
            for node or edge features of another width, ``not_finite`` as :func:`check_features`.
    """
    if isinstance(ev, (EdgeUpsert, EdgeDelete)):
        relation = (ev.src_type, ev.rel, ev.dst_type)
        width = relations.get(relation)
        if width is None:
            raise InvalidEvent("unknown_type", f"relation {_short('__'.join(relation))} is not in the schema")
        if isinstance(ev, EdgeUpsert) and len(ev.features) != width:
            raise InvalidEvent("wrong_feature_length", f"edge {ev.src!r} -{ev.rel}-> {ev.dst!r} has "
                                                       f"{len(ev.features)} features, the schema gives {width}")
        if isinstance(ev, EdgeUpsert) and ev.features and max(map(abs, ev.features)) > MAX_FEATURE:
            raise InvalidEvent("not_finite", f"a feature of edge {ev.src!r} -{ev.rel}-> {ev.dst!r} is beyond "
                                             f"±{MAX_FEATURE:g}, as a node's may not be")
        return
    width = node_types.get(ev.type)
    if width is None:
        raise InvalidEvent("unknown_type", f"node type {_short(ev.type)} is not in the schema")
    check_features(ev, width, f"the schema gives {ev.type!r}")


class _Digits(float):
    """A JSON integer past the digits Python converts: infinite as a number (``not_finite``), too long as an
    id (``bad_id``)."""


def _whole(digits: str) -> int | float:
    """A JSON integer: an ``int``, or past 4,000 digits a :class:`_Digits`."""
    if len(digits) <= 4000:
        return int(digits)
    return _Digits(-math.inf if digits.startswith("-") else math.inf)


def _reject_constant(name: str) -> float:
    raise InvalidEvent("not_finite", f"{name} is not valid JSON")


def _unique_fields(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InvalidEvent("duplicate_field", f"field {_short(key)} appears more than once")
            seen.add(key)
    return obj


def decode_event_json(data: bytes | bytearray | memoryview | str | None, *,
                      max_bytes: int = MAX_EVENT_BYTES, typed: bool = False) -> Event:
    """Parse and validate one JSON-encoded event (a Kafka value or a JSONL line).

    Args:
        data: the encoded event; ``None`` (a Kafka tombstone) is rejected.
        max_bytes: size limit of the encoded event in bytes (UTF-8 for ``str``).
        typed: take the fields of a typed graph's events (:func:`decode_event`).

    Returns:
        The decoded event.

    Raises:
        InvalidEvent: never any other exception, with a reason among
            :data:`INVALID_EVENT_REASONS`.
    """
    if data is None:
        raise InvalidEvent("empty", "message has no value (tombstone)")
    if isinstance(data, (bytes, bytearray, memoryview)):
        size = memoryview(data).nbytes
        if size > max_bytes:
            raise InvalidEvent("oversize", f"event is {size} bytes, the limit is {max_bytes}")
        if type(data) is bytes and (event := _decode_common(data, b'"', b"\\")) is not None:
            return event
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidEvent("not_utf8", str(exc)[:_MAX_DETAIL]) from None
    elif isinstance(data, str):
        text = data
        if len(text) > max_bytes or (4 * len(text) > max_bytes
                                     and len(text.encode("utf-8", "surrogatepass")) > max_bytes):
            raise InvalidEvent("oversize", f"event is more than {max_bytes} bytes")
    else:
        raise InvalidEvent("not_json", f"expected bytes or str (got {type(data).__name__})")
    if not text.strip():
        raise InvalidEvent("empty", "message is empty")
    event = _decode_common(text, '"', "\\")
    if event is not None:
        return event
    return decode_event(strict_json(text), typed)


def strict_json(text: str | bytes) -> Any:
    """One JSON value as the strict decoder reads an event: integers kept whole, whatever their size.

    Raises:
        InvalidEvent: ``not_utf8`` for bytes that are not UTF-8, ``not_json`` (syntax, nesting too deep),
            ``not_finite`` for ``NaN`` or ``Infinity``, ``duplicate_field`` for a field written twice in an object.
    """
    if not isinstance(text, str):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidEvent("not_utf8", str(exc)[:_MAX_DETAIL]) from None
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_fields,
                          parse_int=_whole)
    except InvalidEvent:
        raise
    except (ValueError, RecursionError, MemoryError) as exc:
        raise InvalidEvent("not_json", str(exc)[:_MAX_DETAIL]) from None


_NUMBER = (int, float)
_SHORT_ID = MAX_ID_BYTES // 4  # a str of at most this many characters is at most MAX_ID_BYTES in UTF-8


def _decode_common(text: Any, quote: Any, backslash: Any) -> Event | None:
    """The usual valid event, decoded by orjson with type checks in C: None where any doubt is left.

    None sends the text through the strict path (:func:`decode_event`
    behind ``json.loads`` with hooks), which decides and names the reason:
    anything orjson refuses (invalid UTF-8 included), any backslash (an
    escaped field name could repeat another), a field name written twice,
    ids that are not short strings, numbers that are not plain finite ints
    and floats. ``text`` is ``bytes`` or ``str``; ``quote`` and
    ``backslash`` are ``"`` and the backslash, as the same type.
    """
    if backslash in text:
        return None
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if type(obj) is not dict:
        return None
    op = obj.get("op")
    fields = _FIELDS.get(op) if type(op) is str else None
    if fields is None or not (fields[0] <= obj.keys() <= _TAKEN[op]):
        return None
    # Without a backslash each quote delimits a string: the field names, and the string values that the checks
    # below require (op and the ids; every other value is a number or a list of numbers). A field written twice
    # (orjson keeps the last) leaves more strings in the text than that.
    if text.count(quote) != 2 * (len(obj) + (3 if op[0] == "e" else 2)):
        return None
    ts = obj["ts"]
    if type(ts) not in _NUMBER or not 0 <= ts <= time.time() + MAX_AHEAD_S:
        return None
    if op == "edge_upsert" or op == "edge_delete":
        src, dst = obj["src"], obj["dst"]
        if type(src) is not str or type(dst) is not str or not 0 < len(src) <= _SHORT_ID \
                or not 0 < len(dst) <= _SHORT_ID:
            return None
        if op == "edge_delete":
            return EdgeDelete(src, dst, float(ts))
        weight = obj.get("weight", 1.0)
        if type(weight) not in _NUMBER or not -math.inf < weight < math.inf:
            return None
        return EdgeUpsert(src, dst, float(ts), float(weight))
    node = obj["id"]
    if type(node) is not str or not 0 < len(node) <= _SHORT_ID:
        return None
    if op == "node_delete":
        return NodeDelete(node, float(ts))
    features = obj["features"]
    if type(features) is not list or not features or not set(map(type, features)) <= _NUMBER_TYPES:
        return None
    values = tuple(map(float, features))
    if not all(map(math.isfinite, values)):
        return None
    return NodeUpsert(node, float(ts), values)


_NUMBER_TYPES = frozenset(_NUMBER)
_TAKEN = {op: required | optional for op, (required, optional) in _FIELDS.items()}


def encode_event(event: Event) -> bytes:
    """Serialise an event to its canonical JSON bytes."""
    obj: dict[str, Any] = {"op": event.op}
    if isinstance(event, (EdgeUpsert, EdgeDelete)):
        obj["src"], obj["dst"] = event.src, event.dst
        if (event.src_type, event.rel, event.dst_type) != (UNTYPED_NODE, UNTYPED_REL, UNTYPED_NODE):
            obj.update(src_type=event.src_type, rel=event.rel, dst_type=event.dst_type)
    else:
        obj["id"] = event.id
        if event.type != UNTYPED_NODE:
            obj["type"] = event.type
    obj["ts"] = int(event.ts) if float(event.ts).is_integer() else event.ts
    if isinstance(event, EdgeUpsert):
        obj["weight"] = event.weight
        if event.features:
            obj["features"] = list(event.features)
        if event.txn_id is not None:
            obj["txn_id"] = event.txn_id
    elif isinstance(event, NodeUpsert):
        obj["features"] = list(event.features)
    return json.dumps(obj, separators=(",", ":")).encode()


def event_key(event: Event) -> bytes:
    """The Kafka message key of an event: its ``src`` or ``id``."""
    return (event.src if isinstance(event, (EdgeUpsert, EdgeDelete)) else event.id).encode()
