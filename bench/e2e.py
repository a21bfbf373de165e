"""End-to-end streaming benchmark on the Bitcoin OTC event stream.

Starts an embedded broker (Tansu), produces the whole SNAP Bitcoin OTC stream
(``workers.datasets.snap_events``, ~53k events) and measures:

(i)   raw consume rate: ``EventConsumer.poll_batch`` reading the whole topic,
      no processing (time from the first non-empty poll to the last record);
(ii)  sustained worker rate: ``Worker(...).run()`` in a thread from an empty
      state on the same topic; events / (first ``_process`` call -> first
      publish that completes after the last event was applied and nothing is
      pending). The ratio (ii)/(i) is the processing overhead over raw Kafka.
(iii) freshness at half the sustained rate, on a fresh one-partition topic
      and a fresh state: every event's ``ts`` is set to its wall-clock send
      time, so
        * ``consumer_e2e``: for each event, the arrival at a downstream
          consumer of the first embedding update whose ``event_ts`` >= the
          event's send time (one partition keeps the events in order, and the
          worker stamps every update of a batch with at least the batch's
          newest event time, so that update is the first one published by the
          batch that applied the event, or a later one: an upper bound);
        * ``pipeline_latency``: the worker's own histogram
          ``gnnstream_pipeline_latency_seconds`` (publish time minus the Kafka
          timestamp of the oldest record of the batch), quantiles
          interpolated within Prometheus buckets;
        * ``embedding_freshness``: ``gnnstream_embedding_freshness_seconds``
          (publish time minus the newest event time of the batch).

Prints ONE JSON object on stdout; progress goes to stderr.

    .venv/bin/python bench/e2e.py                    # full stream (~53k events)
    .venv/bin/python bench/e2e.py --events 5000 --fresh-events 3000   # quick
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from common import code_fingerprint, emit, log, machine_load, peak_rss_mib, percentile  # noqa: E402  (puts the repo root on sys.path)

from model import init_model_dir  # noqa: E402
from stream.broker import EmbeddedBroker  # noqa: E402
from stream.events import NodeUpsert, encode_event, event_key  # noqa: E402
from stream.kafka import EventConsumer, Producer, ensure_topics  # noqa: E402
from stream.updates import decode_update  # noqa: E402
from workers.datasets import BITCOIN_OTC, FEATURE_DIM, read_snap, snap_events  # noqa: E402
from workers.heap import tune_collector  # noqa: E402
from workers.settings import WorkerSettings  # noqa: E402
from workers.worker import Worker  # noqa: E402

DEFAULT_CSV = BITCOIN_OTC


def _fanouts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", default=str(DEFAULT_CSV), help="SNAP signed-network CSV (default Bitcoin OTC)")
    p.add_argument("--events", type=int, default=0, help="only the first N events (default: all)")
    p.add_argument("--fresh-events", type=int, default=15_000, help="events produced for the freshness phase")
    p.add_argument("--rate-fraction", type=float, default=0.5, help="freshness produce rate / sustained rate")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the throughput topic")
    p.add_argument("--batch-size", type=int, default=1000, help="worker --batch-size")
    p.add_argument("--batch-wait-ms", type=int, default=200, help="worker --batch-wait-ms")
    p.add_argument("--max-batch-size", type=int, default=10_000, help="worker --max-batch-size")
    p.add_argument("--arch", default="sage", choices=["sage", "gcn", "gat"])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--out-dim", type=int, default=64)
    p.add_argument("--fanouts", type=_fanouts, default=[25, 10])
    p.add_argument("--idle-s", type=float, default=3.0, help="worker max_idle_s after the stream")
    p.add_argument("--kafka-client", default="kafka-python", help="worker --kafka-client")
    p.add_argument("--output-format", default="json", choices=["json", "binary"], help="worker --output-format")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- helpers
def produce(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    with Producer(bootstrap) as producer:
        for i, (key, value) in enumerate(messages):
            producer.send(topic, key, value)
            if i % 20_000 == 19_999:
                producer.flush(60)
        producer.flush(60)
    seconds = time.perf_counter() - t0
    return {"events": len(messages), "seconds": round(seconds, 3), "events_per_s": round(len(messages) / seconds, 1)}


def raw_consume(bootstrap: str, topic: str, total: int, batch: int) -> dict[str, Any]:
    consumer = EventConsumer(bootstrap, topic, f"bench-raw-{uuid.uuid4().hex[:8]}")
    count, first, last = 0, None, None
    deadline = time.monotonic() + 300
    try:
        while count < total and time.monotonic() < deadline:
            records = consumer.poll_batch(batch, 0.2)
            if records:
                now = time.perf_counter()
                if first is None:
                    first = now
                    count_first = len(records)
                count += len(records)
                last = now
    finally:
        consumer.close()
    if count < total or first is None or last is None:
        raise SystemExit(f"raw consume read only {count} of {total} records")
    # the first poll's records were read before `first`: rate over the rest
    seconds = max(last - first, 1e-9)
    return {"events": count, "seconds": round(seconds, 3), "events_per_s": round((count - count_first) / seconds, 1)}


class Timed:
    """Wraps a worker's ``_process``/``_publish`` to timestamp the stream's first and last steps."""

    def __init__(self, worker: Worker, total: int):
        self.worker, self.total = worker, total
        self.first_process: float | None = None
        self.done_at: float | None = None
        self.batches = 0
        process, publish = worker._process, worker._publish

        def timed_process(*args: Any) -> None:
            if self.first_process is None:
                self.first_process = time.perf_counter()
            self.batches += 1
            process(*args)

        def timed_publish(publisher: Any) -> None:
            publish(publisher)
            engine = worker.engine
            if (self.done_at is None and worker.health.applied >= self.total and engine is not None
                    and not engine.pending() and publisher.pending() == 0):
                self.done_at = time.perf_counter()

        worker._process = timed_process  # type: ignore[method-assign]
        worker._publish = timed_publish  # type: ignore[method-assign]


def start_worker(settings: WorkerSettings, idle_s: float) -> tuple[Worker, threading.Thread, dict[str, Any]]:
    worker = Worker(settings)
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["summary"] = worker.run(max_idle_s=idle_s)
        except BaseException as exc:  # reported by the caller
            result["error"] = exc

    thread = threading.Thread(target=target, name="worker", daemon=True)
    return worker, thread, result


def histogram_state(worker: Worker, name: str) -> dict[str, Any]:
    """Cumulative bucket counts, count and sum of a histogram of ``worker.metrics``."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    for metric in worker.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name + "_bucket":
                buckets[float(s.labels["le"])] = s.value
            elif s.name == name + "_count":
                count = s.value
            elif s.name == name + "_sum":
                total = s.value
    return {"buckets": buckets, "count": count, "sum": total}


