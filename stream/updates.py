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

Packed (``fmt="packed"``), many updates per message: one *frame* holds rows
of one output partition (the delivery process writes one frame per partition
per delivery round, split into several when larger than the producer's
record limit allows). Numbers are fixed-width big-endian except the
embeddings, which are raw little-endian float32 as in the binary format, all
rows contiguous so that ``numpy.frombuffer`` reads them as one
``(n, dim)`` matrix::

    offset  size     type       field
    0       1        u8         magic 0xE2 (gnnstream packed updates)
    1       1        u8         frame format version (1)
    2       4        u32 BE     n (rows)
    6       4        u32 BE     dim (embedding values per row)
    10      2        u16 BE     model_len (bytes)
    12      1        u8         mode_count (entries of the mode table)
    13      model_len UTF-8     model
    ...     ...                 mode table: mode_count times (u8 length, UTF-8 mode)
    then n entries per column, column after column:
            2n       u16 BE     id length (bytes) of each row
            8n       u64 BE     version
            8n       f64 BE     event_ts
            8n       f64 BE     computed_at
            n        u8         flags: bit 0 set = tombstone, the other bits 0
            n        u8         mode: index into the mode table
            sum(id lengths)     UTF-8 ids, concatenated
            0..3                zero bytes, up to an offset that is a multiple of 4
            4*n*dim  f32 LE     embeddings, row after row (numpy '<f4')

A tombstone row withdraws its node: its version is the node's next version
(what a tombstone message carries in ``gnnstream.version``), its embedding
``dim`` zeros. Rows keep the order in which they were published; a node
appears at most once per frame unless it was published twice in one round
(then in order). :func:`decode_packed` returns every row as an
:class:`EmbeddingUpdate` (``deleted=True`` for a tombstone row),
:func:`decode_packed_columns` returns the columns with the rows as one
read-only matrix viewing the message bytes.

Key and partition of a frame: every row's node id maps to the frame's
partition under Kafka's default partitioner
(:mod:`gnnstream.stream.partitioning`), the partition its JSON or binary
messages and tombstones would land in, and the frame is produced to that
partition explicitly. Its key is the partition number in decimal ASCII
(``b"3"``), so that a tool that re-partitions by key keeps a partition's
frames together and in order. Per-node ordering, which "keep the highest
version per node" relies on, therefore holds within the partition as for the
other formats. A frame is not meant for a compacted topic (compaction keeps
one frame per key).

