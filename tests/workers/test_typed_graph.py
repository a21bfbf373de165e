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
        # nodes are asked for as type/id: a slot is no node, an unknown type or a bare id is refused
        assert view.embedding("merchant/m5")["id"] == "merchant/m5"
        with pytest.raises(QueryError) as err:
            view.embedding("account__pays__merchant:merchant/m5")
        assert err.value.status == 404
        for ids, reason in ((["shop/m5"], "unknown_type"), (["m5"], "bad_id"), ([f"account/{'x' * 257}"], "bad_id")):
            with pytest.raises(QueryError) as err:
                view.parse_infer({"events": what_if, "ids": ids})
            assert (err.value.status, err.value.extra["reason"]) == (400, reason), ids
    finally:
        view.close()
    assert stored(state) == before  # nothing was written


def test_a_typed_edge_window_equals_the_typed_reference(tmp_path):
    """``--edge-ttl`` on a typed state: each typed edge falls out of the window, late upserts only name their
    ends (the stream's times jitter, so some arrive late), over two runs; the reference applies the event-time
    rules per typed edge."""
    model = typed_model(tmp_path / "model", 2, [3, 2])
    rng = np.random.default_rng(2)
    events = [{**ev, "ts": ev["ts"] + int(rng.integers(-120, 1))} for ev in typed_stream(2)]
    events.append({"op": "edge_upsert", "src_type": "account", "src": "a1", "rel": "sends", "dst_type": "account",
                   "dst": "a1", "ts": 0})  # a late self-loop: one of the store's edges, one of the graph's
    state = tmp_path / "state"
    late = expired = 0
    for part, chunk in (("a", events[:250]), ("b", events[250:])):
        done = run_gnnstream("apply", "--state", state, "--model", model, "--batch", "29", "--edge-ttl", "90",
                             write(tmp_path / f"{part}.jsonl", chunk))
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        late, expired = late + summary["late_events"], expired + summary["edges_expired"]
    counts: dict[str, int] = {}
    want = typed_embeddings(events, SCHEMA, model, edge_ttl=90, counts=counts)
    assert late == counts["late"] > 20
    # the store expires at the end of a batch, the reference after every event: an edge that falls out and is
    # deleted or upserted again within one batch is counted by the reference only
    assert 0.9 * counts["expired"] <= expired <= counts["expired"]
    unwindowed = typed_embeddings(events, SCHEMA, model)
    assert sum(not np.allclose(want[v], unwindowed[v], atol=1e-3) for v in want) > 10  # the window takes edges out
    assert_embeddings_close(stored(state), want, what="typed embeddings with an edge window")
    check = run_gnnstream("verify", "--state", state)
    assert check.returncode == 0 and json.loads(check.stdout)["status"] == "ok", check.stdout + check.stderr


def test_a_typed_rollout_prepares_and_serves_the_new_version_exactly(tmp_path):
    """``rollout start`` of a typed model: a model that does not serve the live graph is refused in one line
    before anything is written; the new version's state holds its embeddings of the live graph, and then of the
    rest of the stream, each the typed reference's; the live state is untouched."""
    v1 = typed_model(tmp_path / "v1", 5, [3, 2])
    v2 = typed_model(tmp_path / "v2", 5, [3, 2], version=2, weights_seed=55)
    events = typed_stream(5, 400)
    live, new = tmp_path / "live", tmp_path / "new"
    assert run_gnnstream("apply", "--state", live, "--model", v1, write(tmp_path / "a.jsonl", events[:300])
                         ).returncode == 0
    before = stored(live)
    untyped = tmp_path / "untyped"
    assert run_gnnstream("model", "init", untyped, "--in-dim", "5", "--fanouts", "3,2", "--seed", "5", "--version",
                         "2").returncode == 0
    refused = run_gnnstream("rollout", "start", "--from", live, "--state", new, "--model", untyped, "--no-record")
    assert refused.returncode == 2 and refused.stderr.strip().endswith(
        f"state {str(live)!r} holds a typed graph (node types ['account', 'device', 'merchant']), which untyped "
        f"model model:2 does not serve; use a typed model of its schema"), refused.stderr
    assert not list(tmp_path.glob("new*"))
    done = run_gnnstream("rollout", "start", "--from", live, "--state", new, "--model", v2, "--no-record")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["serving"] == "model:1"
    assert_embeddings_close(stored(new), typed_embeddings(events[:300], SCHEMA, v2), what="v2 after rollout start")
    done = run_gnnstream("apply", "--state", new, "--model", v2, write(tmp_path / "b.jsonl", events[300:]))
    assert done.returncode == 0, done.stderr
    assert_embeddings_close(stored(new), typed_embeddings(events, SCHEMA, v2), what="v2 after the rest")
    assert stored(live) == before
    assert_embeddings_close(before, typed_embeddings(events[:300], SCHEMA, v1), what="v1 on the live state")


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


