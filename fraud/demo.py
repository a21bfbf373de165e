"""``make demo``: the whole pipeline on real data, on one machine, without Docker.

1. train a GraphSAGE model and a logistic fraud head on the first 70 % (by
   time) of the Bitcoin OTC ratings (reused from ``out/model`` on later runs);
2. start the embedded Kafka broker, the worker (in this process) and the fraud
   scorer (in a process of its own, as `gnnstream score` runs in production);
3. once the worker consumes, replay the whole Bitcoin OTC stream into ``graph-events`` at a
   steady rate (2,000 events/s);
   The last rating is held back: once the rest is applied, the worker's
   query API scores it as a what-if (``POST /v1/infer``): the rated user's
   fraud score now, and if the rating landed;
4. when everything is applied, published and scored: check every stored
   embedding against a from-scratch computation and compute the scorer's ROC
   AUC on held-out users (first rated in the last 30 %, never labelled in
   training), each scored with its latest score: the graph at the end of the
   stream; plots go to ``out/freshness.png`` and ``out/roc.png``;
5. then the same again (unless ``--window-days 0``) into a state with an edge
   window of ``--window-days`` (default 180) days, with a model trained for
   that graph: the staged cold-start policy (features only for a user's first
   day; its neighbours' samples too while it has fewer than three
   counterparties and is younger than a week), trained on the training
   window's graph as the edge window and the stages show it at the cut
   (``out/windowed/model``, reused like ``out/model``). Its held-out AUC is
   taken the same way, so it scores each user from the ratings of the last
   ``--window-days`` before the end of the stream only.

6. then (unless ``--no-payments``) the typed example
   (:mod:`gnnstream.fraud.payments_demo`, into ``out/payments``): a seeded
   payment stream of accounts, merchants and devices with planted fraud, a
   typed GraphSAGE and a transaction head trained on its first 70 % of
   payments (reused like ``out/model``), that history loaded into a state
   and the rest replayed through Kafka at ``--payments-rate``: the worker
   publishes every payment's score as it lands, and the held-out ROC AUC
   and precision at a 1 % alert rate are taken from those scores, beside
   freshness, exactness and the latency of ``POST /v1/score``.

The summary prints the runs side by side (held-out AUC, freshness p50 / p99,
exactness) and goes to ``out/demo-summary.json`` (the windowed run under
``windowed``, its plots in ``out/windowed/``; the typed example under
``payments``).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import queue
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from gnnstream.stream.broker import EmbeddedBroker, free_port
from gnnstream.stream.backends import DEFAULT_KAFKA_CLIENT, KAFKA_CLIENTS, read_to_end
from gnnstream.stream.events import EdgeUpsert, encode_event
from gnnstream.fraud.datasets import BITCOIN_OTC
from gnnstream.stream.snap import read_snap, snap_events
from gnnstream.workers.heap import tune_collector
from gnnstream.workers.offline.jobs import verify
from gnnstream.fraud.live import percentile, post_json, replay_process, trend_per_min
from gnnstream.workers.offline.train import TRAIN_FILE
from gnnstream.fraud.payments_demo import run_payments
from gnnstream.fraud.scorer import SCORES_TOPIC, FraudScorer
from gnnstream.workers.settings import WorkerSettings, finite_number
from gnnstream.workers.state import open_store
from gnnstream.fraud.train import distrust_labels, roc_auc, roc_curve, train_fraud_model
from gnnstream.workers.runtime.worker import Worker

__all__ = ["main", "run_demo"]

logger = logging.getLogger(__name__)

DATA = BITCOIN_OTC
DAY = 86_400
PLAIN = {"policy": "plain"}
# the windowed run's policy, chosen from OTC's rhythm (`python -m gnnstream.fraud.datasets`, docs/operations.md):
# a user's first day is its first trades' burst; the median user meets its third counterparty at about a week
STAGED = {"policy": "staged", "feature_only_s": DAY, "expand_s": 7 * DAY, "min_neighbours": 3}


def _trained(data: Path, model_dir: Path, *, epochs: int, retrain: bool, cold_start: dict[str, Any],
             edge_ttl: int) -> dict[str, Any]:
    """The training summary of the model in ``model_dir``, trained now unless a model trained earlier for the
    same cold-start policy and edge window is there (``retrain``: trained now anyway)."""
    if not retrain and (model_dir / TRAIN_FILE).exists():
        trained = json.loads((model_dir / TRAIN_FILE).read_text())
        config = json.loads((model_dir / "config.json").read_text())
        if trained.get("edge_ttl", 0) == edge_ttl and config.get("cold_start") == cold_start:
            print(f"reusing the model trained earlier in {model_dir}", file=sys.stderr)
            return trained
    shutil.rmtree(model_dir, ignore_errors=True)
    graph = f" with a {edge_ttl / DAY:g}-day edge window" if edge_ttl else ""
    print(f"training GraphSAGE ({cold_start['policy']} cold start) + fraud head on the first 70% of the "
          f"stream{graph} …", file=sys.stderr)
    return train_fraud_model(data, model_dir, epochs=epochs, cold_start=cold_start, edge_ttl=edge_ttl)


def _held_out(rows: list, train_fraction: float) -> dict[str, int]:
    """Labels of users first rated after the training window (labels from all their ratings)."""
    cut = int(len(rows) * train_fraction)
    seen_in_train = {r.dst for r in rows[:cut]}
    labels = distrust_labels(rows)
    return {node: y for node, y in labels.items() if node not in seen_in_train}


def _plots(out: Path, timeline: list[tuple[float, float]], fpr: np.ndarray | None, tpr: np.ndarray | None,
           auc: float | None) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    if timeline:
        t0 = timeline[0][0]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([t - t0 for t, _ in timeline], [lat for _, lat in timeline], ".", markersize=3)
        ax.set_xlabel("seconds since the first publish")
        ax.set_ylabel("publish − Kafka record time (s)")
        ax.set_title("gnnstream freshness while replaying Bitcoin OTC")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "freshness.png", dpi=110)
        plt.close(fig)
        written.append(str(out / "freshness.png"))
    if auc is None:
        return written
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot(fpr, tpr, label=f"fraud scorer (AUC {auc:.3f})")
    ax.plot([0, 1], [0, 1], "--", color="grey", label="chance")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title("Distrusted users, held-out (last 30 %)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "roc.png", dpi=110)
    plt.close(fig)
    written.append(str(out / "roc.png"))
    return written


def _held_back(data: Path, limit: int, out: Path) -> tuple[Path, int, list[Any]]:
    """The events to replay (written to ``out``, a JSONL file) and their count, and the held-back rating's
    events: the latest rating of a user with fewer than five neighbours by a rater who rated them once (so the
    what-if changes that user's samples), with the feature updates that follow it in the stream."""
    events = list(snap_events(read_snap(data)))
    events = events[:limit] if limit else events
    edges = [(i, ev) for i, ev in enumerate(events) if isinstance(ev, EdgeUpsert)]
    pairs: dict[frozenset[str], int] = {}
    nbrs: dict[str, set[str]] = {}
    for _, ev in edges:
        pairs[frozenset((ev.src, ev.dst))] = pairs.get(frozenset((ev.src, ev.dst)), 0) + 1
        nbrs.setdefault(ev.src, set()).add(ev.dst)
        nbrs.setdefault(ev.dst, set()).add(ev.src)
    at = next((i for i, ev in reversed(edges) if pairs[frozenset((ev.src, ev.dst))] == 1
               and 1 < len(nbrs[ev.dst]) < 5), edges[-1][0])
    end = next((i for i, _ in edges if i > at), len(events))
    payment, rest = events[at:end], events[:at] + events[end:]
    out.write_bytes(b"".join(encode_event(ev) + b"\n" for ev in rest))
    return out, len(rest), payment


def _what_if(port: int, applied: int, payment: list[Any]) -> dict[str, Any]:
    """The held-back rating scored by the query API once its view holds the ``applied`` events replayed."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=5) as resp:
                status = json.loads(resp.read())
            if sum(status["offsets"].values()) >= applied and status["dirty"] == 0:
                break
        except OSError:
            pass
        time.sleep(0.1)
    edge = payment[0]
    events = [json.loads(encode_event(ev)) for ev in payment]
    out: dict[str, Any] = {"rating": f"{edge.src} rates {edge.dst} {edge.weight:+g}", "events": len(events)}
    try:
        now = post_json(port, "/v1/infer", {"events": [], "ids": [edge.dst]})
        out["score_now"] = round(now["scores"][edge.dst], 4)
    except urllib.error.HTTPError as exc:  # a user rated for the first time has no score yet
        out["score_now"] = None if exc.code == 404 else f"HTTP {exc.code}"
    t = time.perf_counter()
    after = post_json(port, "/v1/infer", {"events": events, "ids": [edge.dst]})
    out["latency_ms"] = round((time.perf_counter() - t) * 1000, 1)
    out["score_if_it_lands"] = round(after["scores"][edge.dst], 4)
    return out


def _score(stop: Any, counts: Any, bootstrap: str, model_dir: str, kafka_client: str) -> None:
    """The scorer process: scores until ``stop`` is set, keeping ``counts`` (scored, deleted) current."""
    scorer = FraudScorer(bootstrap, model_dir, kafka_client=kafka_client)

    def report() -> None:
        while not stop.wait(0.25):
            counts[0], counts[1] = scorer.scored, scorer.deleted
        scorer.stop()

    reporter = threading.Thread(target=report, name="scorer-counts", daemon=True)
    reporter.start()
    scorer.run()
    counts[0], counts[1] = scorer.scored, scorer.deleted


def run_demo(data: Path, out: Path, *, rate: float, limit: int = 0, epochs: int = 300,
             retrain: bool = False, kafka_client: str = DEFAULT_KAFKA_CLIENT,
             output_format: str = WorkerSettings.output_format, edge_ttl: int = 0,
             cold_start: dict[str, Any] = PLAIN) -> dict[str, Any]:
    """One replay into a state with the edge window ``edge_ttl`` (seconds, 0: none), served by the model in
    ``out/model`` with the policy ``cold_start``, trained for that window and policy when missing."""
    if not data.exists():
        raise SystemExit(f"demo data not found at {data}; the repository ships it in data/ (restore it with git checkout -- data)")
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model"
    trained = _trained(data, model_dir, epochs=epochs, retrain=retrain, cold_start=cold_start, edge_ttl=edge_ttl)
    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir()
    replay_file, _, payment = _held_back(data, limit, run_dir / "replayed.jsonl")
    with EmbeddedBroker(log_path=run_dir / "broker.log") as broker:
        print(f"embedded broker at {broker.bootstrap}", file=sys.stderr)
        settings = WorkerSettings(bootstrap=broker.bootstrap, state=str(run_dir / "state"), model=str(model_dir),
                                  metrics_port=0, batch_size=1000, batch_wait_ms=100, kafka_client=kafka_client,
                                  query_port=free_port(), output_format=output_format, edge_ttl=edge_ttl)
        worker = Worker(settings)
        summary: dict[str, Any] = {}
        produced: dict[str, Any] = {}
        # the replay and the scorer run in processes of their own, as they would in production: in this one
        # they would share the interpreter's lock with the worker, and their work would show up as its latency
        ctx = multiprocessing.get_context("spawn")
        # the scorer runs until it has read what the worker published (an idle limit alone could end it
        # before the worker's first publish when the worker starts slowly)
        stop_scorer, scored = ctx.Event(), ctx.Array("q", 2)
        scorer = ctx.Process(target=_score, name="scorer", daemon=True,
                             args=(stop_scorer, scored, broker.bootstrap, str(model_dir), kafka_client))
        threads = [threading.Thread(target=lambda: summary.update(worker.run(max_idle_s=5.0)), name="worker")]
        ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
        replay = ctx.Process(target=replay_process, name="replay", daemon=True,
                             args=(ready, go, results, broker.bootstrap, str(replay_file)),
                             kwargs=dict(rate=rate, partitions=settings.partitions,
                                         topic=settings.events_topic, kafka_client=kafka_client))
        t0 = time.perf_counter()
        replay.start()
        scorer.start()
        # the worker stops after 5 s without events once it consumes: start it when the replay process has
        # imported what it runs (seconds on a busy machine), so that the events follow its join within moments
        while not ready.wait(1.0):
            if not replay.is_alive():
                raise SystemExit(f"the replay process stopped (exit code {replay.exitcode}) before it started")
        for t in threads:
            t.start()
        # replay once the worker consumes (its group join takes a few seconds): the freshness measured is
        # then the pipeline's, not the join's
        joined_by = time.monotonic() + 120.0
        while worker.health.status != "consuming" and threads[0].is_alive() and time.monotonic() < joined_by:
            time.sleep(0.1)
        t_replay = time.perf_counter()
        go.set()
        while True:
            try:
                outcome = results.get(timeout=1.0)
                break
            except queue.Empty:
                if not replay.is_alive():
                    raise SystemExit(f"the replay process stopped (exit code {replay.exitcode}) before it finished")
        replay.join()
        if isinstance(outcome, str):
            raise SystemExit(f"replay failed: {outcome}")
        produced.update(outcome)
        read, since = -1, time.monotonic()
        t_applied, shown = None, 0.0
        what_if: dict[str, Any] | None = None
        while threads[0].is_alive() or scorer.is_alive():
            threads[0].join(0.25)
            h = worker.health
            if t_applied is None and h.applied >= produced["produced"]:
                t_applied = time.perf_counter()
                # the worker stays up while idle for a few seconds: ask its query API now
                try:
                    what_if = _what_if(settings.query_port, produced["produced"], payment)
                except (OSError, ValueError, KeyError) as exc:  # the rest of the demo does not depend on it
                    what_if = {"error": f"{type(exc).__name__}: {exc}"}
            if time.monotonic() < shown + 2.0:
                continue
            shown = time.monotonic()
            print(f"\rworker: {h.applied:,}/{produced['produced']:,} events applied, {h.published:,} embeddings "
                  f"published, scorer: {scored[0]:,} scored", end="", file=sys.stderr)
            if threads[0].is_alive():
                continue
            time.sleep(0.5)
            if scored[0] + scored[1] != read:
                read, since = scored[0] + scored[1], time.monotonic()
            if read >= h.published or time.monotonic() - since > 30.0:
                stop_scorer.set()
                scorer.join(30.0)
                if scorer.is_alive():
                    scorer.terminate()
                    raise SystemExit("the scorer process did not stop within 30 s of being asked to")
        print(file=sys.stderr)
        if scorer.exitcode != 0:  # it may also have died while the worker ran
            raise SystemExit(f"the scorer process stopped with exit code {scorer.exitcode}")
        seconds = time.perf_counter() - t0
        dead = read_to_end(kafka_client, broker.bootstrap, settings.dlq_topic)
        scores = read_to_end(kafka_client, broker.bootstrap, SCORES_TOPIC, timeout_s=300.0)
    latest: dict[str, dict[str, Any]] = {}
    for r in scores:
        if r.value is None:
            latest.pop(r.key.decode(), None)
            continue
        s = json.loads(r.value)
        if s["id"] not in latest or s["embedding_version"] >= latest[s["id"]]["embedding_version"]:
            latest[s["id"]] = s
    rows = read_snap(data)
    held = {n: y for n, y in _held_out(rows, 0.7).items() if n in latest}
    y = np.array(list(held.values()))
    p = np.array([latest[n]["score"] for n in held])
    try:
        auc: float | None = roc_auc(y, p)
    except ValueError:  # a short replay (--limit) may hold no held-out user of one class
        auc = None
    check = verify(settings.state)
    with open_store(settings.state, create=False, read_only=True) as store:  # the graph at the end of the stream
        with_neighbours = sum(store.degree(n) > 0 for n in held)
    timeline = list(worker.latency_timeline)
    latencies = [lat for _, lat in timeline]
    plots = _plots(out, timeline, *(roc_curve(y, p) if auc is not None else (None, None)), auc)
    return {
        "kafka_client": kafka_client,
        "output_format": output_format,
        "events_produced": produced["produced"],
        "events_applied": summary.get("applied"),
        "replay_rate_events_per_s": rate or None,
        "replay_achieved_events_per_s": produced.get("events_per_s"),
        # from the first event produced to the last one applied
        "events_per_s": round((summary.get("applied") or 0) / max((t_applied or t0 + seconds) - t_replay, 1e-9), 1),
        "embeddings_published": summary.get("published"),
        "scores_published": scored[0],
        "dead_letters": len(dead),
        "freshness_p50_s": percentile(latencies, 50),
        "freshness_p99_s": percentile(latencies, 99),
        # least-squares slope of freshness over the run: near 0 when the pipeline keeps pace
        "freshness_trend_s_per_min": trend_per_min(timeline),
        "nodes": check["nodes"],
        "embeddings_exact": check["ok"],
        "max_abs_error_vs_from_scratch": check["max_abs_error"],
        "train_auc": trained.get("train_auc"),
        "held_out_users": len(held),
        "held_out_with_neighbours": with_neighbours,
        "held_out_distrusted": int(y.sum()),
        "held_out_roc_auc": None if auc is None else round(auc, 4),
        "what_if_held_back_rating": what_if,
        "plots": plots,
        "edge_ttl_days": edge_ttl / DAY if edge_ttl else None,
        "cold_start": json.loads((model_dir / "config.json").read_text()).get("cold_start"),
    }


_WINDOWED_KEYS = ("edge_ttl_days", "cold_start", "events_applied", "events_per_s", "embeddings_published",
                  "freshness_p50_s", "freshness_p99_s", "freshness_trend_s_per_min", "nodes", "embeddings_exact",
                  "max_abs_error_vs_from_scratch", "train_auc", "held_out_users", "held_out_with_neighbours",
                  "held_out_roc_auc", "plots")


def _side_by_side(result: dict[str, Any]) -> str:
    """The runs' held-out AUC, freshness and exactness, one line each."""
    runs = [("no window, plain", result)]
    if "windowed" in result:
        runs.append((f"{result['windowed']['edge_ttl_days']:g}-day window, staged", result["windowed"]))
    lines = [f"\n  {'run':<26}{'held-out AUC':>13}{'users with neighbours':>23}{'freshness p50 / p99':>22}"
             f"  exact (max abs error)"]
    for name, r in runs:
        users = f"{r['held_out_with_neighbours']} of {r['held_out_users']}"
        freshness = f"{r['freshness_p50_s']} / {r['freshness_p99_s']} s"
        err = r["max_abs_error_vs_from_scratch"]
        exact = f"{'yes' if r['embeddings_exact'] else 'NO'} ({'not finite' if err is None else f'{err:.1e}'})"
        lines.append(f"  {name:<26}{r['held_out_roc_auc']!s:>13}{users:>23}{freshness:>22}  {exact}")
    lines.append("  held-out AUC: users first rated after the 70 % training cut, each by its latest score: the graph "
                 "at the end of the stream, as the run's window shows it")
    pay = result.get("payments")
    if pay:
        latency = pay["score_what_if_latency"] or {}
        lines.append(f"\n  typed payments (accounts, merchants, devices), the last 30 % streamed: held-out "
                     f"transaction AUC {pay['held_out_auc']}, precision at a {pay['alert_rate']:.0%} alert rate "
                     f"{pay['held_out_precision']} ({pay['held_out_fraud']} planted of {pay['held_out_scored']} "
                     f"scored as they landed); freshness p50 / p99 {pay['freshness_p50_s']} / "
                     f"{pay['freshness_p99_s']} s; exact {'yes' if pay['embeddings_exact'] else 'NO'}; "
                     f"POST /v1/score p50 / p99 {latency.get('p50_ms')} / {latency.get('p99_ms')} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gnnstream.fraud.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA, help=f"SNAP CSV to replay (default {DATA})")
    parser.add_argument("--out", type=Path, default=Path("out"), help="output directory (default out/)")
    parser.add_argument("--rate", type=float, default=2000.0,
                        help="replay rate in events/s (default 2000; 0 = flat out)")
    parser.add_argument("--limit", type=int, default=0, help="replay only the first N events")
    parser.add_argument("--epochs", type=int, default=300, help="training epochs (default 300)")
    parser.add_argument("--retrain", action="store_true", help="train again even if out/model (and out/windowed/model) exist")
    # the worker and the scorer share the demo's process (the replay has one of its own): librdkafka does its
    # I/O on threads of its own, outside the interpreter's lock
    parser.add_argument("--kafka-client", choices=KAFKA_CLIENTS,
                        default=os.environ.get("GNNSTREAM_KAFKA_CLIENT", DEFAULT_KAFKA_CLIENT),
                        help="Kafka client of the worker, the scorer and the replay (env GNNSTREAM_KAFKA_CLIENT; "
                             f"default {DEFAULT_KAFKA_CLIENT})")
    parser.add_argument("--output-format", choices=("json", "binary"), default=WorkerSettings.output_format,
                        help="encoding of the embeddings the worker publishes and the scorer reads "
                             f"(default {WorkerSettings.output_format})")
    parser.add_argument("--payments", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the typed example: a generated payment stream, a typed model and transaction "
                             "head trained on its first 70 %%, the rest replayed through Kafka and every payment "
                             "scored as it lands (default on; --no-payments: skip)")
    parser.add_argument("--payments-rate", type=finite_number(0), default=1000.0, metavar="EVENTS_PER_S",
                        help="replay rate of the typed example's live part (default 1000; 0 = flat out)")
    parser.add_argument("--window-days", type=finite_number(0), default=180.0, metavar="DAYS",
                        help="replay a second time into a state with an edge window of this many days, served by a "
                             "model with the staged cold-start policy trained for that window, and print its "
                             "held-out ROC AUC, freshness and exactness beside the unwindowed run's (default 180; "
                             "0: no second replay; the second replay and its training about double the run)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    tune_collector()
    logging.getLogger("kafka").setLevel(logging.ERROR)  # the client's event-loop timing notes are noise here
    options = dict(rate=args.rate, limit=args.limit, epochs=args.epochs, retrain=args.retrain,
                   kafka_client=args.kafka_client, output_format=args.output_format)
    result = run_demo(args.data, args.out, **options)
    complete = result["events_applied"] == result["events_produced"] - result["dead_letters"]
    ok = result["embeddings_exact"] and complete and bool(result["nodes"])
    edge_ttl = round(args.window_days * DAY)
    if edge_ttl:
        windowed = run_demo(args.data, args.out / "windowed", edge_ttl=edge_ttl, cold_start=STAGED, **options)
        result["windowed"] = {k: windowed[k] for k in _WINDOWED_KEYS}
        ok = ok and windowed["embeddings_exact"] and \
            windowed["events_applied"] == windowed["events_produced"] - windowed["dead_letters"]
    if args.payments:
        result["payments"] = payments = run_payments(args.out / "payments", rate=args.payments_rate,
                                                     kafka_client=args.kafka_client, retrain=args.retrain)
        ok = ok and payments["embeddings_exact"] and payments["events_applied"] == payments["streamed_events"]
    print("\ngnnstream demo — Bitcoin OTC trust network replayed through Kafka")
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"  {key.ljust(width)}  {value}")
    print(_side_by_side(result))
    (args.out / "demo-summary.json").write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
