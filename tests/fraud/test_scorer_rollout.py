"""The fraud scorer during a rollout: it follows the serving version, scores a canary of the others, reports."""

from __future__ import annotations

import itertools
import json
import threading
import time
import zlib
from collections import Counter
from typing import Any

import numpy as np
import pytest

from gnnstream.stream.backends import KAFKA_CLIENTS
from gnnstream.stream.clients import Record
from gnnstream.stream.kafka import EventConsumer, Producer, ensure_topics
from gnnstream.stream.rollout import SERVING_HEADER, version_topic
from gnnstream.stream.updates import encode_update, encode_updates, tombstone, EmbeddingUpdate
from tests.workers.reference import call_gnnstream
from gnnstream.fraud.canary import canary_mask, compare_scores, ks_statistic
from gnnstream.fraud.scorer import SUMMARY_KEYS, FraudScorer
from gnnstream.fraud.train import otc_labels, train_fraud_model
from gnnstream.stream.snap import read_snap
from gnnstream.model.head import ScoreHead, load_head

from tests.support import small_otc_csv as _small_csv


# ---------------------------------------------------------------------- reference computations (numpy, by hand)
def _ks_brute(a: list[float], b: list[float]) -> float:
    """The KS statistic by its definition: the largest gap between the empirical CDFs at any sample value."""
    xa, xb = np.asarray(a), np.asarray(b)
    return max(abs(float((xa <= x).mean()) - float((xb <= x).mean())) for x in np.concatenate([xa, xb]))


def _expected_report(latest: dict[str, dict[str, float]], serving: str) -> dict[str, Any]:
    names = [serving] + sorted(set(latest) - {serving})
    models = {}
    for m in names:
        x = np.asarray(list(latest[m].values()))
        models[m] = {"nodes": len(x), "mean": float(np.mean(x)), "p10": float(np.quantile(x, 0.1)),
                     "p50": float(np.quantile(x, 0.5)), "p90": float(np.quantile(x, 0.9))}
    pairs = []
    for a, b in itertools.combinations(names, 2):
        both = sorted(latest[a].keys() & latest[b].keys())
        xa = [latest[a][n] for n in both]
        xb = [latest[b][n] for n in both]
        d = np.abs(np.asarray(xa) - np.asarray(xb))
        pairs.append({"models": [a, b], "nodes": len(both), "mean_abs_diff": float(d.mean()),
                      "max_abs_diff": float(d.max()), "ks": _ks_brute(xa, xb)})
    return {"serving": serving, "models": models, "pairs": pairs}