def histogram_quantiles(worker: Worker, name: str, baseline: dict[str, Any] | None = None,
                        qs: tuple[float, ...] = (0.5, 0.99)) -> dict[str, Any]:
    """Quantiles of a histogram (minus a ``baseline`` snapshot), interpolated linearly within buckets."""
    now = histogram_state(worker, name)
    base = baseline or {"buckets": {}, "count": 0.0, "sum": 0.0}
    buckets = sorted((le, cum - base["buckets"].get(le, 0.0)) for le, cum in now["buckets"].items())
    count = now["count"] - base["count"]
    out: dict[str, Any] = {"count": int(count),
                           "mean_s": round((now["sum"] - base["sum"]) / count, 4) if count else None}
    for q in qs:
        value = None
        if count:
            rank = q * count
            lo_bound, lo_count = 0.0, 0.0
            for bound, cum in buckets:
                if cum >= rank:
                    if bound == float("inf"):
                        value = lo_bound
                    else:
                        frac = (rank - lo_count) / (cum - lo_count) if cum > lo_count else 1.0
                        value = lo_bound + frac * (bound - lo_bound)
                    break
                lo_bound, lo_count = bound, cum
        out[f"p{int(q * 100)}_s"] = None if value is None else round(value, 4)
    return out


# ---------------------------------------------------------------------- phases
def sustained(bootstrap: str, topic: str, total: int, model: str, state: str, args: argparse.Namespace) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    settings = WorkerSettings(bootstrap=bootstrap, state=state, model=model, events_topic=topic,
                              output_topic=f"bench-emb-{tag}", dlq_topic=f"bench-dlq-{tag}",
                              group=f"bench-worker-{tag}", partitions=args.partitions, batch_size=args.batch_size,
                              batch_wait_ms=args.batch_wait_ms, metrics_port=0,
                              kafka_client=args.kafka_client, output_format=args.output_format,
                              max_batch_size=args.max_batch_size)
    worker, thread, result = start_worker(settings, args.idle_s)
    timed = Timed(worker, total)
    thread.start()
    last_log = time.monotonic()
    while thread.is_alive():
        thread.join(0.5)
        if time.monotonic() - last_log > 5:
            last_log = time.monotonic()
            log(f"worker: {worker.health.applied}/{total} applied, {worker.health.published} published")
    if "error" in result:
        raise result["error"]
    if timed.done_at is None or timed.first_process is None:
        raise SystemExit(f"worker stopped before finishing: {result.get('summary')}")
    seconds = timed.done_at - timed.first_process
    summary = result["summary"]
    return {"events": summary["applied"], "published": summary["published"], "batches": timed.batches,
            "seconds": round(seconds, 3), "events_per_s": round(summary["applied"] / seconds, 1),
            # from a backlog produced before the worker started: dominated by queueing, not a freshness figure
        "pipeline_latency_backlog": histogram_quantiles(worker, "gnnstream_pipeline_latency_seconds")}


