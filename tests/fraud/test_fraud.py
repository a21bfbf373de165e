"""Fraud scoring: training on Bitcoin OTC, the ROC AUC helper, and the scorer against the embedded broker."""

from __future__ import annotations

import gzip
import json
import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from gnnstream.graph_state.store import GraphStore
from gnnstream.model import load_model_dir
from gnnstream.stream.backends import KAFKA_CLIENTS
from gnnstream.stream.clients import Record
from gnnstream.stream.kafka import EventConsumer, Producer, ensure_topics
from gnnstream.stream.exceptions import InvalidUpdate
from gnnstream.stream.updates import EmbeddingUpdate, encode_update, tombstone
from tests.support import small_otc_csv as _small_csv
from tests.workers.reference import call_gnnstream
from gnnstream.fraud.datasets import BITCOIN_OTC, rhythm
from gnnstream.stream.snap import SnapRating, read_snap, snap_events
from gnnstream.workers.engine import Engine
from gnnstream.fraud.scorer import FraudScorer, decode_updates, encode_scores
from gnnstream.fraud.train import distrust_labels, roc_auc, train_fraud_model
from gnnstream.model.head import ScoreHead, load_head

DATA = BITCOIN_OTC


def _decoded(scorer, records):
    """The scorable updates of ``records``, all of one embedding size."""
    (chunk, _), = scorer._decode_rows(records)
    return chunk


def _otc() -> Path:
    return DATA


def test_roc_auc_matches_hand_computed_values() -> None:
    assert roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == pytest.approx(0.75)
    assert roc_auc(np.array([1, 0]), np.array([0.9, 0.1])) == 1.0
    assert roc_auc(np.array([1, 0]), np.array([0.1, 0.9])) == 0.0
    assert roc_auc(np.array([1, 0, 1, 0]), np.array([0.5, 0.5, 0.5, 0.5])) == 0.5  # ties count half
    with pytest.raises(ValueError, match="both classes"):
        roc_auc(np.array([1, 1]), np.array([0.2, 0.3]))


def test_rhythm_counts_when_users_meet_their_counterparties() -> None:
    day = 86_400.0
    rows = [SnapRating("a", "b", 1, 0.0), SnapRating("a", "c", 1, 0.5 * day), SnapRating("b", "a", 1, day),
            SnapRating("d", "a", -1, 3 * day), SnapRating("a", "a", 1, 4 * day), SnapRating("c", "b", 1, 9 * day)]
    got = rhythm(rows)
    # ages at the 2nd counterparty: a 0.5 d (c), b 9 d (c), c 8.5 d (b; c was first rated at 0.5 d); d has one;
    # at the 3rd: a 3 d (d); a rating itself is no counterparty
    assert got["users"] == 4 and got["ratings"] == 6
    assert got["counterparty_2"] == {"users": 3, "age_days_p25": 4.5, "age_days_p50": 8.5, "age_days_p75": 8.75,
                                     "within_1d": 0.333, "within_7d": 0.333}
    assert got["counterparty_3"] == {"users": 1, "age_days_p25": 3.0, "age_days_p50": 3.0, "age_days_p75": 3.0,
                                     "within_1d": 0.0, "within_7d": 1.0}
    assert got["users_ending_below_3"] == 0.75 and got["ratings_per_year"] == {"1970": 6}


def test_distrust_labels_average_received_ratings() -> None:
    rows = read_snap(_otc())[:2000]
    labels = distrust_labels(rows)
    received: dict[str, list[float]] = {}
    for r in rows:
        received.setdefault(r.dst, []).append(r.rating)
    assert labels == {n: int(sum(v) / len(v) < 0) for n, v in received.items()}
    assert 0 < sum(labels.values()) < len(labels)


def test_trained_model_is_servable_and_head_scores(tmp_path: Path) -> None:
    csv = tmp_path / "otc-head.csv"
    with gzip.open(_otc(), "rt") as fh:
        csv.write_text("".join(line for _, line in zip(range(3000), fh)))
    summary = train_fraud_model(csv, tmp_path / "model", epochs=40, hidden=16, out_dim=8, fanouts=(5, 3))
    assert summary["train_ratings"] == 2100 and summary["labelled"] > 100
    assert 0.5 < summary["train_auc"] <= 1.0
    loaded = load_model_dir(tmp_path / "model")
    head = load_head(tmp_path / "model")
    assert len(head.weights) == loaded.config.out_dim == 8
    # the head records the model it was trained for: the tag the worker publishes
    assert head.model == summary["model"] == "otc-sage:1"
    assert json.loads((tmp_path / "model" / "head.json").read_text())["model"] == "otc-sage:1"
    # the worker serves it: the engine backfills a store built from the same events
    with GraphStore(tmp_path / "state", seed=loaded.config.seed) as store:
        store.apply(list(snap_events(read_snap(csv))))
        engine = Engine(store, loaded)
        engine.backfill()
        targets, rows = engine.from_scratch()
        stored, present = engine.tables.get(engine.num_layers, targets)
        assert present.all() and np.abs(stored - rows).max() < 1e-5
    scores = head.score(rows)
    assert scores.shape == (len(targets),) and np.all((scores > 0) & (scores < 1))


