"""How the sampled-by relation is stored: a snapshot plus one record of changes per applied batch."""

from __future__ import annotations

import numpy as np
import pytest

import gnnstream.graph_state.sampled as sampled_module
from gnnstream.graph_state import keys
from gnnstream.graph_state.store import GraphStore
from tests.graph_state._events import random_batches
from tests.graph_state._model import GraphModel, assert_store_matches

FANOUTS = (2, 5)
SEED = 3


def _names(batches) -> list[str]:
    names = set()
    for batch in batches:
        for ev in batch:
            names.update((ev.src, ev.dst) if hasattr(ev, "src") else (ev.id,))
    return sorted(names)


def _kinds(store: GraphStore) -> dict[str, int]:
    """Stored ``sampled`` records by layout."""
    kinds = {"snapshot": 0, "delta": 0, "pair": 0}
    for key in store.column("sampled").keys():
        if len(key) == 8 and key.startswith(keys.SAMPLED_SNAPSHOT_PREFIX):
            kinds["snapshot"] += 1
        elif len(key) == 10 and key.startswith(keys.SAMPLED_DELTA_PREFIX):
            kinds["delta"] += 1
        else:
            kinds["pair"] += 1
    return kinds


def test_each_batch_writes_one_record_and_a_reopened_store_replays_them(tmp_path) -> None:
    batches = random_batches(SEED, 30, 25)
    model = GraphModel(SEED)
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        store.set_fanouts(FANOUTS)
        store.sampled_by(FANOUTS[0], 0)  # the index is in memory from here on
        changed = 0
        for batch in batches:
            before = _kinds(store)["delta"]
            result = store.apply(batch)
            model.apply_all(batch)
            changed += any(result.sample_changed[k] for k in FANOUTS)
            assert _kinds(store)["delta"] == before + any(result.sample_changed[k] for k in FANOUTS)
        assert changed > 20
        assert _kinds(store) == {"snapshot": 0, "delta": changed, "pair": 0}  # an empty graph's snapshot has no chunks
        assert_store_matches(store, model, _names(batches), FANOUTS)
    with GraphStore(tmp_path / "s") as store:  # the snapshot and every change record, in order
        assert_store_matches(store, model, _names(batches), FANOUTS)
        store.apply(random_batches(SEED + 1, 1, 25)[0])  # change records continue after the stored ones
        model.apply_all(random_batches(SEED + 1, 1, 25)[0])
    with GraphStore(tmp_path / "s") as store:
        assert_store_matches(store, model, _names(batches) + _names(random_batches(SEED + 1, 1, 25)), FANOUTS)


def test_changes_are_folded_into_a_new_snapshot(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampled_module, "FOLD_PAIRS", 40)
    batches = random_batches(SEED, 30, 25)
    model = GraphModel(SEED)
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        store.set_fanouts(FANOUTS)
        store.sampled_by(FANOUTS[0], 0)
        most = 0
        for batch in batches:
            store.apply(batch)
            model.apply_all(batch)
            most = max(most, _kinds(store)["delta"])
        assert 0 < most < 30  # folded along the way
        assert_store_matches(store, model, _names(batches), FANOUTS)
    with GraphStore(tmp_path / "s") as store:
        assert_store_matches(store, model, _names(batches), FANOUTS)


def test_fanouts_without_an_index_have_no_dependents(tmp_path) -> None:
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        store.set_fanouts(FANOUTS)
        store.apply(random_batches(SEED, 1, 25)[0])
        deps, over = store.sampled_by_many(7, np.arange(10), None)
        assert deps.tolist() == [] and over.tolist() == []
