"""Collector settings of gnnstream processes."""

import gc
import weakref

from gnnstream.workers.heap import freeze_warm_heap, tune_collector


def test_tune_collector_sets_thresholds() -> None:
    before = gc.get_threshold()
    try:
        tune_collector()
        assert gc.get_threshold() == (100_000, 50, 100)
    finally:
        gc.set_threshold(*before)


def test_freeze_keeps_live_objects_out_of_collections_and_refcounting_still_frees() -> None:
    class Box:
        pass

    cache = [Box() for _ in range(1000)]
    watch = weakref.ref(cache[0])
    try:
        freeze_warm_heap()
        assert gc.get_freeze_count() >= len(cache)
        frozen_out = {id(o) for o in gc.get_objects()}
        assert id(cache[0]) not in frozen_out, "a frozen object is no longer scanned by the collector"
        cache.clear()  # acyclic frozen objects are still freed by reference counting
        assert watch() is None
    finally:
        gc.unfreeze()