@pytest.mark.broker
@pytest.mark.parametrize("kafka_client", KAFKA_CLIENTS)
def test_scorer_scores_every_published_embedding(kafka_client: str, broker, unique_name) -> None:
    emb_topic, score_topic = unique_name("emb"), unique_name("scores")
    ensure_topics(broker.bootstrap, {emb_topic: 2, score_topic: 2})
    head = ScoreHead((0.5, -1.0, 0.25), 0.1)
    rng = np.random.default_rng(3)
    updates = [EmbeddingUpdate(f"n{i % 40}", "m:1", i // 40 + 1, rng.normal(size=3).astype(np.float32),
                               1000.0 + i, 2000.0 + i, "full") for i in range(200)]
    with Producer(broker.bootstrap) as producer:
        for u in updates:
            producer.send(emb_topic, u.id.encode(), encode_update(u, "binary" if u.version % 2 else "json"))
        key, value, headers = tombstone("gone", 7)
        producer.send(emb_topic, key, value, headers)
        producer.flush(30)
    scorer = FraudScorer(broker.bootstrap, head, in_topic=emb_topic, out_topic=score_topic, group=unique_name("g"),
                         kafka_client=kafka_client)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(scorer.run(max_idle_s=4.0)))
    thread.start()
    thread.join(90)
    assert not thread.is_alive(), "scorer did not stop when idle"
    assert result == {"scored": 200, "canary_scored": 0, "not_serving": 0, "deleted": 1, "invalid": 0,
                      "other_model": 0}
    consumer = EventConsumer(broker.bootstrap, score_topic, unique_name("read"))
    got, idle = [], 0
    try:
        while idle < 3 and len(got) < 201:
            records = consumer.poll_batch(500, 1.0)
            got.extend(records)
            idle = 0 if records else idle + (1 if consumer.assignment() else 0)
    finally:
        consumer.close()
    scored = {(s["id"], s["embedding_version"]): s for s in (json.loads(r.value) for r in got if r.value is not None)}
    assert set(scored) == {(u.id, u.version) for u in updates}
    for u in updates:
        expected = float(head.score(np.asarray(u.embedding)[None, :])[0])
        assert scored[(u.id, u.version)]["score"] == pytest.approx(expected, abs=1e-6)
        assert scored[(u.id, u.version)]["model"] == "m:1"
        assert scored[(u.id, u.version)]["event_ts"] == u.event_ts
    assert [r.key for r in got if r.value is None] == [b"gone"]


def test_decode_updates_batches_json_and_binary_and_rejects_bad_ones() -> None:
    rng = np.random.default_rng(5)
    updates = [EmbeddingUpdate(f"n{i}", "m:1", i, rng.normal(size=4).astype(np.float32), 1000.0 + i, 2000.0, "full")
               for i in range(30)]
    for fmts in (["json"], ["binary"], ["json", "binary"], ["binary", "json"]):
        cols = decode_updates([encode_update(u, fmts[i % len(fmts)]) for i, u in enumerate(updates)])
        assert cols.ids == [u.id for u in updates] and cols.versions == [u.version for u in updates]
        assert cols.models == ["m:1"] * 30 and cols.event_ts == [u.event_ts for u in updates]
        assert cols.rows.dtype == np.float32
        np.testing.assert_array_equal(cols.rows, np.stack([u.embedding for u in updates]))
    good = encode_update(updates[0])
    for bad, reason in ((good.replace(b'"version":0', b'"version":true'), "bad_field"),
                        (good.replace(b'"embedding":[', b'"embedding":[true,'), "bad_type"),
                        (good[:-3], "not_json")):
        for first in ("json", "binary"):  # a poll read as JSON, or first tried as binary columns
            with pytest.raises(InvalidUpdate) as info:
                decode_updates([encode_update(updates[1], first), bad])
            assert info.value.reason == reason
    head = ScoreHead((0.5, -1.0, 0.25, 2.0), 0.1)
    messages = encode_scores(["a", "b"], head.score(np.eye(4, dtype=np.float32)[:2]), [3, 4], ["m:1", "m:1"],
                             [5.0, 6.5], 7.25)
    assert [json.loads(m) for m in messages] == [
        {"id": "a", "score": round(float(head.score(np.eye(4)[:1])[0]), 6), "embedding_version": 3, "model": "m:1",
         "event_ts": 5.0, "scored_at": 7.25},
        {"id": "b", "score": round(float(head.score(np.eye(4)[1:2])[0]), 6), "embedding_version": 4, "model": "m:1",
         "event_ts": 6.5, "scored_at": 7.25}]


