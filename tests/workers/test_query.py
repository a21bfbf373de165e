"""The query API's answers (workers/query/state.py), read from a follower of a live state.

What-if answers are checked two ways: against the independent PyG reference
on the folded graph with the what-if events added, and against what the
engine stores once the events are really applied (``apply``, ``recompute``,
``drain``). Lookups are checked against the stored page log and the
reference. Before the events are applied, the state must be unchanged by
any number of what-if requests: the stored embeddings hash the same and
still equal the reference.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gnnstream.graph_state.store import GraphStore
from gnnstream.model import load_model_dir
from gnnstream.stream.events import EdgeUpsert, NodeDelete, NodeUpsert, decode_event_json
from tests.workers.reference import GraphFold, assert_embeddings_close, expected_modes, fast_tempdir, \
    reference_embeddings
from tests.support import FANOUTS, HUB, LEAVES, MODELS, SEED, SETTINGS, event_group as _event_group, \
    nonzero_features as _nonzero, to_event as _to_event
from gnnstream.workers.engine import Engine
from gnnstream.workers.query.state import MAX_EVENTS, QueryError, QueryState, load_infer_body
from gnnstream.graph_state.exceptions import StateModelMismatch
from gnnstream.graph_state.page_log import PageLog
from gnnstream.model.head import ScoreHead


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    """A base stream (a hub past the cached rank prefix, then random steps) and a what-if on top of it."""
    rnd = draw(st.randoms(use_true_random=False))
    steps = []
    for leaf in LEAVES[:draw(st.integers(34, len(LEAVES)))]:
        steps.append(("edge_upsert", HUB, leaf) if rnd.random() < 0.5 else ("edge_upsert", leaf, HUB))
        if rnd.random() < 0.3:
            steps.append(("node_upsert", leaf, _nonzero(rnd)))
    groups = draw(st.lists(_event_group(), min_size=5, max_size=40))
    steps += [s for g in groups for s in g]
    base = [_to_event(step, 1000 + i) for i, step in enumerate(steps)]
    what_if = [s for g in draw(st.lists(_event_group(), min_size=1, max_size=6)) for s in g]
    if draw(st.booleans()):  # a payment from a node the graph has never seen
        what_if.append(("edge_upsert", "new-payer", draw(st.sampled_from(["a", "b", HUB, LEAVES[0]]))))
    events = [_to_event(step, 5000 + i) for i, step in enumerate(what_if)]
    # events applied but not recomputed yet: the view is dirty, no stored row may be trusted
    pending = [_to_event(s, 4000 + i) for i, s in enumerate(s for g in draw(st.lists(_event_group(), max_size=3))
                                                            for s in g)]
    return {"base": base, "pending": pending, "what_if": events, "model": draw(st.sampled_from(sorted(MODELS)))}


def _fold(events: list) -> GraphFold:
    fold = GraphFold()
    for ev in events:
        fold.apply_event(ev)
    return fold


def _stored(store: GraphStore) -> tuple[dict[str, np.ndarray], str]:
    """The live stored final embeddings and a hash of the whole page log (metadata and rows)."""
    digest = hashlib.sha256()
    rows = {}
    for iid, meta, row in PageLog(store).items():
        digest.update(f"{iid}:{meta.version}:{meta.mode}:".encode())
        if row is not None:
            digest.update(row.tobytes())
        if meta.mode != "deleted" and row is not None:
            rows[store.name(iid)] = row
    return rows, digest.hexdigest()


@given(scenarios())
@SETTINGS
def test_what_if_equals_applying_the_events(model_dirs: dict[str, Path], case: dict[str, Any]) -> None:
    model_dir = model_dirs[case["model"]]
    base, what_if, pending = case["base"], case["what_if"], case["pending"]
    with fast_tempdir() as tmp:
        with GraphStore(Path(tmp) / "s", seed=SEED) as store:
            engine = Engine(store, load_model_dir(model_dir), hub_bound=3, max_deferred_age=3600.0)
            store.apply(base)
            engine.recompute(drain=True)
            store.apply(pending)
            view = QueryState(store.path, model_dir, Path(tmp) / "q")
            try:
                view.refresh()
                assert (view.status()["dirty"] == 0) == (store.dirty_count() == 0)
                before, digest = _stored(store)
                fold = _fold(base + pending + what_if)
                ids = sorted(fold.nodes)
                if not ids:
                    return
                got = view.infer(what_if, ids)
                # the independent reference on the graph with the events applied
                want = reference_embeddings(fold.nodes, fold.edges, fold.features, model_dir)
                assert_embeddings_close(got["embeddings"], want, what="what-if against the reference")
                modes = expected_modes(fold, model_dir)
                assert got["modes"] == {v: modes[v] for v in ids}
                # nothing changed: the page log hashes the same and still holds the base graph's embeddings
                again, digest_after = _stored(store)
                assert digest_after == digest
                base_fold = _fold(base)
                assert_embeddings_close({v: again[v] for v in base_fold.nodes},
                                        reference_embeddings(base_fold.nodes, base_fold.edges, base_fold.features,
                                                             model_dir),
                                        what="stored embeddings after the what-if")
                # the same events really applied: the engine stores what the what-if answered
                store.apply(what_if)
                engine.recompute(drain=True)
                applied, _ = _stored(store)
                assert_embeddings_close({v: got["embeddings"][v] for v in ids}, {v: applied[v] for v in ids},
                                        what="what-if against apply + recompute")
                # and the follower's lookups see the applied state once caught up
                view.refresh()
                for v in ids:
                    answer = view.embedding(v)
                    np.testing.assert_array_equal(answer["embedding"], applied[v])
                    assert answer["mode"] == modes[v]
                for gone in sorted((base_fold.nodes | _fold(base + pending).nodes) - fold.nodes):
                    with pytest.raises(QueryError) as err:
                        view.embedding(gone)
                    assert err.value.status == 404
            finally:
                view.close()


def test_lookup_and_samples_of_every_node(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = model_dirs["sage"]
    rnd = random.Random(5)
    events = []
    for i in range(400):
        a, b = f"n{rnd.randrange(60)}", f"n{rnd.randrange(60)}"
        events.append(EdgeUpsert(a, b, float(i)))
        if i % 3 == 0:
            events.append(NodeUpsert(a, float(i), _nonzero(rnd)))
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, load_model_dir(model_dir))
        store.apply(events)
        engine.recompute(drain=True)
        stored, _ = _stored(store)
        view = QueryState(store.path, model_dir, tmp_path / "q")
        try:
            view.refresh()
            fold = _fold(events)
            want = reference_embeddings(fold.nodes, fold.edges, fold.features, model_dir)
            got = {}
            for v in sorted(fold.nodes):
                answer = view.embedding(v)
                assert answer["id"] == v and answer["model"] == engine.model_tag and answer["version"] >= 1
                np.testing.assert_array_equal(answer["embedding"], stored[v])
                got[v] = answer["embedding"]
                samples = view.samples(v)
                assert [layer["sample"] for layer in samples["layers"]] == [store.sample(v, k) for k in FANOUTS]
            assert_embeddings_close(got, want, what="lookups")
            # a new batch is seen after a refresh, not before
            store.apply([NodeUpsert("n1", 9999.0, (5.0, -5.0, 5.0, -5.0))])
            engine.recompute(drain=True)
            old = view.embedding("n1")
            view.refresh()
            new = view.embedding("n1")
            assert new["version"] > old["version"]
            np.testing.assert_array_equal(new["embedding"], _stored(store)[0]["n1"])
            # many batches later (pages superseded, deleted, their frames reused) every lookup still equals the
            # stored row, and the follower knows exactly the pages the writer kept
            for round_ in range(40):
                changed = [f"n{rnd.randrange(60)}" for _ in range(8)]
                store.apply([NodeUpsert(v, 10_000.0 + round_, _nonzero(rnd)) for v in changed])
                engine.recompute(drain=True)
                view.refresh()
                stored, _ = _stored(store)
                for v in changed:
                    np.testing.assert_array_equal(view.embedding(v)["embedding"], stored[v])
            # the frames lookups kept (every row of a page they read) answer no node the writer rewrote or
            # deleted since
            for v, row in stored.items():
                np.testing.assert_array_equal(view.embedding(v)["embedding"], row)
            store.apply([NodeDelete(changed[0], 20_000.0)])
            engine.recompute(drain=True)
            view.refresh()
            with pytest.raises(QueryError) as err:
                view.embedding(changed[0])
            assert err.value.status == 404
            pages = {int.from_bytes(key, "big") for key in store.column("embpages").keys()}
            assert set(view.log(len(FANOUTS))._size) == pages
            # the h^1 log, read by no lookup, follows those 41 catch-ups at once when next read
            layer = {int.from_bytes(key[1:], "big") for key in store.column("layerpages").keys() if key[0] == 1}
            assert layer and set(view.log(1)._size) == layer
        finally:
            view.close()


def test_lookup_between_a_batch_and_its_recompute(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A node deleted (or created) by a batch the worker has not recomputed yet: its stored row is not
    answered (nor a row it does not have), as the node records say."""
    model_dir = model_dirs["sage"]
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, load_model_dir(model_dir))
        store.apply([EdgeUpsert("a", "b", 1.0), EdgeUpsert("b", "c", 2.0)])
        engine.recompute(drain=True)
        view = QueryState(store.path, model_dir, tmp_path / "q")
        try:
            view.refresh()
            row = view.embedding("a")["embedding"].copy()
            store.apply([NodeDelete("b", 3.0), EdgeUpsert("c", "d", 3.0)])  # not recomputed yet
            view.refresh()
            for name, message in (("b", "no node 'b'"), ("d", "node 'd' has no embedding yet")):
                with pytest.raises(QueryError) as err:
                    view.embedding(name)
                assert (err.value.status, str(err.value)) == (404, message)
            np.testing.assert_array_equal(view.embedding("a")["embedding"], row)  # marked, its stored row
            engine.recompute(drain=True)
            view.refresh()
            with pytest.raises(QueryError) as err:
                view.embedding("b")
            assert (err.value.status, str(err.value)) == (404, "no node 'b'")
            assert view.embedding("d")["version"] >= 1
        finally:
            view.close()


