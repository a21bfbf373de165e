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
engine alone would take at that cost. Then the throughput at the latency
bound: for each output format, with the default client, a bisection
(``--search-steps``, 4) between 0 and that configuration's backlog rate
for the highest paced rate at which freshness p99 (publish minus event
time, per published embedding) stays within 1 s and the lag flat for
``--hold-seconds`` (60) after a warm backlog and ``--fresh-warmup-s``;
each probe on a fresh broker and a fresh copy of the state, its final
embeddings compared with the engine alone's over the same events. It is
reported against the engine alone at batches of ``--batch-size``, with
the cores of each process and the delivery process's CPU per published
update at that rate (``targets.latency_bound``).

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

    .venv/bin/python -m bench.e2e                    # full stream (~53k events)
    .venv/bin/python -m bench.e2e --events 5000 --fresh-events 3000   # quick
    .venv/bin/python -m bench.e2e --graph synthetic  # the delivery matrix and the latency bound (~40 min)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path

from bench.common import FULL_EDGES, FULL_NODES, code_fingerprint, emit, log, machine_load, peak_rss_mib
from gnnstream.model import init_model_dir
from gnnstream.stream.backends import KAFKA_CLIENTS
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.events import encode_event, event_key
from gnnstream.stream.kafka import ensure_topics
from gnnstream.fraud.datasets import BITCOIN_OTC
from gnnstream.stream.snap import FEATURE_DIM, read_snap, snap_events
from gnnstream.workers.heap import tune_collector
from gnnstream.workers.settings import WorkerSettings
from bench.e2e_matrix import synthetic
from bench.kafka_run import freshness, produce, raw_consume, sustained

DEFAULT_CSV = BITCOIN_OTC


def _fanouts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", default=str(DEFAULT_CSV), help="SNAP signed-network CSV (default Bitcoin OTC)")
    p.add_argument("--events", type=int, default=0, help="only the first N events (default: all)")
    p.add_argument("--fresh-events", type=int, default=15_000, help="events produced for the freshness phase")
    p.add_argument("--rate-fraction", type=float, default=None,
                   help="freshness produce rate / sustained rate (default 0.5)")
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
                        "alone against every client x format, then each format's highest rate within the latency "
                        "bound")
    g.add_argument("--nodes", type=int, default=FULL_NODES, help="synthetic graph nodes")
    g.add_argument("--edges", type=int, default=FULL_EDGES, help="synthetic graph distinct directed edges")
    g.add_argument("--stream-events", type=int, default=50_000, help="update events measured in the throughput runs")
    g.add_argument("--warmup-events", type=int, default=20_000,
                   help="events before those, not measured: a state just opened reads its caches in first")
    g.add_argument("--clients", default=",".join(KAFKA_CLIENTS), help="comma-separated Kafka clients to run")
    g.add_argument("--formats", default="json,binary,packed",
                   help="comma-separated output formats to run (the latency-bound search runs each)")
    g.add_argument("--hold-seconds", type=float, default=60.0,
                   help="measured seconds of each probe of the latency-bound search: a rate holds when freshness "
                        "p99 stays within 1 s and the lag flat over them (0: no search)")
    g.add_argument("--search-steps", type=int, default=4,
                   help="probes per output format of the latency-bound search (a bisection)")
    g.add_argument("--fresh-warmup-s", type=float, default=5.0,
                   help="seconds of each paced stream before its measurement starts")
    g.add_argument("--store-cache", default=None,
                   help="directory keeping a loaded copy of the synthetic graph store between runs")
    g.add_argument("--workdir", default=None, help="directory for the temporary states (default: system temp)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- helpers
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