def _updates(n: int, model: str = "m:1", dim: int = 3, seed: int = 11) -> list[EmbeddingUpdate]:
    rng = np.random.default_rng(seed)
    return [EmbeddingUpdate(f"n{i}", model, i + 1, rng.normal(size=dim).astype(np.float32), 1000.0 + i, 2000.0,
                            "full") for i in range(n)]


def _records(values: list[bytes]) -> list[Record]:
    return [Record("emb", 1, 100 + i, b"k", v, 0) for i, v in enumerate(values)]


def test_scorer_decode_skips_bad_and_other_model_updates(caplog) -> None:
    head = ScoreHead((0.5, -1.0, 0.25), 0.1, "m:1")
    scorer = FraudScorer("unused:9092", head, in_topic="emb")
    good = _updates(6)
    # a clean poll stays on the batch path and keeps everything
    cols = _decoded(scorer, _records([encode_update(u) for u in good]))
    assert cols.ids == [u.id for u in good]
    np.testing.assert_array_equal(cols.rows, np.stack([u.embedding for u in good]))
    # one well-formed update of another model: dropped from the batch, counted
    other = _updates(1, model="m:2")[0]
    values = [encode_update(u) for u in good[:3]] + [encode_update(other)] + [encode_update(u) for u in good[3:]]
    cols = _decoded(scorer, _records(values))
    assert cols.ids == [u.id for u in good] and cols.rows.shape == (6, 3)
    assert (scorer.invalid, scorer.other_model) == (0, 1)
    # poison, another model, a wrong size and a binary update in one poll: decoded message by message
    values = [encode_update(good[0]), b'{"hello":1}', encode_update(other), encode_update(_updates(1, dim=5)[0]),
              encode_update(good[1], "binary"), b"\x00junk"]
    with caplog.at_level(logging.WARNING, logger="gnnstream.fraud.scorer"):
        cols = _decoded(scorer, _records(values))
    assert cols.ids == ["n0", "n1"] and cols.versions == [1, 2] and cols.models == ["m:1", "m:1"]
    np.testing.assert_array_equal(cols.rows, np.stack([good[0].embedding, good[1].embedding]))
    assert (scorer.invalid, scorer.other_model) == (3, 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("emb partition 1 offset 101 (missing_field:" in w for w in warnings)
    assert any("emb partition 1 offset 103 (bad_dim:" in w for w in warnings)
    assert any("emb partition 1 offset 105 (" in w for w in warnings)
    # a head without a model tag (trained before it was recorded) scores every model of its size
    untagged = FraudScorer("unused:9092", ScoreHead((0.5, -1.0, 0.25), 0.1), in_topic="emb")
    cols = _decoded(untagged, _records([encode_update(good[0]), encode_update(other)]))
    assert cols.models == ["m:1", "m:2"] and untagged.other_model == 0


@pytest.mark.broker
@pytest.mark.parametrize("kafka_client", KAFKA_CLIENTS)
def test_scorer_skips_poison_message_and_commits(kafka_client: str, broker, unique_name) -> None:
    emb_topic, score_topic = unique_name("emb"), unique_name("scores")
    ensure_topics(broker.bootstrap, {emb_topic: 1, score_topic: 1})
    head = ScoreHead((0.5, -1.0, 0.25), 0.1, "m:1")
    good = _updates(10)
    with Producer(broker.bootstrap) as producer:
        for u in good[:5]:
            producer.send(emb_topic, u.id.encode(), encode_update(u))
        producer.send(emb_topic, b"x", b'{"hello":1}')
        producer.send(emb_topic, b"o", encode_update(_updates(1, model="m:2")[0]))
        for u in good[5:]:
            producer.send(emb_topic, u.id.encode(), encode_update(u, "binary"))
        producer.flush(30)
    group = unique_name("g")

    def run_scorer() -> dict:
        scorer = FraudScorer(broker.bootstrap, head, in_topic=emb_topic, out_topic=score_topic, group=group,
                             kafka_client=kafka_client)
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(scorer.run(max_idle_s=3.0)))
        thread.start()
        thread.join(90)
        assert not thread.is_alive(), "scorer did not stop when idle"
        return result

    quiet = {"canary_scored": 0, "not_serving": 0, "deleted": 0}
    assert run_scorer() == {"scored": 10, **quiet, "invalid": 1, "other_model": 1}
    # the poll holding the poison message was committed (past all 12 messages)
    from kafka import KafkaConsumer, TopicPartition
    reader = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=group, enable_auto_commit=False)
    try:
        assert reader.committed(TopicPartition(emb_topic, 0)) == 12
    finally:
        reader.close()
    # and a rerun does not stop either (it finds nothing left, or reads the topic again: the consumer's choice)
    assert run_scorer() in ({"scored": 0, **quiet, "invalid": 0, "other_model": 0},
                            {"scored": 10, **quiet, "invalid": 1, "other_model": 1})
    consumer = EventConsumer(broker.bootstrap, score_topic, unique_name("read"))
    got, idle = [], 0
    try:
        while idle < 3:
            records = consumer.poll_batch(500, 1.0)
            got.extend(records)
            idle = 0 if records else idle + (1 if consumer.assignment() else 0)
    finally:
        consumer.close()
    scores = [json.loads(r.value) for r in got]
    assert len(scores) in (10, 20) and all(s["model"] == "m:1" for s in scores)
    scored = {s["id"]: s for s in scores}
    assert sorted(scored) == sorted(u.id for u in good)
    for u in good:
        assert scored[u.id]["score"] == pytest.approx(float(head.score(np.asarray(u.embedding)[None, :])[0]),
                                                      abs=1e-6)