def test_a_view_refuses_a_model_other_than_the_states(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """As apply and run do: the state's embeddings were computed by another model, so neither its rows nor a
    what-if with the other weights would be the state's answers."""
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, load_model_dir(model_dirs["sage"]))
        store.apply([EdgeUpsert("a", "b", 1.0)])
        engine.backfill()
        with pytest.raises(StateModelMismatch) as err:
            QueryState(store.path, model_dirs["gcn"], tmp_path / "q")
        assert "holds the embeddings of model" in str(err.value) and "\n" not in str(err.value)
        QueryState(store.path, model_dirs["sage"], tmp_path / "q2").close()


def test_scores_come_with_a_fraud_head(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = model_dirs["sage"]
    head = ScoreHead(tuple(float(i) - 2.5 for i in range(6)), 0.25)
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, load_model_dir(model_dir))
        store.apply([EdgeUpsert("a", "b", 1.0), NodeUpsert("a", 1.0, (1.0, 2.0, 3.0, 4.0))])
        engine.recompute(drain=True)
        view = QueryState(store.path, model_dir, tmp_path / "q", head=head)
        try:
            view.refresh()
            got = view.infer([EdgeUpsert("a", "c", 2.0)], ["a", "c"])
            for v in ("a", "c"):
                assert got["scores"][v] == pytest.approx(float(head.score(got["embeddings"][v][None, :])[0]))
                assert 0.0 < got["scores"][v] < 1.0
        finally:
            view.close()


