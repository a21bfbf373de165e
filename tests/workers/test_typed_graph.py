"""A typed graph through ``apply``: stored embeddings equal to the independent typed reference (PyG HeteroData,
ToUndirected, HeteroConv of SAGEConv per edge type) on random streams with deletes, in several runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gnnstream.graph_state.store import GraphStore
from gnnstream.model import load_model_dir
from gnnstream.workers.engine import Engine, EngineError
from gnnstream.workers.query.state import QueryError
from tests.workers.reference import assert_embeddings_close, run_gnnstream
from tests.workers.typed_reference import typed_embeddings
from tests.workers.typed_streams import SCHEMA, typed_model, typed_stream, write


def stored(state: Path) -> dict[str, list[float]]:
    done = run_gnnstream("embeddings", "--state", state, "--out", "-")
    assert done.returncode == 0, done.stderr
    return {row["id"]: row["embedding"] for row in map(json.loads, done.stdout.splitlines())}


@pytest.mark.parametrize("seed, fanouts", [(1, [3, 2]), (3, [4])])
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
    assert str(info.value) == (f"state {str(state)!r} holds a typed graph (node types ['account', 'device', "
                               f"'merchant']), which untyped model model:1 does not serve; use a typed model of its "
                               f"schema")
    done = run_gnnstream("graph", "load", "--state", state, write(tmp_path / "g.jsonl", []))
    assert done.returncode == 2 and done.stderr.strip().endswith(
        f"state {str(state)!r} holds a typed graph: load its events with --model, the typed model that reads them")


@pytest.mark.parametrize("seed", [7])
def test_typed_what_if_and_transaction_score_equal_applying_the_events(tmp_path, seed):
    """POST /v1/infer and /v1/score on a typed state: the reference's embeddings of the graph with the events
    applied, and the head's score of the transaction's ends then; nothing is written."""
    from gnnstream.model.head import TransactionHead
    from gnnstream.workers.query.state import QueryState


    model = typed_model(tmp_path / "model", seed, [3, 2])
    weights = tuple(float(w) for w in np.random.default_rng(seed).normal(size=2 * 4 + 2))
    TransactionHead("account__pays__merchant", weights, 0.25, "model:1").save(model)
    events = typed_stream(seed, 500)
    state = tmp_path / "state"
    done = run_gnnstream("apply", "--state", state, "--model", model, write(tmp_path / "e.jsonl", events))
    assert done.returncode == 0, done.stderr
    before = stored(state)
    what_if = typed_stream(seed + 100, 40)
    txn = {"op": "edge_upsert", "src_type": "account", "src": "a3", "rel": "pays", "dst_type": "merchant",
           "dst": "m5", "ts": 9_000, "features": [2.5, 0.5], "txn_id": "t1"}
    view = QueryState(state, model, tmp_path / "q")
    try:
        view.refresh()
        want = typed_embeddings(events + what_if, SCHEMA, model)
        evs, ids = view.parse_infer({"events": what_if, "ids": sorted(want)})
        got = view.infer(evs, ids)
        assert_embeddings_close(got["embeddings"], want, what="typed what-if against the reference")
        answer = view.score(*view.parse_score({"event": txn}))
        ends = typed_embeddings(events + [txn], SCHEMA, model)
        z = np.concatenate([ends["account/a3"], ends["merchant/m5"], [2.5, 0.5]]) @ np.asarray(weights) + 0.25
        assert answer["txn_id"] == "t1" and abs(answer["score"] - 1 / (1 + np.exp(-z))) < 1e-5
        with pytest.raises(QueryError) as err:
            view.parse_score({"event": {**txn, "rel": "uses", "dst_type": "device", "dst": "d1",
                                        "features": None}})
        assert err.value.status == 400
    finally:
        view.close()
    assert stored(state) == before  # nothing was written


def test_typed_layers_run_a_chunk_of_targets_at_a_time_and_count_capped_samples(tmp_path):
    """An engine running 4 targets per layer call: recompute and from scratch equal the typed reference, and
    the targets whose samples the fanout capped are counted."""
    model = typed_model(tmp_path / "model", 1, [3, 2])
    events = typed_stream(1, 300)
    capped = 0
    with GraphStore(tmp_path / "state", seed=1) as store:
        engine = Engine(store, load_model_dir(model), chunk_nodes=4)
        for start in range(0, len(events), 50):
            store.apply([e for ev in events[start:start + 50] for e in engine.read_event(json.dumps(ev))])
            capped += engine.recompute().fanout_capped
        targets, rows = engine.from_scratch()
        kept, present = engine.tables.get(engine.num_layers, targets)
        names = [store.name(v) for v in targets.tolist()]
    want = typed_embeddings(events, SCHEMA, model)
    assert present.all() and capped > 0
    assert_embeddings_close(dict(zip(names, rows)), want, what="typed embeddings from scratch")
    assert_embeddings_close(dict(zip(names, kept)), want, what="typed embeddings recomputed")
