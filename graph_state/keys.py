"""Every RocksDB key and value layout of the graph store, in one place.

Node ids are interned to dense 64-bit integers (``iid``) so that keys are
fixed-width and big-endian: byte order is numeric order. The one exception is
the neighbour index, whose key ends in the neighbour's id string so that
entries sort by ``(rank, id)`` exactly as the sampling contract breaks ties.

Column families and layouts::

    meta      name (ascii)                         -> json / struct value (the META_* names below)
    ids       node id (utf-8)                      -> iid            >Q
    names     iid >Q                               -> node id (utf-8)
    nodes     iid >Q                               -> degree >I, flags >B, last_ts >d, first_ts >d
                                                      (first_ts: first(v), the smallest ts of the upserts
                                                      naming the node since it was created)
    feats     iid >Q                               -> float32[dim] (little-endian)
    edges     src iid >Q, dst iid >Q               -> weight >d, ts >d (ts: t(e), the largest ts of the
                                                      edge's upserts since it was created)
    nbrs      v iid >Q, rank >Q, u id (utf-8)      -> u iid >Q
    sampled   0xff 0xfe, k >H, chunk >I             -> snapshot of the sampled-by relation of fanout k:
                                                      sorted u << 32 | v pairs (int64 little-endian),
                                                      up to 2^20 a chunk (u is in S_k(v))
              0xff 0xff, seq >Q                    -> the changes of one applied batch since the
                                                      snapshot: (k <H, added u1, u << 32 | v <q) each,
                                                      replayed in seq order when the index is loaded
    offsets   topic (utf-8), 0x00, partition >I    -> next offset >q
    dirty     0xff, block seq >Q                   -> packed marks: (k >H, iid >Q, flags >B) each
                                                      (k = fanout, 0 = input)
    embpages  page seq >Q                          -> a page of final embeddings: up to 128 records of
                                                      iid, version, event_ts, mode, the frame of the
                                                      row file holding their float32[d] rows and a sum
                                                      of those rows (graph_state.codecs.encode_pages);
                                                      the newest page holding a node is its current state
    layerpages layer >B, page seq >Q               -> a page of h^layer rows (1 <= layer < L), laid out as
                                                      embpages (version, event_ts and mode unused)
    outbox    seq >Q                               -> encoded outbox entry
    born      first_ts (time key), iid >Q          -> empty: every node by first(v), for the stage timers
    expiry    t(e) (time key), src >Q, dst >Q      -> empty: every present edge by t(e), kept only while the
                                                      state has an edge window (edge_ttl > 0)

A *time key* is a float64 event time as 8 bytes whose byte order is numeric order
(:func:`time_key`): the IEEE bits big-endian with the sign bit flipped, all bits
flipped for a negative time.
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = [
    "LAYOUT",
    "COLUMN_FAMILIES",
    "U64",
    "encode_iid",
    "decode_iid",
    "edge_key",
    "decode_edge_key",
    "nbr_prefix",
    "nbr_key",
    "offset_key",
    "decode_offset_key",
    "dirty_block_key",
    "DIRTY_MARK_RECORD",
    "NODE_RECORD",
    "EDGE_RECORD",
    "FLAG_HAS_FEATURES",
    "SAMPLED_DELTA_RECORD",
    "SAMPLED_SNAPSHOT_PREFIX",
    "SAMPLED_DELTA_PREFIX",
    "sampled_snapshot_key",
    "sampled_delta_key",
    "time_key",
    "decode_time_key",
    "born_key",
    "decode_born_key",
    "expiry_key",
    "decode_expiry_key",
    "META_STREAM_TIME",
    "META_EDGE_TTL",
    "META_LAYOUT",
    "META_SEED",
    "META_FEATURE_DIM",
    "META_FANOUTS",
    "META_NEXT_IID",
    "META_BULK_LOAD",
    "META_CALLER",
    "META_MODEL",
    "META_MODEL_DIR",
    "META_OUTBOX_SEQ",
    "META_STAGE_TIME",
    "META_KEPT_PARTITIONS",
    "META_HIGHEST_EPOCH",
    "META_SERVING",
    "META_ROLLOUT",
]

LAYOUT = 6
"""The layout of the state this version writes and reads (recorded in ``meta`` as ``layout``); a state of
another layout is refused with :class:`~gnnstream.graph_state.exceptions.StateLayoutError`."""

# Records of the ``meta`` family. The store's own hold JSON and are named as text (stored UTF-8).
META_LAYOUT = "layout"  # LAYOUT, as the state was written
META_SEED = "seed"  # the sampling seed
META_FEATURE_DIM = "feature_dim"  # the node feature length, once known
META_FANOUTS = "fanouts"  # the fanouts whose sampled-by relation and dirty marks are kept
META_NEXT_IID = "next_iid"  # the next interned id to hand out
META_STREAM_TIME = "stream_time"  # T: the largest ts of any event applied so far (absent: none yet)
META_EDGE_TTL = "edge_ttl"  # the edge window in seconds, fixed when the state is created (0: no window)
META_BULK_LOAD = "bulk_load_in_progress"  # set while a bulk load's table files are being ingested
META_CALLER = "caller:"  # prefix of the records callers keep with GraphStore.apply(meta=...)
# The workers' records hold raw bytes and are named as stored.
META_MODEL = b"model"  # what the stored embeddings were computed with (the engine's binding)
META_MODEL_DIR = b"model_dir"  # the model directory the state uses (the default of --model)
META_OUTBOX_SEQ = b"outbox_seq"  # the next outbox record number >Q
META_KEPT_PARTITIONS = b"kept_partitions"  # JSON {"count", "kept"}: output partitions whose final rows are current
META_HIGHEST_EPOCH = b"highest_epoch"  # the highest epoch the state has owned partitions at >Q
META_SERVING = b"serving"  # the serving model version as of the last rollout marker passed
META_ROLLOUT = b"rollout"  # the number of that marker
META_STAGE_TIME = b"stage_time"  # >d: the stream time up to which stage timers have fired (staged policy)

COLUMN_FAMILIES = (
    "meta", "ids", "names", "nodes", "feats", "edges", "nbrs", "sampled",
    "offsets", "dirty", "embpages", "layerpages", "outbox", "born", "expiry",
)

U64 = struct.Struct(">Q")
_QQ = struct.Struct(">QQ")
_HI = struct.Struct(">HI")
_I32 = struct.Struct(">I")

NODE_RECORD = struct.Struct(">IBdd")  # degree, flags, last event ts, first(v)
EDGE_RECORD = struct.Struct(">dd")  # weight, t(e)
_D = struct.Struct(">d")
_SIGN = 1 << 63
_ALL = (1 << 64) - 1
FLAG_HAS_FEATURES = 1

# The fixed-width keys as numpy records, to pack or unpack thousands at once.
SAMPLED_DELTA_RECORD = np.dtype([("k", "<u2"), ("added", "u1"), ("pair", "<i8")])
SAMPLED_SNAPSHOT_PREFIX = b"\xff\xfe"
SAMPLED_DELTA_PREFIX = b"\xff\xff"
DIRTY_MARK_RECORD = np.dtype([("tag", ">u2"), ("iid", ">u8"), ("flags", "u1")])


def encode_iid(iid: int) -> bytes:
    return U64.pack(iid)


def decode_iid(data: bytes) -> int:
    return U64.unpack(data)[0]


def edge_key(src: int, dst: int) -> bytes:
    return _QQ.pack(src, dst)


def decode_edge_key(key: bytes) -> tuple[int, int]:
    return _QQ.unpack(key)


def nbr_prefix(v: int) -> bytes:
    return U64.pack(v)


def nbr_key(v: int, rank: bytes, u_name: str) -> bytes:
    """The neighbour-index key; ``rank`` as 8 big-endian bytes (:func:`gnnstream.graph_state.sampler.rank_bytes`)."""
    return U64.pack(v) + rank + u_name.encode()


def sampled_snapshot_key(k: int, chunk: int) -> bytes:
    """Key of chunk ``chunk`` of the sampled-by snapshot of fanout ``k`` (8 bytes)."""
    return SAMPLED_SNAPSHOT_PREFIX + _HI.pack(k, chunk)


def sampled_delta_key(seq: int) -> bytes:
    """Key of the sampled-by changes of one applied batch (10 bytes)."""
    return SAMPLED_DELTA_PREFIX + U64.pack(seq)


def offset_key(topic: str, partition: int) -> bytes:
    return topic.encode() + b"\x00" + _I32.pack(partition)


def decode_offset_key(key: bytes) -> tuple[str, int]:
    return key[:-5].decode(), _I32.unpack(key[-4:])[0]


def dirty_block_key(seq: int) -> bytes:
    """Key of a block of packed dirty marks (9 bytes)."""
    return b"\xff" + U64.pack(seq)


def time_key(t: float) -> bytes:
    """An event time as 8 bytes whose byte order is numeric order (-0.0 is stored as 0.0)."""
    bits = U64.unpack(_D.pack(float(t) + 0.0))[0]
    return U64.pack(bits ^ _ALL if bits & _SIGN else bits | _SIGN)


def decode_time_key(data: bytes) -> float:
    bits = U64.unpack(data[:8])[0]
    return _D.unpack(U64.pack(bits & ~_SIGN & _ALL if bits & _SIGN else bits ^ _ALL))[0]


def born_key(first_ts: float, iid: int) -> bytes:
    """Key of node ``iid`` in the ``born`` index (16 bytes)."""
    return time_key(first_ts) + U64.pack(iid)


def decode_born_key(key: bytes) -> tuple[float, int]:
    return decode_time_key(key[:8]), U64.unpack(key[8:16])[0]


def expiry_key(t: float, src: int, dst: int) -> bytes:
    """Key of edge ``src -> dst`` with time ``t`` in the ``expiry`` index (24 bytes)."""
    return time_key(t) + _QQ.pack(src, dst)


def decode_expiry_key(key: bytes) -> tuple[float, int, int]:
    src, dst = _QQ.unpack(key[8:24])
    return decode_time_key(key[:8]), src, dst
