"""Stage timers of the staged cold-start policy: a node's stage changes when stream time crosses
``first(v) + feature_only_s`` or ``first(v) + expand_s``, with no event naming it (docs/design.md, "Staged cold
start")."""

from __future__ import annotations

import logging
import struct
from typing import Any

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.idsets import unique_ids
from gnnstream.graph_state.store import GraphStore
from gnnstream.graph_state.transaction import Transaction

__all__ = ["StageClock", "STAGE_NAMES"]

logger = logging.getLogger(__name__)

STAGE_NAMES = ("feature_only", "expanded", "full")  # by STAGE_* code: the stage a node entered
_F64 = struct.Struct(">d")


class StageClock:
    """The stream time ``T_r`` up to which the engine has recomputed the nodes whose stage timer fired, stored
    with the recompute that reached it.

    Args:
        store: the graph store (its ``born`` index finds the nodes).
        policy: the model's cold-start policy; a policy without :attr:`by_age` never fires.
    """

    def __init__(self, store: GraphStore, policy: Any):
        self.store = store
        self.marks: tuple[float, ...] = tuple(policy.age_marks) if policy.by_age else ()
        raw = store.column("meta").get(keys.META_STAGE_TIME)
        self.reached: float | None = None if raw is None else _F64.unpack(raw)[0]

    def fired(self) -> np.ndarray:
        """Nodes whose timer fired since ``T_r``: ``first(v) + a`` in ``(T_r, T]`` for each age mark ``a`` (a
        range read of the ``born`` index each, the cost of the nodes found)."""
        now, reached = self.store.stream_time, self.reached
        if not self.marks or now is None or reached is None or now <= reached:
            return np.zeros(0, dtype=np.int64)
        return unique_ids(np.concatenate([self.store.born_between(reached - a, now - a) for a in self.marks]))

    def behind(self) -> bool:
        """Whether stream time moved past ``T_r`` (a recompute with nothing fired still records it)."""
        now = self.store.stream_time
        return bool(self.marks) and now is not None and now != self.reached

    def reach(self, tx: Transaction) -> None:
        """Record in ``tx`` that the recompute it ends brought every stage to stream time ``T``."""
        now = self.store.stream_time
        if self.marks and now is not None:
            tx.set_meta(keys.META_STAGE_TIME, _F64.pack(now))
            self.reached = now

    def young(self) -> np.ndarray:
        """The live nodes that may be expanded now: ``first(v)`` in ``(T - expand_s, T - feature_only_s]``."""
        now = self.store.stream_time
        if not self.marks or now is None:
            return np.zeros(0, dtype=np.int64)
        f, e = self.marks
        found = self.store.born_between(now - e, now - f)
        return found[self.store.node_arrays(found)[0] >= 0]