@pytest.mark.parametrize("body, status, words", [
    ([], 400, "JSON object"),
    ({"events": [], "ids": []}, 400, "non-empty list"),
    ({"events": {}, "ids": ["a"]}, 400, "list of event objects"),
    ({"events": [], "ids": ["a"], "extra": 1}, 400, "unknown field"),
    ({"events": [{"op": "edge_upsert", "src": "a", "dst": "b", "ts": 1}, {"op": "nope"}], "ids": ["a"]}, 400,
     "event 1: unknown_op"),
    ({"events": [{"op": "node_upsert", "id": "a", "ts": 1, "features": [1.0]}], "ids": ["a"]}, 400,
     "event 0: wrong_feature_length: node 'a' has 1 features, the model expects 4"),
    ({"events": [{"op": "node_upsert", "id": "a", "ts": 1, "features": [1e39, 0, 0, 0]}], "ids": ["a"]}, 400,
     "event 0: not_finite: a feature of node 'a' is beyond ±1e+15, where the model's sums could overflow float32"),
    ({"events": [{"op": "edge_upsert", "src": "a", "dst": str(i), "ts": 1} for i in range(MAX_EVENTS + 1)],
      "ids": ["a"]}, 413, f"at most {MAX_EVENTS}"),
    ({"events": [], "ids": [True]}, 400, "ids[0]: id must be a string or integer (got bool)"),
    # ids are held to the stream's rules for an event's ids
    ({"events": [], "ids": ["a", ""]}, 400, "ids[1]: id is empty"),
    ({"events": [], "ids": ["x" * 257]}, 400, "ids[0]: id is longer than 256 bytes"),
    ({"events": [], "ids": [10 ** 300]}, 400, "ids[0]: id is an integer longer than 256 digits"),
])
def test_bad_what_ifs_are_refused_with_a_reason(model_dirs: dict[str, Path], tmp_path: Path, body: Any,
                                                status: int, words: str) -> None:
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, load_model_dir(model_dirs["sage"]))
        store.apply([EdgeUpsert("a", "b", 1.0)])
        engine.recompute(drain=True)
        view = QueryState(store.path, model_dirs["sage"], tmp_path / "q")
        try:
            view.refresh()
            with pytest.raises(QueryError) as err:
                view.parse_infer(body)
            assert err.value.status == status and words in str(err.value)
            with pytest.raises(QueryError) as err:
                view.infer([], ["never-seen"])
            assert err.value.status == 404
        finally:
            view.close()