def freshness(bootstrap: str, events: list, rate: float, model: str, state: str,
              args: argparse.Namespace) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    topic, output = f"bench-fresh-ev-{tag}", f"bench-fresh-emb-{tag}"
    ensure_topics(bootstrap, {topic: 1, output: args.partitions, f"bench-fresh-dlq-{tag}": 1})
    settings = WorkerSettings(bootstrap=bootstrap, state=state, model=model, events_topic=topic,
                              output_topic=output, dlq_topic=f"bench-fresh-dlq-{tag}",
                              group=f"bench-fresh-{tag}", partitions=1, batch_size=args.batch_size,
                              batch_wait_ms=args.batch_wait_ms, metrics_port=0,
                              kafka_client=args.kafka_client, output_format=args.output_format,
                              max_batch_size=args.max_batch_size)
    worker, thread, result = start_worker(settings, 600)
    thread.start()

    arrivals: list[tuple[float, float]] = []  # (event_ts, arrival time)
    stop_reader = threading.Event()
    reader_ready = threading.Event()

    def reader() -> None:
        consumer = EventConsumer(bootstrap, output, f"bench-fresh-reader-{tag}")
        try:
            while not stop_reader.is_set():
                records = consumer.poll_batch(5000, 0.05)
                now = time.time()
                for r in records:
                    if r.value is not None:
                        arrivals.append((decode_update(r.value).event_ts, now))
                if consumer.assignment():
                    reader_ready.set()
        finally:
            consumer.close()

    reader_thread = threading.Thread(target=reader, name="reader", daemon=True)
    reader_thread.start()

    # warm-up: one event through the whole path, so that group joins are done before timing. A
    # node_upsert: a fresh state whose first batch holds only edges crashes the worker (known bug,
    # see tests/workers/test_worker_kafka.py::test_first_batch_without_features)
    warm = dataclasses.replace(next(ev for ev in events if isinstance(ev, NodeUpsert)), ts=time.time())
    with Producer(bootstrap) as producer:
        producer.send(topic, event_key(warm), encode_event(warm))
        producer.flush(30)
    deadline = time.monotonic() + 120
    while (worker.health.applied < 1 or not arrivals or not reader_ready.is_set()) and time.monotonic() < deadline:
        if "error" in result:
            raise result["error"]
        time.sleep(0.05)
    if not arrivals:
        raise SystemExit("freshness warm-up: no embedding update came back within 120 s")
    time.sleep(0.5)
    arrivals.clear()
    # the warm-up batch waited for the group join: leave it out of the histograms
    base_pipeline = histogram_state(worker, "gnnstream_pipeline_latency_seconds")
    base_fresh = histogram_state(worker, "gnnstream_embedding_freshness_seconds")

    sent: list[float] = []
    log(f"freshness: producing {len(events)} events at {rate:.0f} ev/s on one partition")
    t0 = time.perf_counter()
    with Producer(bootstrap) as producer:
        for i, ev in enumerate(events, 1):
            ahead = i / rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
            now = time.time()
            stamped = dataclasses.replace(ev, ts=now)
            producer.send(topic, event_key(stamped), encode_event(stamped))
            sent.append(now)
            if i % 200 == 0:
                producer.flush(30)
        producer.flush(30)
    produce_s = time.perf_counter() - t0
    deadline = time.monotonic() + 120
    total = len(events) + 1  # warm-up included
    while time.monotonic() < deadline:
        engine = worker.engine
        if worker.health.applied >= total and engine is not None and not engine.pending() \
                and (not arrivals or max(a for _, a in arrivals) < time.time() - 2.0):
            break
        time.sleep(0.2)
    worker.stop()
    thread.join(60)
    stop_reader.set()
    reader_thread.join(30)
    if "error" in result:
        raise result["error"]

    # e2e per event: first arrival of an update with event_ts >= the event's send time
    arrivals.sort()
    ts_sorted = [e for e, _ in arrivals]
    suffix_min = [0.0] * len(arrivals)
    best = float("inf")
    for j in range(len(arrivals) - 1, -1, -1):
        best = min(best, arrivals[j][1])
        suffix_min[j] = best
    latencies = []
    unmatched = 0
    for s in sent:
        j = bisect.bisect_left(ts_sorted, s)
        if j == len(ts_sorted):
            unmatched += 1
        else:
            latencies.append(suffix_min[j] - s)
    return {
        "events": len(sent),
        "partitions": 1,
        "target_rate": round(rate, 1),
        "achieved_rate": round(len(sent) / produce_s, 1),
        "updates_received": len(arrivals),
        "consumer_e2e": {"p50_s": round(percentile(latencies, 50), 4), "p99_s": round(percentile(latencies, 99), 4),
                         "max_s": round(max(latencies), 4) if latencies else None, "unmatched": unmatched},
        "pipeline_latency": histogram_quantiles(worker, "gnnstream_pipeline_latency_seconds", base_pipeline),
        "embedding_freshness": histogram_quantiles(worker, "gnnstream_embedding_freshness_seconds", base_fresh),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ.setdefault("GNNSTREAM_NO_PROGRESS", "1")
    tune_collector()  # as the gnnstream command does
    csv = Path(args.csv)
    if not csv.is_file():
        raise SystemExit(f"data file missing: {csv}")
    events = list(snap_events(read_snap(csv)))
    if args.events:
        events = events[: args.events]
    log(f"{len(events)} events from {csv.name}")
    with tempfile.TemporaryDirectory(prefix="gnnstream-e2e-") as tmp, EmbeddedBroker() as broker:
        model = str(Path(tmp) / "model")
        init_model_dir(model, arch=args.arch, in_dim=FEATURE_DIM, hidden=args.hidden, out_dim=args.out_dim,
                       layers=len(args.fanouts), fanouts=args.fanouts, seed=0)
        topic = f"bench-ev-{uuid.uuid4().hex[:8]}"
        ensure_topics(broker.bootstrap, {topic: args.partitions})
        messages = [(event_key(ev), encode_event(ev)) for ev in events]
        produced = produce(broker.bootstrap, topic, messages)
        log(f"produced: {produced}")
        raw = raw_consume(broker.bootstrap, topic, len(messages), args.batch_size)
        log(f"raw consume: {raw}")
        worker = sustained(broker.bootstrap, topic, len(messages), model, str(Path(tmp) / "state-throughput"), args)
        log(f"worker: {worker}")
        rate = args.rate_fraction * worker["events_per_s"]
        fresh_events = events[: args.fresh_events] if args.fresh_events else events
        fresh = freshness(broker.bootstrap, fresh_events, rate, model, str(Path(tmp) / "state-fresh"), args)
        log(f"freshness: {fresh}")
    emit({
        "bench": "e2e",
        "dataset": csv.name,
        "events": len(events),
        "model": {"arch": args.arch, "in_dim": FEATURE_DIM, "hidden": args.hidden, "out_dim": args.out_dim,
                  "fanouts": args.fanouts},
        "worker_settings": {"batch_size": args.batch_size, "max_batch_size": args.max_batch_size,
                            "batch_wait_ms": args.batch_wait_ms,
                            "kafka_client": args.kafka_client, "output_format": args.output_format,
                            "partitions": args.partitions},
        "produce": produced,
        "raw_consume": raw,
        "worker": worker,
        "worker_vs_raw_ratio": round(worker["events_per_s"] / raw["events_per_s"], 4),
        "freshness": fresh,
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "cpu_count": os.cpu_count(),
        "code": code_fingerprint(),
        "machine_load_at_end": machine_load(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
