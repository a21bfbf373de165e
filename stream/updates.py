"""Embedding updates: the value of a ``node-embeddings`` message (key = node id).

JSON (the default) has exactly these keys, in this order::

    {"id":"a1","model":"sage:3","version":7,"embedding":[0.25,-1.5],
     "event_ts":1700000000,"computed_at":1700000001.25,"mode":"full"}

``version`` is per node and strictly increasing: consumers keep the highest
version per node, so at-least-once delivery is harmless. In a group of
workers a version is ``epoch << 32`` plus a count, the epoch growing with
every change of the node's owner (docs/scaling.md). ``event_ts`` is the
latest event time (seconds) that contributed, ``computed_at`` the wall-clock
time (seconds since the epoch) of the computation, ``mode`` how the embedding
was obtained (``full``, ``cold_start``, ...). Readers ignore unknown keys.

Binary (``fmt="binary"``), for consumers that want raw float32::

    offset  size  type       field
    0       1     u8         magic 0xE1 (gnnstream embedding update, format 1)
    1       8     u64 BE     version
    9       8     f64 BE     event_ts
    17      8     f64 BE     computed_at
    25      4     u32 BE     dim (number of embedding values)
    29      2     u16 BE     id_len    (bytes)
    31      2     u16 BE     model_len (bytes)
    33      1     u8         mode_len  (bytes)
    34      ...   UTF-8      id, then model, then mode
    ...     4*dim f32 LE     embedding (raw little-endian float32, numpy '<f4')

Total size ``34 + id_len + model_len + mode_len + 4 * dim``. A JSON value
never starts with byte 0xE1, so :func:`decode_update` tells the two apart by
the first byte. Binary decoding returns the embedding as a read-only
``numpy.float32`` array viewing the message bytes; JSON decoding returns a
tuple of floats.

Deleted nodes: when a node is deleted its embedding is withdrawn with a
*tombstone*, a message whose key is the node id and whose value is ``None``
(null), built by :func:`tombstone`. It carries the header
``gnnstream.version`` (the node's next version, decimal ASCII) so that a
consumer can order it against updates; on a tombstone a consumer drops the
node (and remembers the version if it wants to ignore late older updates).
"""

from __future__ import annotations

import logging
import math
import struct
from dataclasses import dataclass
from typing import Literal, Sequence, Union

import numpy as np
import orjson

from gnnstream.stream.exceptions import InvalidUpdate

__all__ = [
    "EmbeddingUpdate",
    "BINARY_MAGIC",
    "VERSION_HEADER",
    "encode_update",
    "encode_updates",
    "decode_update",
    "decode_binary_columns",
    "update_key",
    "tombstone",
    "is_tombstone",
    "largest_update_bytes",
]

logger = logging.getLogger(__name__)

BINARY_MAGIC = 0xE1
VERSION_HEADER = "gnnstream.version"
_HEADER = struct.Struct(">BQddIHHB")
_NUMBER_TYPES = frozenset((int, float))
_JSON_KEYS = ("id", "model", "version", "embedding", "event_ts", "computed_at", "mode")

Embedding = Union[Sequence[float], np.ndarray]


