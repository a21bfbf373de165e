"""What a recompute did, and the engine's own error."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["RecomputeStats", "EngineError"]


class EngineError(RuntimeError):
    """The state directory and the model do not fit together."""


@dataclass
class RecomputeStats:
    """What one recompute did (per layer lists are indexed from layer 1)."""

    recomputed: list[int] = field(default_factory=list)
    changed: list[int] = field(default_factory=list)
    published: int = 0
    deleted: int = 0
    deferred: int = 0  # hub propagations deferred after it (per layer and hub)
    newly_deferred: int = 0  # of those, the ones this recompute deferred (not carried over from before)
    sampled_neighbours: int = 0
    fanout_capped: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase: marks, dirty, compute, rows, outputs, write
    rows_written: int = 0  # records in the recompute's WriteBatch
    final_seconds: float = 0.0  # of the dirty, compute and rows phases, the part spent on the final layer
    stream_time: float | None = None  # stream time T the recompute brought the embeddings to
    stage_changes: dict[str, int] = field(default_factory=dict)  # nodes whose stage timer fired, by the stage entered

    def lap(self, phase: str, since: float) -> float:
        """Add the time from ``since`` to now to ``phase``; return now."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - since
        return now
