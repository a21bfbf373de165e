"""Garbage-collector settings for gnnstream processes.

The store and the engine make many short-lived small objects and no
reference cycles on their hot paths, while their caches hold millions of
long-lived ones (neighbour prefixes, interned ids). Left at Python's
defaults, full collections keep rescanning those caches: on the benchmark
graph that is tens of milliseconds a batch, in whichever phase happens to
trigger it.
"""

from __future__ import annotations

import gc

__all__ = ["tune_collector", "freeze_warm_heap"]


def tune_collector() -> None:
    """Collect the youngest generation less often (process-wide)."""
    gc.set_threshold(100_000, 50, 100)


def freeze_warm_heap() -> None:
    """Leave everything alive now out of later collections.

    Call once start-up work is done (store opened, indexes warmed, backfill).
    Frozen objects are still freed by reference counting when dropped; only
    reference cycles among them would wait for the process to end.
    """
    gc.collect()
    gc.freeze()