def _assert_report(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got["serving"] == expected["serving"]
    assert list(got["models"]) == list(expected["models"])
    for m, stats in expected["models"].items():
        assert got["models"][m]["nodes"] == stats["nodes"]
        for key in ("mean", "p10", "p50", "p90"):
            assert got["models"][m][key] == pytest.approx(stats[key], abs=1e-12), (m, key)
    assert [p["models"] for p in got["pairs"]] == [p["models"] for p in expected["pairs"]]
    for g, e in zip(got["pairs"], expected["pairs"]):
        assert g["nodes"] == e["nodes"]
        for key in ("mean_abs_diff", "max_abs_diff", "ks"):
            assert g[key] == pytest.approx(e[key], abs=1e-12), key


def _score(head: ScoreHead, embedding: Any) -> float:
    return float(head.score(np.asarray(embedding, dtype=np.float32)[None, :])[0])


def _in_canary(node: str, fraction: float) -> bool:
    return zlib.crc32(node.encode()) / 2 ** 32 < fraction


# ---------------------------------------------------------------------- pure functions
def test_ks_statistic_and_report_on_known_arrays() -> None:
    a = np.linspace(0.0, 1.0, 11)
    assert ks_statistic(a, a) == 0.0
    assert ks_statistic(a, a[::-1].copy()) == 0.0  # order does not matter
    assert ks_statistic([0.1, 0.2, 0.3], [0.7, 0.8]) == 1.0  # disjoint
    assert ks_statistic([0.7, 0.8], [0.1, 0.2, 0.3]) == 1.0
    assert ks_statistic([1.0, 2.0, 3.0], [2.5]) == pytest.approx(2 / 3)  # at 2: 2/3 against 0
    assert ks_statistic([1.0, 2.0], [2.0, 3.0]) == pytest.approx(0.5)  # ties: the CDFs jump together
    assert ks_statistic([], [1.0]) is None and ks_statistic([1.0], []) is None
    rng = np.random.default_rng(1)
    x, y = rng.random(57), rng.random(33) + 0.2
    assert ks_statistic(x, y) == pytest.approx(_ks_brute(x.tolist(), y.tolist()), abs=1e-15)

    # serving m:2 scores 0.0 .. 1.0 (step 0.1) on n0..n10; m:1 scores the same nodes 0.05 higher, and n11 alone
    serving = {f"n{i}": i / 10 for i in range(11)}
    old = {f"n{i}": i / 10 + 0.05 for i in range(11)}
    old["n11"] = 0.5
    report = compare_scores({"m:1": old, "m:2": serving}, serving="m:2")
    assert report["serving"] == "m:2" and list(report["models"]) == ["m:2", "m:1"]
    assert report["models"]["m:2"] == pytest.approx({"nodes": 11, "mean": 0.5, "p10": 0.1, "p50": 0.5, "p90": 0.9})
    x1 = np.asarray(list(old.values()))
    assert report["models"]["m:1"] == pytest.approx({"nodes": 12, "mean": x1.mean(), "p10": np.quantile(x1, 0.1),
                                                     "p50": np.quantile(x1, 0.5), "p90": np.quantile(x1, 0.9)})
    (pair,) = report["pairs"]
    assert pair["models"] == ["m:2", "m:1"] and pair["nodes"] == 11
    assert pair["mean_abs_diff"] == pytest.approx(0.05) and pair["max_abs_diff"] == pytest.approx(0.05)
    assert pair["ks"] == pytest.approx(1 / 11)  # shifted by half a step: the CDFs differ by one value at most
    # identical scores: no difference at all; a model without nodes: no statistics, no error
    same = compare_scores({"a:1": serving, "a:2": dict(serving), "a:3": {}}, serving="a:1")
    assert same["pairs"][0] == {"models": ["a:1", "a:2"], "nodes": 11, "mean_abs_diff": 0.0, "max_abs_diff": 0.0,
                                "ks": 0.0}
    assert same["models"]["a:3"] == {"nodes": 0, "mean": None, "p10": None, "p50": None, "p90": None}
    assert same["pairs"][1] == {"models": ["a:1", "a:3"], "nodes": 0, "mean_abs_diff": None, "max_abs_diff": None,
                                "ks": None}
    # before any serving update: no serving model, the models by name
    assert list(compare_scores({"b:2": {}, "b:1": {}})["models"]) == ["b:1", "b:2"]


def test_canary_mask_is_a_stable_hash_of_the_node_id() -> None:
    ids = [f"node-{i}" for i in range(2000)] + ["ü-non-ascii"]
    expected = np.array([zlib.crc32(i.encode("utf-8")) / 2 ** 32 < 0.25 for i in ids])
    np.testing.assert_array_equal(canary_mask(ids, 0.25), expected)
    assert 400 < expected.sum() < 600  # about a quarter
    assert not canary_mask(ids, 0.0).any() and canary_mask(ids, 1.0).all()
    # a larger canary keeps the nodes of a smaller one
    assert (canary_mask(ids, 0.5) >= canary_mask(ids, 0.25)).all()


def test_scorer_rejects_bad_arguments(tmp_path) -> None:
    h1, h2 = ScoreHead((1.0,), 0.0, "m:1"), ScoreHead((1.0,), 0.0, "m:2")
    with pytest.raises(ValueError, match="one head, not 2"):
        FraudScorer("x:1", [h1, h2], in_topic="emb")
    with pytest.raises(ValueError, match="two heads for one model"):
        FraudScorer("x:1", [h1, ScoreHead((2.0,), 0.0, "m:1")])
    with pytest.raises(ValueError, match="without a model tag"):
        FraudScorer("x:1", ScoreHead((1.0,), 0.0))
    with pytest.raises(ValueError, match="between 0 and 1"):
        FraudScorer("x:1", [h1, h2], canary=1.5)
    with pytest.raises(ValueError, match="at least one head"):
        FraudScorer("x:1", [])
    with pytest.raises(ValueError, match="must differ"):
        FraudScorer("x:1", h1, canary=0.1, out_topic="s", canary_topic="s")
    scorer = FraudScorer("x:1", [h1, h2], out_topic="scores")
    assert scorer.in_topics == ["node-embeddings.m.v1", "node-embeddings.m.v2"]
    assert scorer.canary_topic == "scores.canary" and scorer.head is h1
    # an explicit (or empty: the worker settings' default) input topic with one head, as before
    assert FraudScorer("x:1", h1, in_topic="emb").in_topics == ["emb"]
    assert FraudScorer("x:1", h1, in_topic="").in_topics == ["node-embeddings.m.v1"]


def test_scorer_selects_serving_and_canary_rows_of_a_poll() -> None:
    """One poll, no broker: every row's fate, with two models of different sizes mixed in one topic's poll."""
    h1, h2 = ScoreHead((0.5, -1.0, 0.25), 0.1, "m:1"), ScoreHead((1.0, 0.5, -0.5, 2.0), -0.2, "m:2")
    nodes = [f"n{i}" for i in range(30)]
    canary = {n for n in nodes if _in_canary(n, 0.4)}
    assert 0 < len(canary) < len(nodes)
    rng = np.random.default_rng(7)
    records, expected_serving, expected_canary = [], [], []
    offset = itertools.count()
    for model, head, topic in (("m:1", h1, "node-embeddings.m.v1"), ("m:2", h2, "node-embeddings.m.v2")):
        for i, node in enumerate(nodes):
            emb = rng.normal(size=len(head.weights)).astype(np.float32)
            serving = "m:1" if i % 3 else "m:2"  # the serving version flips from node to node
            value = encode_update(EmbeddingUpdate(node, model, 4, emb, 100.0 + i, 200.0, "full"),
                                  "binary" if i % 2 else "json")
            records.append(Record(topic, 0, next(offset), node.encode(), value, 0, ((SERVING_HEADER,
                                                                                        serving.encode()),)))
            if serving == model:
                expected_serving.append((node, model, _score(head, emb)))
            if node in canary:
                expected_canary.append((node, model, "serving" if serving == model else "canary", _score(head, emb)))
    # an m:2 update in m:1's topic and one without the serving header (serving) in the same poll
    stray = rng.normal(size=4).astype(np.float32)
    records.append(Record("node-embeddings.m.v1", 1, next(offset), b"x", encode_update(
        EmbeddingUpdate("stray", "m:2", 9, stray, 1.0, 2.0, "full")), 0, ()))
    expected_serving.append(("stray", "m:2", _score(h2, stray)))
    # two tombstones of n0: v1's serving, v2's not
    for topic in ("node-embeddings.m.v1", "node-embeddings.m.v2"):
        records.append(Record(topic, 0, next(offset), b"n0", None, 0, ((SERVING_HEADER, b"m:1"),)))
    scorer = FraudScorer("unused:9092", [h1, h2], out_topic="s", canary=0.4)
    sent: list[tuple[str, bytes | None, bytes | None]] = []
    scorer._score_poll(records, lambda topic, key, value: sent.append((topic, key, value)))
    out = [(json.loads(v), k) for t, k, v in sent if t == "s" and v is not None]
    assert sorted((s["id"], s["model"], s["role"]) for s, _ in out) == sorted(
        (n, m, "serving") for n, m, _ in expected_serving)
    want = {(n, m): score for n, m, score in expected_serving}
    for s, key in out:
        assert key == s["id"].encode() and s["score"] == pytest.approx(want[(s["id"], s["model"])], abs=1e-6)
    assert [(t, k) for t, k, v in sent if v is None] == [("s", b"n0")]
    assert [v is None for t, k, v in sent if t == "s" and k == b"n0"] == [False, True]  # the tombstone last
    got_canary = sorted((json.loads(v)["id"], json.loads(v)["model"], json.loads(v)["role"], json.loads(v)["score"])
                        for t, _, v in sent if t == "s.canary")
    assert [g[:3] for g in got_canary] == sorted(e[:3] for e in expected_canary)
    for g, e in zip(got_canary, sorted(expected_canary)):
        assert g[3] == pytest.approx(e[3], abs=1e-6)
    non_serving_canary = sum(1 for e in expected_canary if e[2] == "canary")
    assert scorer.scored == len(expected_serving) == 31
    assert scorer.canary_scored == non_serving_canary
    assert scorer.not_serving == 60 - 30 - non_serving_canary + 1  # + v2's tombstone
    assert (scorer.deleted, scorer.invalid, scorer.other_model) == (1, 0, 0)
    # the report: the latest serving update was the stray m:2 one; n0 was deleted (both tombstones drop it)
    latest = {m: {n: round(s, 6) for n, mm, _, s in expected_canary if mm == m and n != "n0"} for m in ("m:1", "m:2")}
    report = scorer.canary_report()
    assert report["fraction"] == 0.4
    _assert_report(report, _expected_report(latest, "m:2"))


# the counts of `gnnstream score`'s JSON summary, whatever the heads and input topics
SCORE_SUMMARY = ["scored", "canary_scored", "not_serving", "deleted", "invalid", "other_model"]


def test_score_summary_has_the_same_keys_with_one_model_or_several() -> None:
    """One head on an explicit input topic, one head on its version topic, two heads: the same counts, each
    counted (no key left out while it is 0); a canary adds its report."""
    h1, h2 = ScoreHead((0.5, -1.0, 0.25), 0.1, "m:1"), ScoreHead((1.0, 0.5, -0.5, 2.0), -0.2, "m:2")
    assert list(SUMMARY_KEYS) == SCORE_SUMMARY
    emb = np.ones(3, dtype=np.float32)
    records = [Record("emb", 0, 0, b"a", encode_update(EmbeddingUpdate("a", "m:1", 1, emb, 1.0, 2.0, "full")), 0,
                      ((SERVING_HEADER, b"m:1"),)),
               Record("emb", 0, 1, b"b", encode_update(EmbeddingUpdate("b", "m:1", 1, emb, 1.0, 2.0, "full")), 0,
                      ((SERVING_HEADER, b"m:2"),)),
               Record("emb", 0, 2, b"c", b"not an update", 0, ()),
               Record("emb", 0, 3, b"d", None, 0, ())]
    shapes = {"one head, explicit topic": FraudScorer("unused:9092", h1, in_topic="emb", out_topic="s"),
              "one head": FraudScorer("unused:9092", h1, out_topic="s"),
              "two heads": FraudScorer("unused:9092", [h1, h2], out_topic="s")}
    for shape, scorer in shapes.items():
        assert list(scorer.summary()) == SCORE_SUMMARY, shape
        scorer._score_poll(records, lambda topic, key, value: None)
        assert scorer.summary() == {"scored": 1, "canary_scored": 0, "not_serving": 1, "deleted": 1, "invalid": 1,
                                    "other_model": 0}, shape
    canary = FraudScorer("unused:9092", h1, in_topic="emb", out_topic="s", canary=0.5)
    assert list(canary.summary()) == [*SCORE_SUMMARY, "canary"]


# ---------------------------------------------------------------------- against the embedded broker
def _read_all(bootstrap: str, topic: str, group: str, expected: int) -> list[Record]:
    consumer = EventConsumer(bootstrap, topic, group)
    got: list[Record] = []
    idle = 0
    try:
        while idle < 3:  # three empty polls once all expected records are in: nothing more comes
            records = consumer.poll_batch(1000, 1.0)
            got.extend(records)
            idle = 0 if records or len(got) < expected or not consumer.assignment() else idle + 1
            assert len(got) <= expected + 1000
    finally:
        consumer.close()
    return got


def _wait_for(scorer: FraudScorer, messages: int, thread: threading.Thread) -> None:
    """Until the scorer has counted ``messages`` messages (or fails the test after 120 s)."""
    deadline = time.monotonic() + 120
    while (scorer.scored + scorer.canary_scored + scorer.not_serving + scorer.deleted + scorer.invalid
           + scorer.other_model) < messages:
        assert thread.is_alive(), "the scorer stopped"
        assert time.monotonic() < deadline, "the scorer did not read the messages"
        time.sleep(0.1)


@pytest.mark.broker
@pytest.mark.parametrize("kafka_client", KAFKA_CLIENTS)
def test_scorer_follows_the_serving_version_through_a_rollout_and_back(kafka_client: str, broker,
                                                                        unique_name) -> None:
    name = unique_name("fr")
    m1, m2 = f"{name}:1", f"{name}:2"
    t1, t2 = version_topic(m1), version_topic(m2)
    score_topic, canary_topic, control_topic = unique_name("scores"), unique_name("canary"), unique_name("ctl")
    ensure_topics(broker.bootstrap, {t1: 2, t2: 2})
    h1 = ScoreHead((0.5, -1.0, 0.25), 0.1, m1)
    h2 = ScoreHead((1.0, 0.5, -0.5, 2.0), -0.2, m2)  # v2 has embeddings of another size
    heads = {m1: h1, m2: h2}
    fraction = 0.3
    nodes = [f"n{i}" for i in range(40)]
    canary = {n for n in nodes if _in_canary(n, fraction)}
    assert 0 < len(canary) < len(nodes)
    gone = min(canary)  # a canary node, deleted at the end
    rng = np.random.default_rng(11)
    embeddings: dict[tuple[str, str, int], np.ndarray] = {}

    def publish(producer: Producer, versions: range, serving: str) -> None:
        """Both versions' updates of every node for these embedding versions, computed while ``serving`` served."""
        for version in versions:
            for model, fmt in ((m1, "json"), (m2, "binary")):
                rows = rng.normal(size=(len(nodes), len(heads[model].weights))).astype(np.float32)
                for node, row in zip(nodes, rows):
                    embeddings[(node, model, version)] = row
                values = encode_updates(nodes, model, [version] * len(nodes), [1000.0 + version] * len(nodes),
                                        2000.0, ["full"] * len(nodes), rows, fmt)
                for node, value in zip(nodes, values):
                    producer.send(version_topic(model), node.encode(), value, [(SERVING_HEADER, serving.encode())])

    scorer = FraudScorer(broker.bootstrap, [h1, h2], out_topic=score_topic, canary=fraction,
                         canary_topic=canary_topic, control_topic=control_topic, report_every_s=3600.0,
                         group=unique_name("g"), kafka_client=kafka_client)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(scorer.run()))
    thread.start()
    try:
        with Producer(broker.bootstrap) as producer:
            publish(producer, range(1, 3), m1)  # v1 serves
            publish(producer, range(3, 5), m2)  # promoted: v2 serves
            # a message without the serving header counts as serving; a model without a head; a poison message
            solo = np.asarray([0.3, 0.2, 0.1], dtype=np.float32)
            producer.send(t1, b"solo", encode_update(EmbeddingUpdate("solo", m1, 1, solo, 5.0, 6.0, "full")))
            producer.send(t1, b"n1", encode_update(EmbeddingUpdate("n1", f"{name}:3", 1, solo, 5.0, 6.0, "full")),
                          [(SERVING_HEADER, m1.encode())])
            producer.send(t2, b"bad", b'{"hello":1}', [(SERVING_HEADER, m2.encode())])
            producer.flush(30)
        _wait_for(scorer, 4 * 2 * 40 + 3, thread)
        with Producer(broker.bootstrap) as producer:
            publish(producer, range(5, 6), m1)  # rolled back: v1 serves again
            for topic in (t1, t2):  # a canary node is deleted, while v1 serves
                key, value, headers = tombstone(gone, 6)
                producer.send(topic, key, value, headers + [(SERVING_HEADER, m1.encode())])
            producer.flush(30)
        _wait_for(scorer, 5 * 2 * 40 + 3 + 2, thread)
    finally:
        scorer.stop()
        thread.join(60)
    assert not thread.is_alive(), "the scorer did not stop"

    serving_of = {1: m1, 2: m1, 3: m2, 4: m2, 5: m1}
    non_serving_canary = len(canary) * 5
    assert {k: v for k, v in result.items() if k != "canary"} == {
        "scored": 40 * 5 + 1, "canary_scored": non_serving_canary,
        "not_serving": (40 - len(canary)) * 5 + 1,  # + v2's tombstone
        "deleted": 1, "invalid": 1, "other_model": 1}

    # the serving scores: each (node, version) exactly once, by the version serving when it was computed
    got = _read_all(broker.bootstrap, score_topic, unique_name("read"), 40 * 5 + 2)
    scores = [json.loads(r.value) for r in got if r.value is not None]
    assert [r.key for r in got if r.value is None] == [gone.encode()]
    assert [r.value is None for r in got if r.key == gone.encode()] == [False] * 5 + [True]  # deleted last
    seen = Counter((s["id"], s["model"], s["embedding_version"]) for s in scores)
    assert seen == Counter({**{(n, serving_of[v], v): 1 for n in nodes for v in range(1, 6)}, ("solo", m1, 1): 1})
    for s in scores:
        assert s["role"] == "serving"
        emb = solo if s["id"] == "solo" else embeddings[(s["id"], s["model"], s["embedding_version"])]
        assert s["score"] == pytest.approx(_score(heads[s["model"]], emb), abs=1e-6)
        assert s["event_ts"] == (5.0 if s["id"] == "solo" else 1000.0 + s["embedding_version"])

    # the canary topic: both versions' scores of every canary node and version, each tagged
    solo_in_canary = _in_canary("solo", fraction)  # it is, as it happens: a node only v1 scored
    got = _read_all(broker.bootstrap, canary_topic, unique_name("read"), len(canary) * 10 + solo_in_canary)
    both = [json.loads(r.value) for r in got]
    assert all(r.key == json.loads(r.value)["id"].encode() for r in got)
    assert Counter((s["id"], s["model"], s["embedding_version"], s["role"]) for s in both) == Counter(
        {**{(n, m, v, "serving" if serving_of[v] == m else "canary"): 1
            for n in canary for m in (m1, m2) for v in range(1, 6)},
         **({("solo", m1, 1, "serving"): 1} if solo_in_canary else {})})
    for s in both:
        emb = solo if s["id"] == "solo" else embeddings[(s["id"], s["model"], s["embedding_version"])]
        assert s["score"] == pytest.approx(_score(heads[s["model"]], emb), abs=1e-6)

    # the report: the latest scores of the canary nodes per model (the deleted one dropped); v1 serves at the end
    latest: dict[str, dict[str, float]] = {m1: {}, m2: {}}
    for s in sorted(both, key=lambda s: s["embedding_version"]):
        latest[s["model"]][s["id"]] = s["score"]
    for m in latest:
        del latest[m][gone]
    expected = _expected_report(latest, m1)
    assert result["canary"]["fraction"] == fraction
    _assert_report(result["canary"], expected)
    assert result["canary"]["models"][m1]["nodes"] == len(canary - {gone}) + solo_in_canary
    assert result["canary"]["pairs"][0]["nodes"] == len(canary - {gone})
    # ... produced once to the control topic (report_every_s is an hour: the one at the stop)
    got = _read_all(broker.bootstrap, control_topic, unique_name("read"), 1)
    assert [r.key for r in got] == [b"canary"]
    message = json.loads(got[0].value)
    assert message.pop("group") == scorer.group and isinstance(message.pop("at"), float)
    assert message.pop("kind") == "canary"
    assert message == result["canary"]