def test_train_validates_arguments_at_parse_time(tmp_path: Path) -> None:
    csv = _small_csv(tmp_path)
    for flag, value, expected in (("--epochs", "0", "argument --epochs: expected an integer >= 1 (got '0')"),
                                  ("--train-fraction", "1.5", "argument --train-fraction: expected a fraction "
                                                              "between 0 and 1, both excluded (got '1.5')"),
                                  ("--train-fraction", "0", "argument --train-fraction: expected a fraction"),
                                  ("--train-fraction", "x", "argument --train-fraction: expected a number")):
        proc = call_gnnstream("train", "--events", csv, "--out", tmp_path / "m", flag, value)
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "m").exists()
    with pytest.raises(ValueError, match="epochs must be at least 1"):
        train_fraud_model(csv, tmp_path / "m", epochs=0)
    with pytest.raises(ValueError, match="train_fraction must be between 0 and 1"):
        train_fraud_model(csv, tmp_path / "m", train_fraction=1.5)


def test_train_rejects_a_file_that_is_not_snap_csv(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text('{"type":"edge_upsert","src":"a","dst":"b","ts":1}\n{"type":"node_delete","id":"a","ts":2}\n')
    with pytest.raises(ValueError) as info:
        train_fraud_model(events, tmp_path / "m", epochs=1)
    assert str(info.value) == (f"no ratings read from {events}: expected a SNAP signed-network CSV "
                               f"(source,target,rating,time)")
    assert not (tmp_path / "m").exists()


def test_train_refuses_an_existing_model_dir_unless_forced(tmp_path: Path) -> None:
    csv = _small_csv(tmp_path)
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    labels = tmp_path / "labels.csv"
    labels.write_text("".join(f"{n},{y}\n" for n, y in distrust_labels(read_snap(csv)).items()))
    args = ("train", "--events", csv, "--labels", labels, "--out", out, "--epochs", "2", "--hidden", "4",
            "--out-dim", "3", "--fanouts", "3,2", "--name", "otc-sage")
    proc = call_gnnstream(*args)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"gnnstream: error: {out} already exists and is not empty; choose another "
                                   f"output directory, or pass --force (overwrite=True) to replace the model in it")
    assert (out / "config.json").read_text() == "{}" and sorted(p.name for p in out.iterdir()) == ["config.json"]
    proc = call_gnnstream(*args, "--force")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["epochs"] == 2
    assert load_head(out).model == "otc-sage:1" and len(load_head(out).weights) == 3
    # an empty directory is fine without --force
    (tmp_path / "empty").mkdir()
    proc = call_gnnstream("train", "--events", csv, "--labels", labels, "--out", tmp_path / "empty", "--epochs", "1",
                          "--hidden", "4",
                          "--out-dim", "3", "--fanouts", "3,2")
    assert proc.returncode == 0, proc.stderr
