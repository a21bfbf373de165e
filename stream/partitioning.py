"""Which partition a keyed message lands in: Kafka's default partitioner.

Java clients, kafka-python and librdkafka's ``murmur2_random`` partitioner
place a message with a key in ``toPositive(murmur2(key)) % partitions``. A
worker of a group owns the nodes whose ids map to the ``node-embeddings``
partitions assigned to it, so it computes the same function here.
"""

from __future__ import annotations

import struct
from typing import Iterable

import numpy as np

__all__ = ["murmur2", "partition_for", "partitions_for"]

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """The 32-bit MurmurHash2 of ``data`` as Kafka computes it (unsigned)."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    whole = length & ~3
    for k in struct.unpack_from(f"<{whole // 4}I", data):
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    rest = length & 3
    if rest:
        if rest == 3:
            h ^= data[whole + 2] << 16
        if rest >= 2:
            h ^= data[whole + 1] << 8
        h ^= data[whole]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition of a message with ``key`` among ``partitions`` under the default partitioner."""
    if partitions < 1:
        raise ValueError(f"Expected at least one partition (got {partitions})")
    return (murmur2(key) & 0x7FFFFFFF) % partitions


_HASHES: dict[str, int] = {}  # node id -> its positive murmur2 hash: a node's updates go out again and again
_HASHES_KEPT = 1 << 18  # ids remembered at most (emptied when full)


def partitions_for(names: Iterable[str], partitions: int) -> np.ndarray:
    """:func:`partition_for` of each node id (UTF-8 encoded), as an int32 array.

    The hashes of up to ``2**18`` ids are remembered (all are forgotten when that many are held): looking one
    up costs a dict lookup, a hash in pure Python a hundred times that.
    """
    if partitions < 1:
        raise ValueError(f"Expected at least one partition (got {partitions})")
    names = names if isinstance(names, list) else list(names)
    hashes = list(map(_HASHES.get, names))
    if None in hashes:
        if len(_HASHES) + len(names) > _HASHES_KEPT:
            _HASHES.clear()
        for i, name in enumerate(names):
            if hashes[i] is None:
                hashes[i] = _HASHES[name] = murmur2(name.encode()) & 0x7FFFFFFF
    return (np.array(hashes, dtype=np.int64) % partitions).astype(np.int32)