# ---------------------------------------------------------------------- train and the command line
def test_train_a_second_version_with_another_seed(tmp_path) -> None:
    csv = _small_csv(tmp_path)
    small = dict(epochs=2, hidden=4, out_dim=3, fanouts=(3, 2))
    first = train_fraud_model(csv, tmp_path / "v1", **small)
    second = train_fraud_model(csv, tmp_path / "v2", seed=2, version=2, **small)
    assert (first["model"], second["model"]) == ("otc-sage:1", "otc-sage:2")
    h1, h2 = load_head(tmp_path / "v1"), load_head(tmp_path / "v2")
    assert (h1.model, h2.model) == ("otc-sage:1", "otc-sage:2") and h1.weights != h2.weights
    assert json.loads((tmp_path / "v2" / "config.json").read_text())["version"] == 2
    with pytest.raises(ValueError, match="not NAME:VERSION"):
        train_fraud_model(csv, tmp_path / "bad", name="has space", **small)
    with pytest.raises(ValueError, match="version must be a non-negative integer"):
        train_fraud_model(csv, tmp_path / "bad", version=-1, **small)
    assert not (tmp_path / "bad").exists()
    # the command line: --name and --version make the tag
    labels = tmp_path / "labels.csv"
    labels.write_text("".join(f"{n},{y},{ts}\n" for n, (y, ts) in otc_labels(read_snap(csv), 0.7).items()))
    proc = call_gnnstream("train", "--events", csv, "--labels", labels, "--out", tmp_path / "cli", "--epochs", "1",
                          "--hidden", "4",
                          "--out-dim", "3", "--fanouts", "3,2", "--seed", "3", "--name", "otc-x", "--version", "4")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"] == "otc-x:4" and load_head(tmp_path / "cli").model == "otc-x:4"


def test_score_command_line_errors(tmp_path) -> None:
    for args, expected in ((("--canary", "1.5"), "argument --canary: expected a fraction of nodes between 0 and 1 "
                                                 "(got '1.5')"),
                           (("--canary", "x"), "argument --canary: expected a fraction of nodes between 0 and 1 "
                                               "like 0.05 (got 'x')"),
                           (("--model", "b", "--output-topic", "emb"), "gnnstream: error: --output-topic reads one "
                                                                       "topic, for one --model (got 2)")):
        proc = call_gnnstream("score", "--model", "a", *args)
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr and "Traceback" not in proc.stderr
        assert len([line for line in proc.stderr.splitlines() if "error" in line]) == 1
    proc = call_gnnstream("train", "--events", "x.csv", "--out", tmp_path / "m", "--version", "v2")
    assert proc.returncode == 2 and "argument --version: expected a non-negative whole number" in proc.stderr
