"""``make demo``'s typed example: a generated payment stream (accounts, merchants, devices, planted fraud)
served through Kafka by a typed model that scores every payment as it lands.

1. generate the stream (``python -m gnnstream.fraud.payments``, seed 0) and train a typed GraphSAGE and a
   transaction head on its first 70 % of payments (``gnnstream train --schema``; reused on later runs);
2. load the training window's events into a state (``gnnstream graph load``): the history;
3. start the embedded broker and the worker (its query API on), and replay the rest of the stream into
   ``graph-events`` at a steady rate; the worker publishes every payment's score to ``transaction-scores``;
4. once everything is applied, score the last held-out payments again through ``POST /v1/score`` (a
   what-if of each: the latency of scoring a transaction before it lands), then check every stored embedding
   against a from-scratch computation and take the held-out ROC AUC and the precision at a 1 % alert rate of
   the scores the worker published.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from gnnstream.fraud.live import percentile, post_json, replay_process, trend_per_min
from gnnstream.fraud.payments import generate, write_stream
from gnnstream.stream.backends import read_to_end
from gnnstream.stream.broker import EmbeddedBroker, free_port
from gnnstream.workers.offline.jobs import load_events, verify
from gnnstream.workers.offline.train import TRAIN_FILE, roc_auc
from gnnstream.workers.offline.typed_train import precision_at_rate, read_transaction_labels, train_typed_model
from gnnstream.workers.runtime.worker import Worker
from gnnstream.workers.settings import WorkerSettings

__all__ = ["run_payments"]

ALERT_RATE = 0.01
SCORED_AGAIN = 200  # held-out payments scored again through POST /v1/score, for its latency


def _trained(out: Path, retrain: bool) -> tuple[dict[str, str], dict[str, Any]]:
    """The stream's files and the training summary (generated and trained now unless done before)."""
    model_dir = out / "model"
    names = ("events.jsonl", "labels.csv", "schema.json")
    paths = {name: str(out / name) for name in names}
    if not retrain and (model_dir / TRAIN_FILE).exists() and all((out / n).exists() for n in names):
        print(f"reusing the typed model trained earlier in {model_dir}", file=sys.stderr)
        return paths, json.loads((model_dir / TRAIN_FILE).read_text())
    print("generating the payment stream and training a typed GraphSAGE + transaction head on its first 70% …",
          file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    paths = write_stream(generate(0), out)
    return paths, train_typed_model(paths["events.jsonl"], paths["labels.csv"],
                                    json.loads(Path(paths["schema.json"]).read_text()), model_dir)


def _score_latency(port: int, payments: list[dict[str, Any]]) -> dict[str, Any]:
    """``POST /v1/score`` of each of ``payments`` (one request at a time): latency p50 / p99 and the count."""
    took = []
    for ev in payments:
        t = time.perf_counter()
        post_json(port, "/v1/score", {"event": ev})
        took.append((time.perf_counter() - t) * 1000)
    return {"requests": len(took), "p50_ms": percentile(took, 50), "p99_ms": percentile(took, 99)}


def run_payments(out: Path, *, rate: float, kafka_client: str, retrain: bool = False) -> dict[str, Any]:
    """The typed example (the module's text); its summary."""
    paths, trained = _trained(out, retrain)
    model_dir = out / "model"
    lines = Path(paths["events.jsonl"]).read_bytes().splitlines(keepends=True)
    cut = trained["train_events"]
    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir()
    (run_dir / "history.jsonl").write_bytes(b"".join(lines[:cut]))
    (run_dir / "live.jsonl").write_bytes(b"".join(lines[cut:]))
    live = [json.loads(line) for line in lines[cut:]]
    state = str(run_dir / "state")
    loaded = load_events(state, str(run_dir / "history.jsonl"), model_dir=str(model_dir))
    with EmbeddedBroker(log_path=run_dir / "broker.log") as broker:
        settings = WorkerSettings(bootstrap=broker.bootstrap, state=state, model=str(model_dir), metrics_port=0,
                                  batch_size=1000, batch_wait_ms=100, kafka_client=kafka_client,
                                  query_port=free_port())
        worker = Worker(settings)
        summary: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: summary.update(worker.run(max_idle_s=5.0)), name="worker")
        ctx = multiprocessing.get_context("spawn")
        ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
        replay = ctx.Process(target=replay_process, name="replay", daemon=True,
                             args=(ready, go, results, broker.bootstrap, str(run_dir / "live.jsonl")),
                             kwargs=dict(rate=rate, partitions=settings.partitions, topic=settings.events_topic,
                                         kafka_client=kafka_client))
        replay.start()
        ready.wait(120.0)
        thread.start()
        joined_by = time.monotonic() + 120.0
        while worker.health.status != "consuming" and thread.is_alive() and time.monotonic() < joined_by:
            time.sleep(0.1)
        t_replay = time.perf_counter()
        go.set()
        while True:
            try:
                produced = results.get(timeout=1.0)
                break
            except queue.Empty:
                if not replay.is_alive():
                    raise SystemExit(f"the replay process stopped (exit code {replay.exitcode}) before it finished")
        replay.join()
        if isinstance(produced, str):
            raise SystemExit(f"replay failed: {produced}")
        latency: dict[str, Any] | None = None
        t_applied, shown = None, 0.0
        while thread.is_alive():
            thread.join(0.25)
            if t_applied is None and worker.health.applied >= produced["produced"]:
                t_applied = time.perf_counter()
                held_out = [ev for ev in live if ev.get("txn_id")][-SCORED_AGAIN:]
                try:  # the worker stays up while idle for a few seconds: ask its query API now
                    latency = _score_latency(settings.query_port, held_out)
                except (OSError, ValueError, KeyError) as exc:  # the rest of the example does not depend on it
                    latency = {"error": f"{type(exc).__name__}: {exc}"}
            if time.monotonic() > shown + 2.0:
                shown = time.monotonic()
                print(f"\rtyped worker: {worker.health.applied:,}/{produced['produced']:,} events applied",
                      end="", file=sys.stderr)
        print(file=sys.stderr)
        published = read_to_end(kafka_client, broker.bootstrap, settings.transaction_topic, timeout_s=120.0)
    scores = {}
    for r in published:  # at least once: the newest record of a key is its score
        scores[r.key.decode()] = json.loads(r.value)["score"]
    labels = read_transaction_labels(paths["labels.csv"])
    held = [ev["txn_id"] for ev in live if ev.get("txn_id") in labels]
    y = np.array([labels[t] for t in held])
    p = np.array([scores.get(t, np.nan) for t in held])
    scored = ~np.isnan(p)
    check = verify(state)
    timeline = [lat for _, lat in worker.latency_timeline]
    both = 0 < y[scored].sum() < scored.sum()
    return {
        "events": len(lines), "history_events": loaded.get("events"), "streamed_events": produced["produced"],
        "events_applied": summary.get("applied"),
        "events_per_s": round((summary.get("applied") or 0) / max((t_applied or time.perf_counter()) - t_replay,
                                                                   1e-9), 1),
        "freshness_p50_s": percentile(timeline, 50), "freshness_p99_s": percentile(timeline, 99),
        "freshness_trend_s_per_min": trend_per_min(list(worker.latency_timeline)),
        "held_out_transactions": len(held), "held_out_scored": int(scored.sum()),
        "held_out_fraud": int(y.sum()),
        "held_out_auc": round(roc_auc(y[scored], p[scored]), 4) if both else None,
        "alert_rate": ALERT_RATE,
        "held_out_precision": round(precision_at_rate(y[scored], p[scored], ALERT_RATE), 4) if scored.any() else None,
        "score_what_if_latency": latency,
        "nodes": check["nodes"], "embeddings_exact": check["ok"],
        "max_abs_error_vs_from_scratch": check["max_abs_error"],
        "offline_held_out_auc": trained.get("held_out_auc"),
    }
