"""End-to-end streaming benchmark: Kafka in, Kafka out, against the engine alone.

Two modes.

``--graph synthetic`` (the delivery benchmark): the engine bench's seeded
power-law graph (2^17 nodes, 1.2 M directed edges, SAGE 128-d, fanouts
25,10), loaded and backfilled once; every run below starts from a copy of
that state. ``--warmup-events`` (20,000) then ``--stream-events`` (50,000)
update events (90 % edge upserts, 5 % deletes, 5 % feature updates) are
  * applied by the engine alone (``store.apply`` + ``engine.recompute``, no
    Kafka, no decoding) in batches of ``--batch-size`` and of
    ``--max-batch-size``;
  * produced to a fresh broker as a backlog and consumed by a worker, once
    for each Kafka client x output format;
  * applied by the engine alone again, at the faster batch size; the
    fastest of the engine's runs is the reference of every ratio (the
    machine's speed drifts during a run; this errs towards lower ratios);
rates are over the events after the warm-up (a state just opened reads its
caches in first), and every worker's final embeddings are compared with
the engine's. Over the same events each run reports the cores its
processes used (the engine's process; the worker, its delivery process and
the broker from ``/proc``) and the CPU microseconds per event they add up
to, and ``targets`` the cores the default's 0.5 and the best's 0.8 of the
engine alone would take at that cost. Then the default configuration runs
at ``--rate-fraction`` (0.8) of its own rate for ``--fresh-seconds`` (60)
after a warm backlog: publish - produce per batch (p50, p99, max) and the
lag every second.

``--graph otc`` (default) starts an embedded broker (Tansu), produces the
whole SNAP Bitcoin OTC stream (``fraud.datasets.snap_events``, ~53k
events) and measures:

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
    .venv/bin/python bench/e2e.py --graph synthetic  # the delivery matrix (~15 min)
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np


from bench.common import (
    FEATURE_DIM as SYNTH_DIM, FULL_EDGES, FULL_NODES, CpuSampler, code_fingerprint, emit, log, machine_load,
    make_graph, model_dir, open_loaded_store, peak_rss_mib, percentile,
)
from gnnstream.model import init_model_dir
from gnnstream.stream.backends import KAFKA_CLIENTS, open_producer
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.events import NodeUpsert, encode_event, event_key
from gnnstream.stream.kafka import EventConsumer, Producer, ensure_topics
from gnnstream.stream.updates import decode_update
from gnnstream.fraud.datasets import BITCOIN_OTC
from gnnstream.stream.snap import FEATURE_DIM, read_snap, snap_events
from gnnstream.workers.heap import tune_collector
from gnnstream.workers.settings import WorkerSettings
from gnnstream.workers.runtime.worker import Worker

DEFAULT_CSV = BITCOIN_OTC


def _fanouts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", default=str(DEFAULT_CSV), help="SNAP signed-network CSV (default Bitcoin OTC)")
    p.add_argument("--events", type=int, default=0, help="only the first N events (default: all)")
    p.add_argument("--fresh-events", type=int, default=15_000, help="events produced for the freshness phase")
    p.add_argument("--rate-fraction", type=float, default=None,
                   help="freshness produce rate / sustained rate (default 0.5; synthetic mode 0.8)")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the throughput topic")
    p.add_argument("--batch-size", type=int, default=1000, help="worker --batch-size")
    p.add_argument("--batch-wait-ms", type=int, default=200, help="worker --batch-wait-ms")
    p.add_argument("--max-batch-size", type=int, default=10_000, help="worker --max-batch-size")
    p.add_argument("--arch", default="sage", choices=["sage", "gcn", "gat"])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--out-dim", type=int, default=64)
    p.add_argument("--fanouts", type=_fanouts, default=[25, 10])
    p.add_argument("--idle-s", type=float, default=3.0, help="worker max_idle_s after the stream")
    p.add_argument("--kafka-client", default=WorkerSettings.kafka_client, choices=list(KAFKA_CLIENTS),
                   help="worker --kafka-client (Bitcoin OTC mode)")
    p.add_argument("--output-format", default=WorkerSettings.output_format, choices=["json", "binary"],
                   help="worker --output-format (Bitcoin OTC mode)")
    g = p.add_argument_group("synthetic mode (--graph synthetic)")
    g.add_argument("--graph", default="otc", choices=["otc", "synthetic"],
                   help="otc: the Bitcoin OTC replay above; synthetic: the engine bench's power-law graph, engine "
                        "alone against every client x format, then freshness at --rate-fraction of the default's rate")
    g.add_argument("--nodes", type=int, default=FULL_NODES, help="synthetic graph nodes")
    g.add_argument("--edges", type=int, default=FULL_EDGES, help="synthetic graph distinct directed edges")
    g.add_argument("--stream-events", type=int, default=50_000, help="update events measured in the throughput runs")
    g.add_argument("--warmup-events", type=int, default=20_000,
                   help="events before those, not measured: a state just opened reads its caches in first")
    g.add_argument("--clients", default=",".join(KAFKA_CLIENTS), help="comma-separated Kafka clients to run")
    g.add_argument("--formats", default="json,binary", help="comma-separated output formats to run")
    g.add_argument("--fresh-seconds", type=float, default=60.0, help="measured length of the freshness run (0: no freshness run)")
    g.add_argument("--fresh-warmup-s", type=float, default=5.0,
                   help="seconds of the paced stream before the freshness measurement starts")
    g.add_argument("--store-cache", default=None,
                   help="directory keeping a loaded copy of the synthetic graph store between runs")
    g.add_argument("--workdir", default=None, help="directory for the temporary states (default: system temp)")
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
    settings = _settings(bootstrap, topic, model, state, uuid.uuid4().hex[:8], client, fmt, args)
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
    settings = _settings(bootstrap, topic, model, state, tag, args.kafka_client, args.output_format, args,
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
def clone_state(src: Path, dst: Path) -> None:
    """A copy of the closed state ``src``: RocksDB table files (immutable) hard-linked, the rest copied."""
    def copy(a: str, b: str) -> str:
        if a.endswith(".sst"):
            try:
                os.link(a, b)
                return b
            except OSError:
                pass
        return shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=copy)


def final_rows(state: Path, model: str) -> dict[str, np.ndarray]:
    """Every node's stored final embedding in ``state``, by name."""
    from gnnstream.workers.state import open_engine, open_store
    from gnnstream.graph_state.page_log import read_final_rows
    with open_store(state, create=False, model_dir=model) as store:
        engine = open_engine(store, model)
        iids = np.fromiter(store.node_iids(), dtype=np.int64)
        rows, present = read_final_rows(store, iids, engine.model.config.out_dim)
        return {store.name(i): rows[k] for k, i in enumerate(iids.tolist()) if present[k]}


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Largest absolute difference between two name -> row maps (inf when the node sets differ)."""
    if a.keys() != b.keys():
        return float("inf")
    names = sorted(a)
    return float(np.abs(np.stack([a[n] for n in names]) - np.stack([b[n] for n in names])).max()) if names else 0.0


def engine_alone(state: Path, model: str, events: list, batch: int, warmup: int) -> dict[str, Any]:
    """``store.apply`` + ``engine.recompute`` over ``events`` in batches of ``batch``: no Kafka, no decoding.

    Reported for the whole run (from the state as opened, caches cold) and
    for the batches after the first ``warmup`` events (``updates_per_s``).
    """
    from gnnstream.workers.heap import freeze_warm_heap
    from gnnstream.workers.state import open_engine, open_store
    times: list[float] = []
    cpu: list[float] = []  # CPU of the process (every thread) per batch
    published: list[int] = []
    with open_store(state, create=False, model_dir=model) as store:
        engine = open_engine(store, model)
        freeze_warm_heap()  # as the worker does once started
        for start in range(0, len(events), batch):
            chunk = events[start:start + batch]
            t, c = time.perf_counter(), time.process_time()
            result = store.apply(chunk)
            stats = engine.recompute(event_ts=result.max_ts)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            published.append(stats.published)
        drained = engine.drain().published  # deferred hub work: not timed, as a worker does it when idle
    skip = -(-warmup // batch)  # batches holding the warm-up events
    measured, seconds = len(events) - min(skip * batch, len(events)), sum(times[skip:])
    if not measured:
        raise SystemExit(f"no batch of {batch} events after the warm-up: give more --stream-events")
    return {"batch": batch, "batches": len(times), "events": len(events), "seconds": round(sum(times), 3),
            "updates_per_s_with_warmup": round(len(events) / sum(times), 1),
            "after_warmup": {"events": measured, "seconds": round(seconds, 3),
                             "published": sum(published[skip:])},
            "updates_per_s": round(measured / seconds, 1) if seconds else None,
            "published_per_event": round(sum(published[skip:]) / max(measured, 1), 3),
            "published_in_drain": drained,
            **cpu_per_event({"engine": round(sum(cpu[skip:]) / seconds, 3)} if seconds else {},
                            measured / seconds if seconds else 0.0)}


def _paced_producer(bootstrap: str, topic: str, warm: list, events: list, rate: float, sent: Any, go: Any) -> None:
    """Child process of the freshness run: ``warm`` at once, then after ``go`` ``events`` at ``rate``.

    Each event's ``ts`` is its send time. ``sent`` counts the paced events handed to the client and flushed.
    """
    producer = open_producer("confluent", bootstrap)
    try:
        def send(ev: Any) -> None:
            stamped = dataclasses.replace(ev, ts=time.time())
            producer.send(topic, event_key(stamped), encode_event(stamped))

        for ev in warm:
            send(ev)
        producer.flush(60)
        go.wait()
        t0 = time.perf_counter()
        for i, ev in enumerate(events, 1):
            ahead = i / rate - (time.perf_counter() - t0)
            if ahead > 0.002:
                time.sleep(ahead)
            send(ev)
            if i % 50 == 0:
                producer.flush(30)
                sent.value = i
        producer.flush(30)
        sent.value = len(events)
    finally:
        producer.close()


def paced_freshness(bootstrap: str, warm: list, events: list, rate: float, model: str, state: str, client: str,
                    fmt: str, args: argparse.Namespace, query_port: int = 0,
                    alongside: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """``warm`` as a backlog, then ``events`` at ``rate`` on a fresh topic: freshness and lag.

    The producer is a child process (it does not share this process's
    interpreter with the worker). The paced events start once the worker
    has applied and published the backlog (its caches are then warm), and
    the first ``--fresh-warmup-s`` seconds of them are not counted.
    Reported: publish - produce per delivered batch
    (``Worker.latency_timeline``: publish time minus the Kafka time of the
    batch's oldest record), the worker's freshness histogram (publish minus
    event time, per published embedding) and the lag (events produced minus
    events applied) sampled every second, with its least-squares slope.

    With ``query_port`` the worker serves its query API there, and
    ``alongside()`` runs in a thread from the end of the warm-up; what it
    returns is reported as ``alongside``, and the freshness and lag figures
    cover its run only (``alongside_window``).
    """
    import multiprocessing as mp
    tag = uuid.uuid4().hex[:8]
    topic = f"bench-fresh-ev-{tag}"
    ensure_topics(bootstrap, {topic: args.partitions})
    settings = dataclasses.replace(_settings(bootstrap, topic, model, state, tag, client, fmt, args),
                                   query_port=query_port)
    worker, thread, result = start_worker(settings, None)
    ctx = mp.get_context("spawn")
    sent, go = ctx.Value("q", 0), ctx.Event()
    child = ctx.Process(target=_paced_producer, args=(bootstrap, topic, warm, events, rate, sent, go), daemon=True)
    thread.start()
    child.start()
    log(f"freshness: a backlog of {len(warm)} events first")
    deadline = time.monotonic() + 600

    def caught_up() -> bool:
        engine, sender = worker.engine, worker.publisher
        return (worker.health.applied >= len(warm) and worker.health.published > 0 and engine is not None
                and not engine.pending() and sender is not None and sender.in_flight() == 0)

    while not caught_up() and time.monotonic() < deadline:
        if "error" in result:
            raise result["error"]
        time.sleep(0.1)
    if not caught_up():
        raise SystemExit(f"freshness warm-up: the backlog was not done within 600 s (alive {child.is_alive()}; "
                         f"worker {worker.health_info()})")
    applied0 = worker.health.applied
    log(f"freshness: producing {len(events)} events at {rate:.0f} ev/s ({len(events) / rate:.0f} s, "
        f"the first {args.fresh_warmup_s:g} s not counted)")
    go.set()
    t0 = time.monotonic()
    lag: list[dict[str, float]] = []
    deadline = t0 + 2 * len(events) / rate + 120
    base_fresh = None
    side: dict[str, Any] = {}
    side_thread: threading.Thread | None = None

    def run_alongside() -> None:
        try:
            side["result"] = alongside()
        except BaseException as exc:  # reported by _alongside_report, after the stream
            side["error"] = exc
        side["end_s"] = time.monotonic() - t0

    def alongside_done() -> None:  # once the load is over: the stream's figures while it ran
        if side_thread is not None and not side_thread.is_alive() and "latency" not in side:
            side["latency"] = [latency for _, latency in worker.latency_timeline]
            side["fresh"] = histogram_quantiles(worker, "gnnstream_embedding_freshness_seconds", base_fresh)

    while time.monotonic() < deadline:
        time.sleep(1.0)
        if base_fresh is None and time.monotonic() - t0 >= args.fresh_warmup_s:
            worker.latency_timeline.clear()
            base_fresh = histogram_state(worker, "gnnstream_embedding_freshness_seconds")
            if alongside is not None:
                side["start_s"] = time.monotonic() - t0
                side_thread = threading.Thread(target=run_alongside)
                side_thread.start()
        alongside_done()
        produced, applied = sent.value, worker.health.applied - applied0
        lag.append({"t_s": round(time.monotonic() - t0, 2), "produced": produced, "applied": applied,
                    "lag": max(0, produced - applied)})
        if "error" in result:
            raise result["error"]
        if int(lag[-1]["t_s"]) % 10 == 0:
            log(f"freshness: {lag[-1]}")
        engine = worker.engine
        if not child.is_alive() and applied >= len(events) and engine is not None and not engine.pending():
            break
    alongside_done()  # it may have ended after the last look
    produce_s = lag[-1]["t_s"]
    child.join(30)
    time.sleep(1.0)  # the last batch's delivery
    worker.stop()
    thread.join(60)
    if "error" in result:
        raise result["error"]
    latencies = [latency for _, latency in worker.latency_timeline]
    # while the producer ran, after the warm-up
    window = [x for x in lag if x["t_s"] >= args.fresh_warmup_s and x["produced"] < len(events)]
    slope = float(np.polyfit([x["t_s"] for x in window], [x["lag"] for x in window], 1)[0]) if len(window) > 2 else 0.0
    duration = window[-1]["t_s"] - window[0]["t_s"] if len(window) > 1 else produce_s
    growth = slope * duration
    p99 = percentile(latencies, 99)
    return {
        "client": client, "output_format": fmt, "partitions": args.partitions,
        "target_rate": round(rate, 1), "backlog_events": len(warm), "events": len(events),
        "warmup_s": args.fresh_warmup_s,
        "measured_s": round(duration, 2),
        "achieved_rate": round((window[-1]["produced"] - window[0]["produced"]) / max(duration, 1e-9), 1)
        if len(window) > 1 else None,
        "publish_minus_produce_per_batch": {
            "batches": len(latencies), "p50_s": round(percentile(latencies, 50), 4), "p99_s": round(p99, 4),
            "max_s": round(max(latencies), 4) if latencies else None},
        "embedding_freshness": histogram_quantiles(worker, "gnnstream_embedding_freshness_seconds", base_fresh),
        "lag": {"slope_events_per_s": round(slope, 3), "growth_over_run_events": round(growth, 1),
                "max_events": max((x["lag"] for x in window), default=0),
                "samples": [[x["t_s"], x["lag"]] for x in lag]},
        "pass_p99_le_1s": bool(latencies) and p99 <= 1.0,
        # "does not grow": over the whole run the fitted lag rises by less than one second of events
        "pass_lag_flat": growth < rate,
        **(_alongside_report(side, lag) if alongside is not None else {}),
    }


def _alongside_report(side: dict[str, Any], lag: list[dict[str, float]]) -> dict[str, Any]:
    """What ``alongside`` returned, and the stream's freshness and lag while it ran."""
    if "start_s" not in side:
        raise SystemExit(f"the stream ended ({lag[-1]['t_s']:.0f} s) before its warm-up was over: the load beside "
                         f"it never started")
    if "error" in side:
        raise side["error"]
    if "latency" not in side:
        raise SystemExit(f"the load beside the stream did not finish within the {lag[-1]['t_s']:.0f} s of the "
                         f"stream: it fell behind its schedule")
    latencies = side["latency"]
    window = [x for x in lag if side["start_s"] <= x["t_s"] <= side["end_s"]]
    return {"alongside": side["result"], "alongside_window": {
        "from_s": round(side["start_s"], 2), "to_s": round(side["end_s"], 2),
        "publish_minus_produce_per_batch": {
            "batches": len(latencies), "p50_s": round(percentile(latencies, 50), 4),
            "p99_s": round(percentile(latencies, 99), 4), "max_s": round(max(latencies), 4) if latencies else None},
        "embedding_freshness": side["fresh"],
        "lag_max_events": max((x["lag"] for x in window), default=0)}}


def _settings(bootstrap: str, topic: str, model: str, state: str, tag: str, client: str, fmt: str,
              args: argparse.Namespace, partitions: int | None = None) -> WorkerSettings:
    return WorkerSettings(bootstrap=bootstrap, state=state, model=model, events_topic=topic,
                          output_topic=f"bench-emb-{tag}", dlq_topic=f"bench-dlq-{tag}", group=f"bench-worker-{tag}",
                          partitions=partitions or args.partitions, batch_size=args.batch_size,
                          batch_wait_ms=args.batch_wait_ms, metrics_port=0, kafka_client=client, output_format=fmt,
                          max_batch_size=args.max_batch_size)


def base_state(args: argparse.Namespace, work: Path, result: dict[str, Any]) -> tuple[Any, str, Path]:
    """The synthetic graph, its model and its loaded, backfilled state in ``work`` (``result`` gets the graph's
    stats and the setup times); returns ``(graph, model directory, state)``."""
    from gnnstream.workers.offline.jobs import backfill
    graph = make_graph(args.nodes, args.edges, dim=SYNTH_DIM, seed=0)
    result["graph"] = graph.stats()
    model = str(work / "model")
    model_dir(model, dim=SYNTH_DIM, fanouts=args.fanouts, seed=0)
    base = work / "base"
    store, load = open_loaded_store(base, graph, dim=SYNTH_DIM, cache_dir=args.store_cache)
    store.close()
    log("backfill of the base state")
    result["setup"] = {"load": load, "backfill": backfill(str(base), model)}
    return graph, model, base


def synthetic(args: argparse.Namespace) -> dict[str, Any]:
    """The synthetic mode: one base state, then engine alone and every client x format on copies of it."""
    import bench.engine as engine_bench
    clients = [c for c in args.clients.split(",") if c]
    formats = [f for f in args.formats.split(",") if f]
    default = (WorkerSettings.kafka_client, WorkerSettings.output_format)
    if default[0] not in clients or default[1] not in formats:
        raise SystemExit(f"--clients/--formats must include the default configuration {default}")
    fraction = 0.8 if args.rate_fraction is None else args.rate_fraction
    work = Path(tempfile.mkdtemp(prefix="gnnstream-e2e-", dir=args.workdir))
    result: dict[str, Any] = {"bench": "e2e", "mode": "synthetic", "code": code_fingerprint(),
                              "machine_load_at_start": machine_load()}
    try:
        graph, model, base = base_state(args, work, result)
        rng = np.random.default_rng(1)
        warm = args.warmup_events
        events, counts = engine_bench.stream_events(graph, warm + args.stream_events, rng, 0.90, 0.05,
                                                    1_800_000_000, args.batch_size)
        result["config"] = {
            "model": {"arch": "sage", "dim": SYNTH_DIM, "fanouts": args.fanouts}, "event_counts": counts,
            "worker": {"batch_size": args.batch_size, "max_batch_size": args.max_batch_size,
                       "batch_wait_ms": args.batch_wait_ms, "partitions": args.partitions},
            "warmup_events": warm, "measured_events": args.stream_events,
            "default_configuration": {"kafka_client": default[0], "output_format": default[1]}}

        # engine alone, at the worker's first and at its largest batch size, before the workers and again
        # after them: the fastest run is the reference (the machine's speed drifts; this errs low)
        alone = []

        def run_alone(batch: int, when: str) -> None:
            state = work / f"engine-{batch}"
            clone_state(base, state)
            log(f"engine alone, batches of {batch} ({when} the workers)")
            alone.append({"when": when, **engine_alone(state, model, events, batch, warm)})
            log(f"engine alone: {alone[-1]}")

        for batch in sorted({args.batch_size, args.max_batch_size}):
            run_alone(batch, "before")
        reference_rows = final_rows(work / f"engine-{args.batch_size}", model)
        for batch in sorted({args.batch_size, args.max_batch_size}):
            shutil.rmtree(work / f"engine-{batch}", ignore_errors=True)

        messages = [(event_key(ev), encode_event(ev)) for ev in events]
        matrix = []
        for client in clients:
            for fmt in formats:
                state = work / f"state-{client}-{fmt}"
                clone_state(base, state)
                with EmbeddedBroker() as broker:  # a fresh broker each: it keeps every message in memory
                    topic = f"bench-ev-{uuid.uuid4().hex[:8]}"
                    ensure_topics(broker.bootstrap, {topic: args.partitions})
                    produce(broker.bootstrap, topic, messages)
                    log(f"worker: {client}, {fmt}")
                    run = sustained(broker.bootstrap, topic, len(messages), model, str(state), args, client, fmt,
                                    warm)
                diff = max_abs_diff(final_rows(state, model), reference_rows)
                shutil.rmtree(state, ignore_errors=True)
                measured = run["after_warmup"]
                row = {"kafka_client": client, "output_format": fmt, "default": (client, fmt) == default,
                       "events_per_s": measured["events_per_s"],
                       "published_per_s": round(measured["published"] / measured["seconds"], 1),
                       "published_per_event": round(measured["published"] / measured["events"], 3),
                       "max_abs_diff_to_engine_alone": diff, "run": run}
                log(f"worker: {row}")
                matrix.append(row)
        fastest = max(alone, key=lambda a: a["updates_per_s"])["batch"]
        run_alone(fastest, "after")
        shutil.rmtree(work / f"engine-{fastest}", ignore_errors=True)
        best_alone = max(a["updates_per_s"] for a in alone)
        best_alone_cold = max(a["updates_per_s_with_warmup"] for a in alone)
        result["engine_alone"] = {"runs": alone, "updates_per_s": best_alone,
                                  "updates_per_s_with_warmup": best_alone_cold}
        for row in matrix:  # against the engine's runs before and after the workers
            row["ratio_to_engine_alone"] = round(row["events_per_s"] / best_alone, 3)
            row["ratio_with_warmup"] = round(row["run"]["events_per_s"] / best_alone_cold, 3)
        result["matrix"] = matrix
        default_row = next(r for r in matrix if r["default"])
        best_row = max(matrix, key=lambda r: r["events_per_s"])

        result["targets"] = {
            "default_ratio": default_row["ratio_to_engine_alone"], "default_ratio_required": 0.5,
            "default_ratio_pass": default_row["ratio_to_engine_alone"] >= 0.5,
            "best": f"{best_row['kafka_client']}, {best_row['output_format']}",
            "best_ratio": best_row["ratio_to_engine_alone"], "best_ratio_required": 0.8,
            "best_ratio_pass": best_row["ratio_to_engine_alone"] >= 0.8,
            "exact_pass": all(r["max_abs_diff_to_engine_alone"] <= 1e-4 for r in matrix),
        }
        # the cores each target asks for, at the CPU per event each configuration spent here (a worker's
        # processes take CPU in proportion to the events: more cores do not make an event cheaper)
        for name, row, ratio in (("default", default_row, 0.5), ("best", best_row, 0.8)):
            per_event = row["run"]["after_warmup"].get("cpu_us_per_event", {}).get("total")
            if per_event:
                result["targets"][f"{name}_cores_needed"] = round(ratio * best_alone * per_event / 1e6, 2)
        if args.fresh_seconds <= 0:
            return result
        rate = fraction * default_row["events_per_s"]
        fresh_events, _ = engine_bench.stream_events(graph, warm + int(rate * (args.fresh_seconds
                                                                              + args.fresh_warmup_s)),
                                                     np.random.default_rng(2), 0.90, 0.05, 1_800_000_000,
                                                     args.batch_size)
        state = work / "state-fresh"
        clone_state(base, state)
        with EmbeddedBroker() as broker:
            fresh = paced_freshness(broker.bootstrap, fresh_events[:warm], fresh_events[warm:], rate, model,
                                    str(state), *default, args)
        fresh["rate_fraction"] = fraction
        result["freshness"] = fresh
        result["targets"].update(freshness_p99_pass=fresh["pass_p99_le_1s"], lag_flat_pass=fresh["pass_lag_flat"])
    finally:
        result["peak_rss_mib"] = round(peak_rss_mib(), 1)
        result["machine_load_at_end"] = machine_load()
        result["cpu_count"] = os.cpu_count()
        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ.setdefault("GNNSTREAM_NO_PROGRESS", "1")
    tune_collector()  # as the gnnstream command does
    if args.graph == "synthetic":
        emit(synthetic(args))
        return 0
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
        worker = sustained(broker.bootstrap, topic, len(messages), model, str(Path(tmp) / "state-throughput"), args,
                           args.kafka_client, args.output_format)
        log(f"worker: {worker}")
        rate = (0.5 if args.rate_fraction is None else args.rate_fraction) * worker["events_per_s"]
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
