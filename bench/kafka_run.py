"""Running the worker against the embedded broker for the end-to-end benchmarks: producing, consuming,
sustained throughput, freshness at a paced rate, and the CPU of each process."""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import threading
import time
import uuid
from typing import Any, Callable

from bench.common import CpuSampler, log, percentile
from gnnstream.stream.events import NodeUpsert, encode_event, event_key
from gnnstream.stream.kafka import EventConsumer, Producer, ensure_topics
from gnnstream.stream.updates import decode_update
from gnnstream.workers.settings import WorkerSettings
from gnnstream.workers.runtime.worker import Worker


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

    def __init__(self, worker: Worker, total: int, warmup: int = 0, mark: Callable[[], float] = time.time):
        self.worker, self.total = worker, total
        self.first_process: float | None = None
        self.done_at: float | None = None
        self.batches = 0
        # the end of the first batch after which ``warmup`` events were applied: (time, applied, published)
        self.warm: tuple[float, int, int] | None = None
        self.warm_wall = self.done_wall = 0.0  # the same two moments by ``mark()`` (a CpuSampler's samples)
        process, publish = worker._process, worker._publish

        def timed_process(*args: Any) -> None:
            if self.first_process is None:
                self.first_process = time.perf_counter()
            self.batches += 1
            process(*args)
            if self.warm is None and warmup and worker.health.applied >= warmup:
                self.warm = (time.perf_counter(), worker.health.applied, worker.health.published)
                self.warm_wall = mark()

        def timed_publish(publisher: Any) -> None:
            publish(publisher)
            engine = worker.engine
            if (self.done_at is None and worker.health.applied >= self.total and engine is not None
                    and not engine.pending() and publisher.pending() == 0):
                self.done_at = time.perf_counter()
                self.done_wall = mark()

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
def sustained(bootstrap: str, topic: str, total: int, model: str, state: str, args: argparse.Namespace,
              client: str, fmt: str, warmup: int = 0) -> dict[str, Any]:
    """The worker on a backlog of ``total`` events; with ``warmup``, also the rate after the first
    ``warmup`` events (from the end of the batch that passed them)."""
    settings = worker_settings(bootstrap, topic, model, state, uuid.uuid4().hex[:8], client, fmt, args)
    worker, thread, result = start_worker(settings, args.idle_s)
    with CpuSampler() as sampler:
        timed = Timed(worker, total, warmup, sampler.mark)
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
    out = {"events": summary["applied"], "published": summary["published"], "batches": timed.batches,
           "seconds": round(seconds, 3), "events_per_s": round(summary["applied"] / seconds, 1),
           # from a backlog produced before the worker started: dominated by queueing, not a freshness figure
           "pipeline_latency_backlog": histogram_quantiles(worker, "gnnstream_pipeline_latency_seconds")}
    if warmup:
        if timed.warm is None:
            raise SystemExit(f"the worker never passed {warmup} applied events")
        t, applied, published = timed.warm
        window = timed.done_at - t
        out["after_warmup"] = {"events": summary["applied"] - applied, "published": summary["published"] - published,
                               "seconds": round(window, 3),
                               "events_per_s": round((summary["applied"] - applied) / window, 1)}
        out["after_warmup"].update(cpu_per_event(sampler.cores(timed.warm_wall, timed.done_wall),
                                                 out["after_warmup"]["events_per_s"]))
    return out


def cpu_per_event(cores: dict[str, float], events_per_s: float) -> dict[str, Any]:
    """``cores`` used by each process while ``events_per_s`` flowed, and the CPU microseconds each spent
    per event: what a machine needs per event, whatever its number of cores."""
    if not cores or not events_per_s:
        return {"cores": cores}
    return {"cores": cores, "cpu_us_per_event": {role: round(c / events_per_s * 1e6, 1) for role, c in cores.items()}}


def freshness(bootstrap: str, events: list, rate: float, model: str, state: str,
              args: argparse.Namespace) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    topic = f"bench-fresh-ev-{tag}"
    settings = worker_settings(bootstrap, topic, model, state, tag, args.kafka_client, args.output_format, args,
                         partitions=1)
    output = settings.output_topic
    ensure_topics(bootstrap, {topic: 1, output: args.partitions, settings.dlq_topic: 1})
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


# ---------------------------------------------------------------------- synthetic mode


def worker_settings(bootstrap: str, topic: str, model: str, state: str, tag: str, client: str, fmt: str,
              args: argparse.Namespace, partitions: int | None = None) -> WorkerSettings:
    return WorkerSettings(bootstrap=bootstrap, state=state, model=model, events_topic=topic,
                          output_topic=f"bench-emb-{tag}", dlq_topic=f"bench-dlq-{tag}", group=f"bench-worker-{tag}",
                          partitions=partitions or args.partitions, batch_size=args.batch_size,
                          batch_wait_ms=args.batch_wait_ms, metrics_port=0, kafka_client=client, output_format=fmt,
                          max_batch_size=args.max_batch_size)