def test_a_body_that_repeats_a_field_is_refused_as_an_event_would_be() -> None:
    for raw in (b'{"events": [], "ids": ["a"], "ids": ["b"]}',
                b'{"events": [{"op": "node_delete", "id": "a", "id": "b", "ts": 1}], "ids": ["a"]}'):
        with pytest.raises(QueryError) as err:
            load_infer_body(raw)
        assert err.value.status == 400 and "the body repeats a field: field 'i" in str(err.value)


def test_integer_ids_of_any_size_are_their_decimal_string(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """An integer id past 64 bits, in ``ids`` and in events, names the node the stream names by it."""
    big = 2 ** 70 + 1
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, load_model_dir(model_dirs["sage"]))
        store.apply([decode_event_json(json.dumps({"op": "edge_upsert", "src": big, "dst": "a", "ts": 1}))])
        engine.recompute(drain=True)
        view = QueryState(store.path, model_dirs["sage"], tmp_path / "q")
        try:
            view.refresh()
            body = {"events": [{"op": "edge_upsert", "src": "b", "dst": big, "ts": 2}], "ids": [big, str(big), 7]}
            events, ids = view.parse_infer(load_infer_body(json.dumps(body).encode()))
            assert ids == [str(big), str(big), "7"] and events[0].dst == str(big)
            stored = view.embedding(str(big))["embedding"]
            got = view.infer([], ids[:1])["embeddings"]
            assert list(got) == [str(big)]
            np.testing.assert_allclose(got[str(big)], stored, rtol=0, atol=1e-5)
        finally:
            view.close()


@pytest.mark.parametrize("name", ["gcn", "sage"])
def test_a_new_edge_two_hops_away_reaches_through_sample_sizes(model_dirs: dict[str, Path], tmp_path: Path,
                                                                name: str) -> None:
    """``t - v - u`` and a what-if edge ``u - x``: ``h^0`` of ``u`` and ``v`` stay as they are, but GCN
    normalises ``v``'s row by ``|S(u)|``, so ``t``'s answer must change with GCN (and must not with SAGE)."""
    model_dir = model_dirs[name]
    feats = {v: (1.0 + i, -0.5 * i, 0.25, 2.0 - i) for i, v in enumerate(["t", "v", "u", "x"])}
    base = [EdgeUpsert("t", "v", 1.0), EdgeUpsert("v", "u", 2.0)] + [NodeUpsert(v, 3.0, f) for v, f in feats.items()]
    what_if = [EdgeUpsert("u", "x", 4.0)]
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, load_model_dir(model_dir))
        store.apply(base)
        engine.recompute(drain=True)
        view = QueryState(store.path, model_dir, tmp_path / "q")
        try:
            view.refresh()
            got = view.infer(what_if, ["t"])["embeddings"]["t"]
            before = view.embedding("t")["embedding"]
        finally:
            view.close()
    fold = _fold(base + what_if)
    want = reference_embeddings(fold.nodes, fold.edges, fold.features, model_dir)["t"]
    assert_embeddings_close({"t": got}, {"t": want}, what="what-if two hops away")
    moved = float(np.abs(want - before).max())
    assert (moved > 1e-4) == (name == "gcn"), moved


def test_a_view_behind_the_writer_never_answers_a_reused_frame(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The writer rewrites every node three times while the view does not catch up: the frames the view's
    pages name are reused. Each answer is then a stored (version, row) pair, never a row of another version.
    (The view reads no row before: it would keep it, and answer it without reading the frame again.)"""
    model_dir = model_dirs["sage"]
    rnd = random.Random(9)
    nodes = [f"n{i}" for i in range(300)]
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, load_model_dir(model_dir))
        store.apply([EdgeUpsert(a, rnd.choice(nodes), 1.0) for a in nodes])
        engine.recompute(drain=True)
        view = QueryState(store.path, model_dir, tmp_path / "q")
        try:
            view.refresh()
            stored = [(store.name(iid), meta.version, row) for iid, meta, row in PageLog(store).items()]
            seen = {v: version for v, version, _ in stored}
            versions: dict[str, dict[int, np.ndarray]] = {v: {version: row} for v, version, row in stored}
            for round_ in range(3):
                store.apply([NodeUpsert(v, 2.0 + round_, _nonzero(rnd)) for v in nodes])
                engine.recompute(drain=True)
                for iid, meta, row in PageLog(store).items():
                    versions[store.name(iid)][meta.version] = row
            refreshed = 0
            for v in nodes:
                answer = view.embedding(v)
                np.testing.assert_array_equal(answer["embedding"], versions[v][answer["version"]])
                refreshed += answer["version"] > seen[v]
            assert refreshed, "no frame was reused: the test does not test what it says"
        finally:
            view.close()