@dataclass(frozen=True, slots=True, eq=False)
class EmbeddingUpdate:
    """One published embedding of one node.

    Args:
        id: node id (non-empty string).
        model: ``name:version`` of the model that computed it.
        version: per-node version, an integer >= 0, strictly increasing.
        embedding: the values: a sequence of floats or a 1-D float array.
        event_ts: latest event time (seconds) that contributed.
        computed_at: when it was computed (seconds since the epoch).
        mode: how it was computed (``full``, ``cold_start``, ...).
    """

    id: str
    model: str
    version: int
    embedding: Embedding
    event_ts: float
    computed_at: float
    mode: str = "full"

    def __post_init__(self) -> None:
        for name in ("id", "model", "mode"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Expected a non-empty string for {name} (got {value!r})")
        if isinstance(self.version, bool) or not isinstance(self.version, (int, np.integer)) \
                or not 0 <= self.version < 2**64:
            raise ValueError(f"Expected an integer version in [0, 2**64) (got {self.version!r})")
        if np.ndim(self.embedding) != 1:
            raise ValueError(f"Expected a 1-D embedding (got shape {np.shape(self.embedding)})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EmbeddingUpdate):
            return NotImplemented
        return ((self.id, self.model, self.version, self.event_ts, self.computed_at, self.mode)
                == (other.id, other.model, other.version, other.event_ts, other.computed_at, other.mode)
                and np.array_equal(np.asarray(self.embedding, dtype=np.float64),
                                   np.asarray(other.embedding, dtype=np.float64)))

    __hash__ = None  # type: ignore[assignment]


def update_key(node_id: str) -> bytes:
    """The Kafka message key of a node's updates: its id in UTF-8."""
    return node_id.encode("utf-8")


def _number_json(value: float) -> int | float:
    return int(value) if float(value).is_integer() and abs(value) < 2**53 else float(value)


def _json_values(values: np.ndarray) -> np.ndarray:
    """Rows as orjson serialises them: float32 stays float32 (shortest repr that reads back to the same
    float32), anything else becomes float64."""
    dtype = np.float32 if values.dtype == np.float32 else np.float64
    return np.ascontiguousarray(values, dtype=dtype)


def encode_updates(ids: Sequence[str], model: str, versions: Sequence[int], event_ts: Sequence[float],
                   computed_at: float, modes: Sequence[str], rows: np.ndarray,
                   fmt: Literal["json", "binary"] = "json") -> list[bytes]:
    """Serialise the updates of many nodes at once (the publisher's path).

    Args:
        ids: node ids.
        model: ``name:version`` of the model, the same for every update.
        versions: per-node versions.
        event_ts: per-node latest event times.
        computed_at: when the rows were computed, the same for every update.
        modes: per-node modes.
        rows: ``(len(ids), dim)`` embeddings, float32 or float64.
        fmt: ``"json"`` (default) or ``"binary"``.

    Returns:
        One message value per node, equal to :func:`encode_update` of each.

    Raises:
        ValueError: unknown ``fmt``, mismatched lengths, non-finite values,
            or fields too long for the binary header.
    """
    rows = np.asarray(rows)
    n = len(ids)
    if rows.ndim != 2 or rows.shape[0] != n or not len(versions) == len(event_ts) == len(modes) == n:
        raise ValueError(f"Expected {n} versions, event times, modes and rows (got {len(versions)}, "
                         f"{len(event_ts)}, {len(modes)} and shape {rows.shape})")
    if fmt not in ("json", "binary"):
        raise ValueError(f"Expected fmt 'json' or 'binary' (got {fmt!r})")
    times = np.asarray(event_ts, dtype=np.float64)
    if not (np.isfinite(rows).all() and np.isfinite(times).all() and math.isfinite(computed_at)):
        bad = [ids[i] for i in np.flatnonzero(~np.isfinite(rows).all(axis=1) | ~np.isfinite(times))[:3]]
        raise ValueError(f"Expected finite embeddings and timestamps (got non-finite values for nodes {bad})")
    if fmt == "json":
        values = _json_values(rows)
        computed = _number_json(computed_at)
        dumps, option = orjson.dumps, orjson.OPT_SERIALIZE_NUMPY
        return [dumps({"id": node, "model": model, "version": int(version), "embedding": row,
                       "event_ts": _number_json(ts), "computed_at": computed, "mode": mode}, option=option)
                for node, version, row, ts, mode in zip(ids, versions, values, times.tolist(), modes)]
    values = np.ascontiguousarray(rows, dtype="<f4")
    model_b = model.encode("utf-8")
    dim = values.shape[1]
    if len(model_b) > 0xFFFF or dim > 0xFFFFFFFF:
        raise ValueError(f"Expected a model name < 64 KiB and at most 2**32 - 1 values (got {model!r}, {dim})")
    out = []
    pack = _HEADER.pack
    for node, version, row, ts, mode in zip(ids, versions, values, times.tolist(), modes):
        node_b, mode_b = node.encode("utf-8"), mode.encode("utf-8")
        if len(node_b) > 0xFFFF or len(mode_b) > 0xFF:
            raise ValueError(f"Expected id < 64 KiB and mode < 256 bytes (node {node!r})")
        header = pack(BINARY_MAGIC, int(version), ts, float(computed_at), dim, len(node_b), len(model_b),
                      len(mode_b))
        out.append(b"".join((header, node_b, model_b, mode_b, row.tobytes())))
    return out


def encode_update(update: EmbeddingUpdate, fmt: Literal["json", "binary"] = "json") -> bytes:
    """Serialise an update.

    Args:
        update: the update.
        fmt: ``"json"`` (default, see the module docstring) or ``"binary"``.

    Returns:
        The message value.

    Raises:
        ValueError: unknown ``fmt``, non-finite values, or fields too long
            for the binary header.
    """
    values = np.asarray(update.embedding)
    if values.dtype != np.float32:
        values = values.astype(np.float64)
    return encode_updates([update.id], update.model, [update.version], [update.event_ts], update.computed_at,
                          [update.mode], values.reshape(1, -1), fmt)[0]


def _decode_binary(data: bytes) -> EmbeddingUpdate:
    if len(data) < _HEADER.size:
        raise InvalidUpdate("truncated", f"binary update is {len(data)} bytes, the header alone is {_HEADER.size}")
    _, version, event_ts, computed_at, dim, id_len, model_len, mode_len = _HEADER.unpack_from(data)
    start = _HEADER.size + id_len + model_len + mode_len
    if len(data) != start + 4 * dim:
        raise InvalidUpdate("truncated", f"binary update is {len(data)} bytes, its header says {start + 4 * dim}")
    try:
        node_id = bytes(data[_HEADER.size:_HEADER.size + id_len]).decode("utf-8")
        model = bytes(data[_HEADER.size + id_len:_HEADER.size + id_len + model_len]).decode("utf-8")
        mode = bytes(data[start - mode_len:start]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidUpdate("not_utf8", str(exc)) from None
    embedding = np.frombuffer(data, dtype="<f4", count=dim, offset=start)
    try:
        return EmbeddingUpdate(node_id, model, version, embedding, event_ts, computed_at, mode)
    except ValueError as exc:
        raise InvalidUpdate("bad_field", str(exc)) from None


def decode_binary_columns(values: Sequence[bytes | bytearray | memoryview]
                          ) -> tuple[list[str], list[str], list[int], list[float], np.ndarray]:
    """Decode many binary updates of one dimension at once (a consumer's poll).

    Returns:
        ``(ids, models, versions, event_ts, rows)``: each message's fields as
        :func:`decode_update` reads them, the embeddings as one read-only
        ``(len(values), dim)`` float32 matrix.

    Raises:
        InvalidUpdate: a value is not a well-formed binary update, or the
            dimensions differ (:func:`decode_update` of each tells which).
    """
    size = _HEADER.size
    try:
        heads = list(map(_HEADER.unpack_from, values))
    except struct.error:
        raise InvalidUpdate("truncated", f"a binary update is shorter than its {size}-byte header") from None
    if not heads:
        return [], [], [], [], np.zeros((0, 0), dtype=np.float32)
    magic, versions, times, _, dims, id_lens, model_lens, mode_lens = map(list, zip(*heads))
    if set(magic) != {BINARY_MAGIC} or len(set(dims)) != 1 or not all(id_lens) or not all(model_lens) \
            or not all(mode_lens):
        raise InvalidUpdate("bad_field", "the updates are not all binary, non-empty and of one dimension")
    dim = dims[0]
    id_ends = [size + n for n in id_lens]
    model_ends = list(map(int.__add__, id_ends, model_lens))
    starts = list(map(int.__add__, model_ends, mode_lens))
    if list(map(len, values)) != [start + 4 * dim for start in starts]:
        raise InvalidUpdate("truncated", "a binary update's length is not the one its header says")
    try:
        ids = [str(value[size:end], "utf-8") for value, end in zip(values, id_ends)]
        models = [str(value[a:b], "utf-8") for value, a, b in zip(values, id_ends, model_ends)]
        for value, a, b in zip(values, model_ends, starts):
            str(value[a:b], "utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidUpdate("not_utf8", str(exc)) from None
    rows = np.frombuffer(b"".join([value[start:] for value, start in zip(values, starts)]), dtype="<f4")
    return ids, models, versions, times, rows.reshape(len(values), dim)


def _decode_json(data: bytes) -> EmbeddingUpdate:
    try:
        obj = orjson.loads(data)
    except (orjson.JSONDecodeError, RecursionError) as exc:
        raise InvalidUpdate("not_json", str(exc)[:200]) from None
    if not isinstance(obj, dict):
        raise InvalidUpdate("not_object", f"expected a JSON object (got {type(obj).__name__})")
    missing = [k for k in _JSON_KEYS if k not in obj]
    if missing:
        raise InvalidUpdate("missing_field", f"update needs {', '.join(missing)}")
    embedding = obj["embedding"]
    # the set of element types, built in C: a bool is an int subclass but its type is bool
    if not isinstance(embedding, list) or not set(map(type, embedding)) <= _NUMBER_TYPES \
            or type(obj["event_ts"]) not in _NUMBER_TYPES or type(obj["computed_at"]) not in _NUMBER_TYPES:
        raise InvalidUpdate("bad_type", "embedding must be a list of numbers and the timestamps numbers")
    try:
        return EmbeddingUpdate(obj["id"], obj["model"], obj["version"], tuple(map(float, embedding)),
                               float(obj["event_ts"]), float(obj["computed_at"]), obj["mode"])
    except (ValueError, OverflowError) as exc:
        raise InvalidUpdate("bad_field", str(exc)) from None


def decode_update(data: bytes | bytearray | memoryview) -> EmbeddingUpdate:
    """Decode an update in either encoding (told apart by the first byte).

    Args:
        data: a message value. A tombstone (``None``) is not an update: test
            it with :func:`is_tombstone` first.

    Raises:
        InvalidUpdate: the bytes are not an update in a known encoding.
    """
    if data is None:
        raise InvalidUpdate("tombstone", "value is None: the node was deleted (see is_tombstone)")
    data = bytes(data)
    if not data:
        raise InvalidUpdate("empty", "value is empty")
    if data[0] == BINARY_MAGIC:
        return _decode_binary(data)
    return _decode_json(data)


def tombstone(node_id: str, version: int | None = None) -> tuple[bytes, None, list[tuple[str, bytes]]]:
    """The message that withdraws a deleted node's embedding.

    Args:
        node_id: the deleted node.
        version: the node's next version, sent in the ``gnnstream.version`` header.

    Returns:
        ``(key, None, headers)`` ready for ``Producer.send(topic, key, value, headers)``.
    """
    headers = [] if version is None else [(VERSION_HEADER, str(int(version)).encode("ascii"))]
    return update_key(node_id), None, headers


def is_tombstone(value: bytes | None) -> bool:
    """True for the value of a tombstone (the node was deleted)."""
    return value is None


_MAX_MODE_BYTES = 32  # longer than any mode name the engine writes
_MAX_FLOAT32_JSON = 15  # the longest shortest-repr of a float32 (``-1.23456789e-38``)


def largest_update_bytes(dim: int, model: str, fmt: Literal["json", "binary"] = "json") -> int:
    """An upper bound of the key and value bytes of one embedding update of ``dim`` values by ``model``.

    Node ids are at most :data:`gnnstream.stream.events.MAX_ID_BYTES` of UTF-8 (in JSON
    at most six bytes per byte, escaped); the key is the id.
    """
    from gnnstream.stream.events import MAX_ID_BYTES
    model_bytes = len(model.encode("utf-8"))
    if fmt == "binary":
        value = _HEADER.size + MAX_ID_BYTES + model_bytes + _MAX_MODE_BYTES + 4 * dim
    else:
        fields = sum(len(k) + 6 for k in _JSON_KEYS) + 2  # "key": and separators
        value = fields + 6 * MAX_ID_BYTES + 6 * model_bytes + 20 + 2 * 24 + _MAX_MODE_BYTES \
            + dim * (_MAX_FLOAT32_JSON + 1)
    return MAX_ID_BYTES + value