:func:`decode_update` tells the three formats apart by the first byte: a JSON
value starts with ``{`` (or whitespace), a binary one with 0xE1, a packed
frame with 0xE2; it refuses a packed frame (reason ``packed``), which holds
many updates.

Deleted nodes: when a node is deleted its embedding is withdrawn with a
*tombstone*, a message whose key is the node id and whose value is ``None``
(null), built by :func:`tombstone`. It carries the header
``gnnstream.version`` (the node's next version, decimal ASCII) so that a
consumer can order it against updates; on a tombstone a consumer drops the
node (and remembers the version if it wants to ignore late older updates).
"""

from __future__ import annotations

import itertools
import logging
import math
import struct
from dataclasses import dataclass
from typing import Callable, Literal, Sequence, Union

import numpy as np
import orjson

from gnnstream.stream.exceptions import InvalidUpdate

__all__ = [
    "EmbeddingUpdate",
    "BINARY_MAGIC",
    "PACKED_MAGIC",
    "PACKED_VERSION",
    "PackedColumns",
    "VERSION_HEADER",
    "encode_update",
    "encode_updates",
    "decode_update",
    "decode_binary_columns",
    "encode_packed",
    "decode_packed",
    "decode_packed_columns",
    "packed_row_bytes",
    "packed_frame_overhead",
    "update_key",
    "tombstone",
    "is_tombstone",
    "largest_update_bytes",
]

logger = logging.getLogger(__name__)

BINARY_MAGIC = 0xE1
PACKED_MAGIC = 0xE2
PACKED_VERSION = 1
_TOMBSTONE_FLAG = 0x01
_PACKED_HEAD = struct.Struct(">BBIIHB")
_PACKED_COLUMNS = 2 + 8 + 8 + 8 + 1 + 1  # column bytes per row, besides its id and embedding
VERSION_HEADER = "gnnstream.version"
_HEADER = struct.Struct(">BQddIHHB")
_BINARY_HEAD = np.dtype([("magic", "u1"), ("version", ">u8"), ("event_ts", ">f8"), ("computed_at", ">f8"),
                         ("dim", ">u4"), ("id_len", ">u2"), ("model_len", ">u2"), ("mode_len", "u1")])  # _HEADER
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
        deleted: a tombstone row of a packed frame: the node was deleted at ``version`` (the embedding is
            zeros).
    """

    id: str
    model: str
    version: int
    embedding: Embedding
    event_ts: float
    computed_at: float
    mode: str = "full"
    deleted: bool = False

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
        return ((self.id, self.model, self.version, self.event_ts, self.computed_at, self.mode, self.deleted)
                == (other.id, other.model, other.version, other.event_ts, other.computed_at, other.mode,
                    other.deleted)
                and np.array_equal(np.asarray(self.embedding, dtype=np.float64),
                                   np.asarray(other.embedding, dtype=np.float64)))

    __hash__ = None  # type: ignore[assignment]


def update_key(node_id: str) -> bytes:
    """The Kafka message key of a node's updates: its id in UTF-8."""
    return node_id.encode("utf-8")


def _number_json(value: float) -> int | float:
    return int(value) if float(value).is_integer() and abs(value) < 2**53 else float(value)


def _json_numbers(values: np.ndarray) -> list[int | float]:
    """:func:`_number_json` of each of the finite ``values``."""
    out = values.tolist()
    for i in np.flatnonzero((values == np.trunc(values)) & (np.abs(values) < 2**53)).tolist():
        out[i] = int(out[i])
    return out


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
        version_list = versions.tolist() if isinstance(versions, np.ndarray) and versions.dtype.kind in "iu" \
            else list(map(int, versions))
        dumps, option = orjson.dumps, orjson.OPT_SERIALIZE_NUMPY
        return [dumps({"id": node, "model": model, "version": version, "embedding": row, "event_ts": ts,
                       "computed_at": computed, "mode": mode}, option=option)
                for node, version, row, ts, mode in zip(ids, version_list, values, _json_numbers(times), modes)]
    if not n:
        return []
    values = np.ascontiguousarray(rows, dtype="<f4")
    model_b = model.encode("utf-8")
    dim = values.shape[1]
    if len(model_b) > 0xFFFF or dim > 0xFFFFFFFF:
        raise ValueError(f"Expected a model name < 64 KiB and at most 2**32 - 1 values (got {model!r}, {dim})")
    if isinstance(versions, np.ndarray) and versions.dtype.kind in "iu":
        version_col, low, high = versions, int(versions.min()), int(versions.max())
    else:
        version_col = list(map(int, versions))
        low, high = min(version_col), max(version_col)
    if low < 0 or high >= 2**64:
        raise ValueError(f"Expected versions in [0, 2**64) (got {low} .. {high})")
    ids_b = list(map(str.encode, ids))
    table, codes = mode_codes(modes)
    table_b = [m.encode("utf-8") for m in table]
    id_lens = np.fromiter(map(len, ids_b), dtype=np.int64, count=n)
    mode_lens = np.array(list(map(len, table_b)), dtype=np.int64)[codes]
    if id_lens.max() > 0xFFFF or mode_lens.max() > 0xFF:
        i = int(np.flatnonzero((id_lens > 0xFFFF) | (mode_lens > 0xFF))[0])
        raise ValueError(f"Expected id < 64 KiB and mode < 256 bytes (node {ids[i]!r})")
    head = np.empty(n, dtype=_BINARY_HEAD)  # every header at once, each then joined with its id, the rest and row
    head["magic"] = BINARY_MAGIC
    head["version"] = version_col
    head["event_ts"] = times
    head["computed_at"] = float(computed_at)
    head["dim"] = dim
    head["id_len"] = id_lens
    head["model_len"] = len(model_b)
    head["mode_len"] = mode_lens
    heads, size = head.tobytes(), _HEADER.size
    tails = [model_b + m for m in table_b]  # model and mode, between the id and the row
    tail_of = itertools.repeat(tails[0]) if len(tails) == 1 else map(tails.__getitem__, codes.tolist())
    join = b"".join
    return [join((heads[at:at + size], node_b, tail, row))
            for at, node_b, tail, row in zip(range(0, n * size, size), ids_b, tail_of, values)]


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


def packed_frame_overhead(model: str, modes: Sequence[str] = ()) -> int:
    """The bytes of a packed frame besides its rows: the header, ``model``, the table of the distinct
    ``modes`` and the largest padding (3)."""
    table = dict.fromkeys(modes)
    return _PACKED_HEAD.size + len(model.encode("utf-8")) + sum(1 + len(m.encode("utf-8")) for m in table) + 3


def packed_row_bytes(id_bytes: np.ndarray | int, dim: int) -> np.ndarray | int:
    """The bytes a row takes in a packed frame, given its id's length in UTF-8 bytes."""
    return _PACKED_COLUMNS + id_bytes + 4 * dim


def encode_packed(ids: Sequence[str], model: str, versions: Sequence[int] | np.ndarray,
                  event_ts: Sequence[float] | np.ndarray, computed_at: float | Sequence[float] | np.ndarray,
                  modes: Sequence[str], rows: np.ndarray, deleted: Sequence[bool] | np.ndarray | None = None,
                  max_bytes: int | None = None) -> list[bytes]:
    """Serialise rows as packed frames (see the module docstring), in order.

    Args:
        ids, model, versions, event_ts, modes, rows: as for :func:`encode_updates`.
        computed_at: one time for every row, or one per row.
        deleted: per row, whether it is a tombstone (its version the node's next one, its row zeros).
        max_bytes: the most bytes a frame may take; the rows are split over as many frames as that needs
            (``None``: one frame).

    Returns:
        The frames; none for no rows.

    Raises:
        ValueError: mismatched lengths, non-finite values, an empty id, fields too long, more than 255 modes
            in a frame, or a row that alone exceeds ``max_bytes``.
    """
    rows = np.asarray(rows)
    n = len(ids)
    if rows.ndim != 2 or rows.shape[0] != n or not len(versions) == len(event_ts) == len(modes) == n:
        raise ValueError(f"Expected {n} versions, event times, modes and rows (got {len(versions)}, "
                         f"{len(event_ts)}, {len(modes)} and shape {rows.shape})")
    times = np.asarray(event_ts, dtype=np.float64)
    computed = np.broadcast_to(np.asarray(computed_at, dtype=np.float64), (n,))
    flags = np.zeros(n, dtype=np.uint8) if deleted is None else np.asarray(deleted, dtype=bool).astype(np.uint8)
    check_packed(ids.__getitem__, rows, times, computed)
    table, codes = mode_codes(modes)
    id_blob, id_lens = utf8_ids(ids)
    return packed_frames(ids.__getitem__, id_blob, id_lens, model, np.asarray(versions, dtype=">u8"), times, computed, flags,
                         table, codes, rows, max_bytes)


def check_packed(name_of: Callable[[int], str], rows: np.ndarray, times: np.ndarray, computed: np.ndarray) -> None:
    """Raise ValueError, naming the first nodes (``name_of(i)``: the id of row ``i``), unless every row and time
    is finite."""
    if not (np.isfinite(rows).all() and np.isfinite(times).all() and np.isfinite(computed).all()):
        bad = ~np.isfinite(rows).all(axis=1) | ~np.isfinite(times) | ~np.isfinite(computed)
        raise ValueError(f"Expected finite embeddings and timestamps (got non-finite values for nodes "
                         f"{[name_of(i) for i in np.flatnonzero(bad)[:3].tolist()]})")


def mode_codes(modes: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """The distinct ``modes`` in order of first appearance, and each row's index into them."""
    if not modes or modes.count(modes[0]) == len(modes):  # one mode (the usual case): compared by identity first
        return list(modes[:1]), np.zeros(len(modes), dtype=np.int64)
    index: dict[str, int] = {}
    codes = np.fromiter((index.setdefault(m, len(index)) for m in modes), dtype=np.int64, count=len(modes))
    return list(index), codes


def utf8_ids(ids: Sequence[str]) -> tuple[bytes, np.ndarray]:
    """The node ids in UTF-8, concatenated, and each one's length in bytes."""
    text = "".join(ids)
    if text.isascii():  # one character a byte: the ids encoded at once
        return text.encode("ascii"), np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    encoded = list(map(str.encode, ids))
    return b"".join(encoded), np.fromiter(map(len, encoded), dtype=np.int64, count=len(ids))


def packed_frames(name_of: Callable[[int], str], id_blob: bytes, id_lens: np.ndarray, model: str, versions: np.ndarray,
                  times: np.ndarray, computed: np.ndarray, flags: np.ndarray, table: list[str], codes: np.ndarray,
                  rows: np.ndarray, max_bytes: int | None) -> list[bytes]:
    """The frames of rows checked already (:func:`encode_packed`): ``id_blob`` the ids in UTF-8, concatenated,
    ``id_lens`` their lengths, ``name_of(i)`` the id of row ``i`` (for errors), ``versions`` big-endian uint64,
    ``flags`` uint8, each row's mode ``table[codes[i]]``."""
    n = len(id_lens)
    if n and (id_lens.min() == 0 or id_lens.max() > 0xFFFF):
        raise ValueError("Expected node ids of 1 to 65535 UTF-8 bytes")
    dim = rows.shape[1]
    model_b = model.encode("utf-8")
    if len(model_b) > 0xFFFF or dim > 0xFFFFFFFF:
        raise ValueError(f"Expected a model name < 64 KiB and at most 2**32 - 1 values (got {model!r}, {dim})")
    table_b = [m.encode("utf-8") for m in table]
    id_ends = np.cumsum(id_lens)
    bounds = [(0, n)] if n else []
    if max_bytes is not None and n:
        used = table_b if len(table) == 1 else [table_b[c] for c in _first_seen(codes)]
        overhead = _PACKED_HEAD.size + len(model_b) + sum(1 + len(m) for m in used) + 3  # packed_frame_overhead
        ends = np.cumsum(packed_row_bytes(id_lens, dim))
        bounds, start = [], 0
        while start < n:
            stop = int(np.searchsorted(ends, (ends[start - 1] if start else 0) + max_bytes - overhead,
                                       side="right"))
            if stop == start:
                raise ValueError(f"Expected a packed row to fit in {max_bytes} bytes (node {name_of(start)!r} takes "
                                 f"{int(packed_row_bytes(id_lens[start], dim)) + overhead})")
            bounds.append((start, stop))
            start = stop
    values = np.ascontiguousarray(rows, dtype="<f4")
    frames = []
    for a, b in bounds:
        if len(table) == 1:
            present, frame_codes = [0], np.zeros(b - a, dtype=np.uint8)
        else:  # the frame's own table: the modes of its rows, in order of first appearance
            present = _first_seen(codes[a:b])
            remap = np.zeros(len(table), dtype=np.int64)
            remap[present] = np.arange(len(present))
            frame_codes = remap[codes[a:b]].astype(np.uint8)
        frame_table = [table_b[c] for c in present]
        if len(frame_table) > 0xFF or max(map(len, frame_table)) > 0xFF:
            raise ValueError(f"Expected at most 255 modes of at most 255 bytes in a frame (got "
                             f"{[table[c] for c in present][:5]}...)")
        head = b"".join([_PACKED_HEAD.pack(PACKED_MAGIC, PACKED_VERSION, b - a, dim, len(model_b), len(frame_table)),
                         model_b, *(bytes((len(m),)) + m for m in frame_table)])
        ids_b = id_blob[int(id_ends[a - 1]) if a else 0:int(id_ends[b - 1])]
        pad = -(len(head) + (b - a) * _PACKED_COLUMNS + len(ids_b)) % 4
        # the columns' and rows' memory joined as it is: one copy into the frame
        frames.append(b"".join((head, id_lens[a:b].astype(">u2"), versions[a:b], times[a:b].astype(">f8"),
                                computed[a:b].astype(">f8"), flags[a:b], frame_codes, ids_b, bytes(pad),
                                values[a:b])))
    return frames


def _first_seen(codes: np.ndarray) -> list[int]:
    """The distinct ``codes`` in order of first appearance."""
    distinct, first = np.unique(codes, return_index=True)
    return distinct[np.argsort(first)].tolist()


@dataclass(frozen=True, slots=True, eq=False)
class PackedColumns:
    """The rows of one packed frame as columns (:func:`decode_packed_columns`).

    ``rows`` is a read-only ``(n, dim)`` little-endian float32 matrix viewing the frame's bytes (zeros where
    ``deleted``); ``versions`` are uint64, the times float64.
    """

    model: str
    ids: list[str]
    versions: np.ndarray
    event_ts: np.ndarray
    computed_at: np.ndarray
    modes: list[str]
    deleted: np.ndarray
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


def decode_packed_columns(value: bytes | bytearray | memoryview) -> PackedColumns:
    """Decode a packed frame into columns, the embeddings without a copy.

    Raises:
        InvalidUpdate: the bytes are not a well-formed packed frame of a known format version.
    """
    data = bytes(value)
    if len(data) < _PACKED_HEAD.size or data[0] != PACKED_MAGIC:
        raise InvalidUpdate("bad_magic", f"not a packed frame ({len(data)} bytes, first {data[:1].hex() or 'none'})")
    _, fmt_version, n, dim, model_len, mode_count = _PACKED_HEAD.unpack_from(data)
    if fmt_version != PACKED_VERSION:
        raise InvalidUpdate("bad_version", f"packed frame format {fmt_version}, this reader knows {PACKED_VERSION}")
    try:
        at = _PACKED_HEAD.size + model_len
        model = data[_PACKED_HEAD.size:at].decode("utf-8")
        modes_table = []
        for _ in range(mode_count):
            size = data[at]
            modes_table.append(data[at + 1:at + 1 + size].decode("utf-8"))
            at += 1 + size
    except IndexError:
        raise InvalidUpdate("truncated", "packed frame ends inside its header") from None
    except UnicodeDecodeError as exc:
        raise InvalidUpdate("not_utf8", str(exc)) from None
    columns_end = at + n * _PACKED_COLUMNS
    if len(data) < columns_end:
        raise InvalidUpdate("truncated", f"packed frame is {len(data)} bytes, its {n} rows' columns end at {columns_end}")
    id_lens = np.frombuffer(data, ">u2", n, at).astype(np.int64)
    versions = np.frombuffer(data, ">u8", n, at + 2 * n).astype(np.uint64)
    event_ts = np.frombuffer(data, ">f8", n, at + 10 * n).astype(np.float64)
    computed_at = np.frombuffer(data, ">f8", n, at + 18 * n).astype(np.float64)
    flags = np.frombuffer(data, np.uint8, n, at + 26 * n)
    mode_idx = np.frombuffer(data, np.uint8, n, at + 27 * n)
    ends = columns_end + np.cumsum(id_lens)
    ids_end = int(ends[-1]) if n else columns_end
    rows_at = ids_end + (-ids_end % 4)
    if len(data) != rows_at + 4 * n * dim:
        raise InvalidUpdate("truncated", f"packed frame is {len(data)} bytes, its header says {rows_at + 4 * n * dim}")
    if n and (id_lens.min() == 0 or flags.max() > _TOMBSTONE_FLAG or mode_idx.max() >= mode_count):
        raise InvalidUpdate("bad_field", "a packed row has an empty id, unknown flags or a mode not in the table")
    blob = data[columns_end:ids_end]
    try:
        text = blob.decode("utf-8")
        bounds = zip((ends - id_lens - columns_end).tolist(), (ends - columns_end).tolist())
        if len(text) == len(blob):  # ASCII: byte offsets are character offsets
            ids = [text[a:b] for a, b in bounds]
        else:
            ids = [blob[a:b].decode("utf-8") for a, b in bounds]
    except UnicodeDecodeError as exc:
        raise InvalidUpdate("not_utf8", str(exc)) from None
    rows = np.frombuffer(data, "<f4", n * dim, rows_at).reshape(n, dim)
    modes = list(map(modes_table.__getitem__, mode_idx.tolist()))
    return PackedColumns(model, ids, versions, event_ts, computed_at, modes, flags.astype(bool), rows)


def decode_packed(value: bytes | bytearray | memoryview) -> list[EmbeddingUpdate]:
    """Every row of a packed frame as an :class:`EmbeddingUpdate`, in order (``deleted=True`` for a tombstone
    row); each embedding a read-only view of the frame's bytes.

    Raises:
        InvalidUpdate: the bytes are not a well-formed packed frame (:func:`decode_packed_columns`).
    """
    c = decode_packed_columns(value)
    try:
        return [EmbeddingUpdate(node, c.model, version, row, ts, at, mode, gone)
                for node, version, row, ts, at, mode, gone in zip(c.ids, c.versions.tolist(), c.rows,
                                                                    c.event_ts.tolist(), c.computed_at.tolist(),
                                                                    c.modes, c.deleted.tolist())]
    except ValueError as exc:
        raise InvalidUpdate("bad_field", str(exc)) from None


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
    if data[0] == PACKED_MAGIC:
        raise InvalidUpdate("packed", "value is a packed frame of many updates: decode it with decode_packed")
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


def largest_update_bytes(dim: int, model: str, fmt: Literal["json", "binary", "packed"] = "json") -> int:
    """An upper bound of the key and value bytes of one embedding update of ``dim`` values by ``model``
    (packed: of a frame holding one row, the smallest frame the delivery can send).

    Node ids are at most :data:`gnnstream.stream.events.MAX_ID_BYTES` of UTF-8 (in JSON
    at most six bytes per byte, escaped); the key is the id.
    """
    from gnnstream.stream.events import MAX_ID_BYTES
    model_bytes = len(model.encode("utf-8"))
    if fmt == "packed":  # a frame of one row; the key is the partition number
        return 10 + packed_frame_overhead(model, ["x" * _MAX_MODE_BYTES]) + packed_row_bytes(MAX_ID_BYTES, dim)
    if fmt == "binary":
        value = _HEADER.size + MAX_ID_BYTES + model_bytes + _MAX_MODE_BYTES + 4 * dim
    else:
        fields = sum(len(k) + 6 for k in _JSON_KEYS) + 2  # "key": and separators
        value = fields + 6 * MAX_ID_BYTES + 6 * model_bytes + 20 + 2 * 24 + _MAX_MODE_BYTES \
            + dim * (_MAX_FLOAT32_JSON + 1)
    return MAX_ID_BYTES + value
