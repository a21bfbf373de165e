"""One applied batch: the events' checks, the WriteBatch with what it must read back, and what it changed."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
from rocksdict import WriteBatch

__all__ = ["ApplyResult", "Batch", "validate_events", "finite_features"]

_F32_MAX = float(np.finfo(np.float32).max)
_PLAIN_NUMBERS = {float, int}


def finite_features(feats: Sequence[Any]) -> bool:
    """Every entry a real number (not a bool) within float32 range."""
    if not set(map(type, feats)) <= _PLAIN_NUMBERS:
        if not all(_is_finite_number(x) for x in feats):
            return False
    arr = np.fromiter(feats, dtype=np.float64, count=len(feats))
    return not len(arr) or bool(np.abs(arr).max() <= _F32_MAX)  # NaN compares false


def _is_finite_number(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float, np.floating, np.integer)) and math.isfinite(x)


def validate_events(events: Sequence[Any], dim: int | None) -> int | None:
    """Check a batch before anything is written; return the feature length it implies (``dim`` if known).

    Raises:
        ValueError: on the first invalid event, naming it.
    """
    for i, ev in enumerate(events):
        op = getattr(ev, "op", None)
        if op in ("edge_upsert", "edge_delete"):
            ids = (ev.src, ev.dst)
        elif op in ("node_upsert", "node_delete"):
            ids = (ev.id,)
        else:
            raise ValueError(f"Expected a graph event with op edge_upsert|edge_delete|node_upsert|node_delete (got {ev!r} at index {i})")
        for node_id in ids:
            if not isinstance(node_id, str) or not node_id:
                raise ValueError(f"Expected a non-empty string node id (got {node_id!r} in event {i})")
        ts = ev.ts
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise ValueError(f"Expected a finite ts (got {ts!r} in event {i})")
        if op == "edge_upsert" and not _is_finite_number(ev.weight):
            raise ValueError(f"Expected a finite weight (a number, got {ev.weight!r} in event {i})")
        if op == "node_upsert":
            feats = ev.features
            if dim is None:
                dim = len(feats)
            if len(feats) != dim or dim == 0:
                raise ValueError(f"Expected {dim} features for node {ev.id!r} (got {len(feats)} in event {i})")
            if not finite_features(feats):
                raise ValueError(f"Expected finite features (numbers within float32 range) for node {ev.id!r} "
                                 f"(got {list(feats)[:8]!r} in event {i})")
    return dim


@dataclass
class ApplyResult:
    """What one applied batch changed.

    Attributes:
        fanouts: the fanouts the sample changes are reported for.
        sample_changed: per fanout, the iids whose ``S_k`` differs before and
            after the batch.
        count_changed: per fanout, the iids whose ``|S_k|`` changed.
        features_changed: iids whose input features changed (set, cleared,
            created or deleted).
        degree_changed: iids whose neighbour count changed.
        created / deleted: iids of nodes that came into / went out of existence.
        max_ts: the latest event time in the batch (0 for an empty batch).
        stream_time: stream time ``T`` after the batch when the batch moved it, else None.
        expired_edges: edges removed because they fell out of the edge window.
        late_events: edge upserts that arrived at or before ``T - ttl`` (endpoints touched, edge not).
        expired_loops, late_loops: the self-loops among ``expired_edges`` and ``late_events``.
        age_changed: iids of existing nodes whose ``first(v)`` moved back (an upsert older than any before).
        phases: seconds spent per phase (validate, prefetch, events, finish, write, caches).
    """

    fanouts: tuple[int, ...]
    sample_changed: dict[int, set[int]] = field(default_factory=dict)
    count_changed: dict[int, set[int]] = field(default_factory=dict)
    features_changed: set[int] = field(default_factory=set)
    degree_changed: set[int] = field(default_factory=set)
    created: set[int] = field(default_factory=set)
    deleted: set[int] = field(default_factory=set)
    max_ts: float = 0.0
    stream_time: float | None = None
    expired_edges: int = 0
    late_events: int = 0
    expired_loops: int = 0
    late_loops: int = 0
    age_changed: set[int] = field(default_factory=set)
    phases: dict[str, float] = field(default_factory=dict)
    rows_written: int = 0  # puts and deletes in the batch's WriteBatch

    def lap(self, phase: str, since: float) -> float:
        """Add the time from ``since`` to now to ``phase`` (seconds); return now."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - since
        return now


class Batch:
    """Writes of one batch plus the overlay needed to read them back."""

    def __init__(self, handles: Mapping[str, Any]):
        self.wb = WriteBatch(raw_mode=True)
        self.handles = handles
        self.nbrs_family = handles["nbrs"]
        self.pending_nbr: dict[int, dict[bytes, int | None]] = defaultdict(dict)
        # per neighbour-index key the batch wrote: the neighbour's iid if the entry was stored before, else -1
        self.nbr_first: dict[bytes, int] = {}
        self.edges: dict[bytes, bool] = {}
        self.stored_edges: dict[bytes, bool] = {}  # prefetched: does the edge exist before the batch
        self.marks: tuple[np.ndarray, np.ndarray] | None = None  # dirty marks written, for the in-memory mirror
        self.nodes: set[int] = set()
        # the records of ``nodes`` as written, column by column (iid, degree or -1, flags, last ts, first ts)
        self.node_columns: tuple[list[int], list[int], list[int], list[float], list[float]] = ([], [], [], [], [])
        self.edge_time: dict[bytes, float] = {}  # t(e) of the edges read or written (edge key -> ts), windowed only
        self.born: dict[int, float | None] = {}  # first(v) of the nodes created, re-timed or deleted (None: gone)
        self.born_before: dict[int, float] = {}  # their stored first(v) before the batch (absent: none)
        self.sampled_removed: dict[int, np.ndarray] = {}  # u << 32 | v pairs per fanout
        self.sampled_added: dict[int, np.ndarray] = {}
        self.sampled_changes = 0  # records of the batch's sampled-by delta

    def put(self, cf: str, key: bytes, value: bytes) -> None:
        self.wb.put(key, value, self.handles[cf])

    def delete(self, cf: str, key: bytes) -> None:
        self.wb.delete(key, self.handles[cf])
