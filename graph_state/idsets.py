"""Set operations on arrays of non-negative integer ids (iids, packed pairs).

``np.unique`` on int64 hashes in numpy 2.x, which costs tens of
milliseconds for a few hundred thousand ids. These helpers sort instead,
or mark a boolean table when the ids are small compared with their count,
and always return sorted, distinct int64 arrays.
"""

from __future__ import annotations

import numpy as np

__all__ = ["unique_ids", "setdiff_ids"]

_TABLE_SLACK = 16  # a marking table is used while max id < 16 × count + 2^16


def _as_ids(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).ravel()


def unique_ids(x: np.ndarray) -> np.ndarray:
    """The sorted distinct values of a non-negative integer array."""
    x = _as_ids(x)
    n = len(x)
    if n < 2:
        return x.copy()
    top = int(x.max())
    if top < _TABLE_SLACK * n + (1 << 16):
        seen = np.zeros(top + 1, dtype=bool)
        seen[x] = True
        return np.flatnonzero(seen)
    s = np.sort(x)
    keep = np.empty(n, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def setdiff_ids(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The sorted distinct values of ``a`` that are not in ``b`` (both non-negative)."""
    a, b = unique_ids(a), unique_ids(b)
    if not len(a) or not len(b):
        return a
    pos = np.minimum(np.searchsorted(b, a), len(b) - 1)
    return a[b[pos] != a]