def test_only_the_serving_version_publishes_transaction_scores():
    """A worker publishes its pending transaction scores while its version serves (or no rollout named one);
    a candidate's, or the version rolled back from, are dropped: the serving version's workers publish them."""
    from types import SimpleNamespace

    from gnnstream.workers.runtime.metrics import WorkerMetrics
    from gnnstream.workers.runtime.worker import Worker

    class Scores:
        def __init__(self) -> None:
            self.pending, self.sent, self.published, self.unscored = [{"txn_id": "t1"}], [], 0, 0

        def publish(self) -> int:
            self.sent += self.pending
            self.published += len(self.pending)
            self.pending = []
            return len(self.sent)

    worker = Worker.__new__(Worker)
    worker.engine = SimpleNamespace(model_tag="pay:2")
    worker.errors = SimpleNamespace(cleared=lambda kind: None)
    worker.metrics = WorkerMetrics()
    for serving, published in ((None, 1), ("pay:2", 1), ("pay:1", 0)):
        worker.serving, worker._transactions = serving, Scores()
        worker._publish_transactions()
        assert (len(worker._transactions.sent), worker._transactions.pending) == (published, []), serving


def test_a_transaction_whose_end_the_batch_deletes_is_counted_unscored(tmp_path):
    """A payment, then its account deleted in the same batch: no embedding is left to score it with. The next
    payment is scored; the first is counted (and logged), not silently dropped."""
    from gnnstream.model.head import TransactionHead
    from gnnstream.workers.runtime.transactions import TransactionScores

    model = typed_model(tmp_path / "model", 3, [3, 2])
    TransactionHead("account__pays__merchant", (0.1,) * 10, 0.0, "model:1").save(model)

    class Producer:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def send(self, topic: str, key: bytes, value: bytes) -> None:
            self.sent.append(key)

        def flush(self, timeout: float) -> None:
            pass

    def node(t: str, i: str, ts: int) -> dict:
        return {"op": "node_upsert", "type": t, "id": i, "ts": ts, "features": [0.5] * SCHEMA["node_types"][t]}

    def pay(src: str, txn: str, ts: int) -> dict:
        return {"op": "edge_upsert", "src_type": "account", "src": src, "rel": "pays", "dst_type": "merchant",
                "dst": "m", "ts": ts, "features": [0.5, 0.5], "txn_id": txn}

    batch = [node("account", "a", 1), node("account", "b", 1), node("merchant", "m", 1), pay("a", "tA", 2),
             {"op": "node_delete", "type": "account", "id": "a", "ts": 3}, pay("b", "tB", 4)]
    producer = Producer()
    with GraphStore(tmp_path / "s", seed=3) as store:
        engine = Engine(store, load_model_dir(model))
        scores = TransactionScores.of(engine, producer, "txn", store)
        store.apply([e for ev in batch for e in engine.read_event(json.dumps(ev))], meta=scores.take())
        engine.recompute(drain=True)
        assert scores.publish() == 1
    assert (producer.sent, scores.published, scores.unscored) == ([b"tB"], 1, 1)
