"""A typed graph through ``apply``: stored embeddings equal to the independent typed reference (PyG HeteroData,
ToUndirected, HeteroConv of SAGEConv per edge type) on random streams with deletes, in several runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gnnstream.graph_state.store import GraphStore
from gnnstream.model import load_model_dir
from gnnstream.workers.engine import Engine, EngineError
from tests.workers.reference import assert_embeddings_close, run_gnnstream
from tests.workers.typed_reference import typed_embeddings
from tests.workers.typed_streams import SCHEMA, typed_model, typed_stream, write


def stored(state: Path) -> dict[str, list[float]]:
    done = run_gnnstream("embeddings", "--state", state, "--out", "-")
    assert done.returncode == 0, done.stderr
    return {row["id"]: row["embedding"] for row in map(json.loads, done.stdout.splitlines())}


@pytest.mark.parametrize("seed, fanouts", [(1, [3, 2]), (2, [2, 2]), (3, [4])])
def test_apply_of_a_typed_stream_equals_the_typed_reference(tmp_path, seed, fanouts):
    model = typed_model(tmp_path / "model", seed, fanouts)
    events = typed_stream(seed)
    cut = len(events) // 2
    state = tmp_path / "state"
    for part, chunk in (("a", events[:cut]), ("b", events[cut:])):  # two runs: the second reopens the state
        done = run_gnnstream("apply", "--state", state, "--model", model, "--batch", "37",
                             write(tmp_path / f"{part}.jsonl", chunk))
        assert done.returncode == 0, done.stderr
    want = typed_embeddings(events, SCHEMA, model)
    assert len(want) > 30
    assert_embeddings_close(stored(state), want, what="typed embeddings after apply")
    check = run_gnnstream("verify", "--state", state)
    assert check.returncode == 0 and json.loads(check.stdout)["status"] == "ok", check.stdout + check.stderr


def test_a_typed_state_refuses_events_and_models_outside_its_schema(tmp_path):
    model = typed_model(tmp_path / "model", 4, [2, 2])
    state = tmp_path / "state"
    events = typed_stream(4, 100)
    bad = [{"op": "edge_upsert", "src_type": "account", "src": "a1", "rel": "owns", "dst_type": "merchant",
            "dst": "m1", "ts": 5000},
           {"op": "node_upsert", "type": "account", "id": "a1", "ts": 5001, "features": [1.0]},
           {"op": "edge_upsert", "src": "a1", "dst": "a2", "ts": 5002}]
    done = run_gnnstream("apply", "--state", state, "--model", model, write(tmp_path / "e.jsonl", events + bad))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["invalid"] == 3 and summary["invalid_reasons"] == {"unknown_type": 2,
                                                                               "wrong_feature_length": 1}
    assert_embeddings_close(stored(state), typed_embeddings(events, SCHEMA, model))
    untyped = tmp_path / "untyped"
    assert run_gnnstream("model", "init", untyped, "--in-dim", "5", "--fanouts", "2,2", "--seed", "4").returncode == 0
    with GraphStore(state) as store, pytest.raises(EngineError) as info:
        Engine(store, load_model_dir(untyped))
    assert str(info.value) == (f"state {str(state)!r} holds a typed graph of another schema, which model model:1 "
                               f"does not serve; use a model of its schema (node types ['account', 'device', "
                               f"'merchant']), or a new --state directory")
