"""Kafka client benchmark: kafka-python against confluent-kafka, side by side.

For each message format (binary float32, ~0.55 KB, and JSON, ~1.5 KB, both
made by :func:`gnnstream.stream.updates.encode_updates` from random 128-d embeddings)
and each client of :data:`gnnstream.stream.backends.KAFKA_CLIENTS`, on a fresh embedded
broker (Tansu keeps every message in RAM, so each cell gets its own broker,
stopped after it):

* produce: ``send`` of every message, then ``flush``, with the client's
  default settings (idempotent, ``acks=all``, linger 5 ms); msg/s and MB/s
  over the whole loop, flush included, after a flushed warm-up record to
  another topic of the same broker (connection, metadata and the idempotent
  producer id are set up before the clock starts: ``warm_up_s``);
* consume: a fresh group member reads the topic back with ``poll_batch``;
  msg/s from the end of the first non-empty poll to the last record (the
  group join, about ``session_timeout_ms / 2`` on Tansu, is reported
  separately as ``join_s``). Every message is checked to come back once, in
  offset order per partition, with its value.

Prints ONE JSON object on stdout; progress goes to stderr.

    .venv/bin/python -m bench.clients                       # 50,000 messages per cell
    .venv/bin/python -m bench.clients --messages 10000 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np
from bench.common import emit, log, machine_load

from gnnstream.stream.backends import KAFKA_CLIENTS, open_consumer, open_producer
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.clients import Record
from gnnstream.stream.kafka import ensure_topics
from gnnstream.stream.updates import encode_updates, update_key

FORMATS = ("binary", "json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=50_000, help="messages per (format, client) cell")
    p.add_argument("--dim", type=int, default=128, help="embedding dimension")
    p.add_argument("--nodes", type=int, default=20_000, help="distinct node ids (message keys)")
    p.add_argument("--partitions", type=int, default=4, help="partitions of each topic")
    p.add_argument("--batch", type=int, default=5000, help="poll_batch max_records")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of binary,json")
    p.add_argument("--clients", default=",".join(KAFKA_CLIENTS), help="comma-separated Kafka clients")
    p.add_argument("--repeat", type=int, default=1, help="rounds per cell (the median is reported)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f]
    args.clients = [c for c in args.clients.split(",") if c]
    for fmt in args.formats:
        if fmt not in FORMATS:
            p.error(f"unknown format {fmt!r} (expected some of {', '.join(FORMATS)})")
    for client in args.clients:
        if client not in KAFKA_CLIENTS:
            p.error(f"unknown client {client!r} (expected some of {', '.join(KAFKA_CLIENTS)})")
    if args.messages < 1 or args.repeat < 1:
        p.error("--messages and --repeat must be >= 1")
    return args


def make_messages(n: int, dim: int, nodes: int, fmt: str, seed: int) -> list[tuple[bytes, bytes]]:
    """``n`` embedding updates as the worker publishes them: ``(key, value)``."""
    rng = np.random.default_rng(seed)
    ids = [str(i % nodes) for i in range(n)]
    rows = rng.standard_normal((n, dim), dtype=np.float32)
    values = encode_updates(ids, "sage:bench", list(range(n)), [1.7e9 + i for i in range(n)], 1.7e9,
                            ["exact"] * n, rows, fmt)
    return [(update_key(node), value) for node, value in zip(ids, values)]


def produce(client: str, bootstrap: str, topic: str, warm_topic: str,
            messages: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    total_bytes = sum(len(v) for _, v in messages)
    with open_producer(client, bootstrap) as producer:
        t0 = time.perf_counter()
        producer.send(warm_topic, b"warm-up", b"")  # connections, metadata, producer id: not timed
        producer.flush(60)
        warm_s = time.perf_counter() - t0
        send = producer.send
        t0 = time.perf_counter()
        for key, value in messages:
            send(topic, key, value)
        t1 = time.perf_counter()
        sent = producer.flush(120)
        seconds = time.perf_counter() - t0
    if sent != len(messages):
        raise SystemExit(f"{client}: flush acknowledged {sent} of {len(messages)} records")
    return {"seconds": round(seconds, 3), "msgs_per_s": round(len(messages) / seconds),
            "mb_per_s": round(total_bytes / seconds / 1e6, 1), "send_loop_s": round(t1 - t0, 3),
            "flush_s": round(seconds - (t1 - t0), 3), "warm_up_s": round(warm_s, 3)}


def consume(client: str, bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]],
            batch: int) -> dict[str, Any]:
    total = len(messages)
    records: list[Record] = []
    t_start = time.perf_counter()
    first = last = None
    first_count = 0
    with open_consumer(client, bootstrap, topic, f"bench-{uuid.uuid4().hex[:8]}") as consumer:
        deadline = time.monotonic() + 300
        while len(records) < total and time.monotonic() < deadline:
            got = consumer.poll_batch(batch, 0.2)
            if got:
                now = time.perf_counter()
                if first is None:
                    first, first_count = now, len(got)
                records.extend(got)
                last = now
    if len(records) != total or first is None or last is None:
        raise SystemExit(f"{client}: read {len(records)} of {total} records")
    check(client, records, messages)
    seconds = max(last - first, 1e-9)  # the first poll's records were read before `first`
    return {"seconds": round(seconds, 3), "msgs_per_s": round((total - first_count) / seconds),
            "join_s": round(first - t_start, 2), "first_batch": first_count}


def check(client: str, records: list[Record], messages: list[tuple[bytes, bytes]]) -> None:
    """Every message back once, offsets 0.. without gaps per partition, values intact."""
    by_partition: dict[int, list[int]] = {}
    for r in records:
        by_partition.setdefault(r.partition, []).append(r.offset)
    for partition, offsets in by_partition.items():
        if offsets != list(range(len(offsets))):
            raise SystemExit(f"{client}: partition {partition} came back out of order or with gaps")
    sent = sorted(v for _, v in messages)
    if sorted(r.value for r in records) != sent:
        raise SystemExit(f"{client}: the values read back differ from those sent")


def run_cell(client: str, fmt: str, messages: list[tuple[bytes, bytes]], args: argparse.Namespace) -> dict:
    with EmbeddedBroker() as broker:
        topic, warm_topic = f"bench-{fmt}-{uuid.uuid4().hex[:8]}", f"bench-warm-{uuid.uuid4().hex[:8]}"
        ensure_topics(broker.bootstrap, {topic: args.partitions, warm_topic: args.partitions})
        produced = produce(client, broker.bootstrap, topic, warm_topic, messages)
        log(f"{fmt} {client}: produce {produced['msgs_per_s']:,} msg/s")
        consumed = consume(client, broker.bootstrap, topic, messages, args.batch)
        log(f"{fmt} {client}: consume {consumed['msgs_per_s']:,} msg/s (join {consumed['join_s']} s)")
    return {"produce": produced, "consume": consumed}


def _median(runs: list[dict], phase: str) -> dict[str, Any]:
    rates = [r[phase]["msgs_per_s"] for r in runs]
    best = sorted(runs, key=lambda r: r[phase]["msgs_per_s"])[len(runs) // 2][phase]
    return {**best, "msgs_per_s": round(statistics.median(rates)), "runs_msgs_per_s": rates}


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {
        "bench": "clients", "messages": args.messages, "dim": args.dim, "partitions": args.partitions,
        "poll_batch": args.batch, "repeat": args.repeat,
        "versions": {"kafka-python": _version("kafka-python"), "confluent-kafka": _version("confluent-kafka"),
                     "python": sys.version.split()[0]},
        "machine_before": machine_load(), "formats": {},
    }
    for fmt in args.formats:
        messages = make_messages(args.messages, args.dim, args.nodes, fmt, args.seed)
        cell: dict[str, Any] = {"bytes_per_message": round(sum(len(v) for _, v in messages) / len(messages), 1)}
        runs: dict[str, list[dict]] = {c: [] for c in args.clients}
        for round_ in range(args.repeat):
            order = args.clients if round_ % 2 == 0 else args.clients[::-1]  # alternate who goes first
            for client in order:
                runs[client].append(run_cell(client, fmt, messages, args))
        for client in args.clients:
            cell[client] = {"produce": _median(runs[client], "produce"),
                            "consume": _median(runs[client], "consume")}
        if set(KAFKA_CLIENTS) <= set(args.clients):
            base, fast = cell["kafka-python"], cell["confluent"]
            cell["confluent_speedup"] = {
                phase: round(fast[phase]["msgs_per_s"] / base[phase]["msgs_per_s"], 2)
                for phase in ("produce", "consume")}
        result["formats"][fmt] = cell
    result["machine_after"] = machine_load()
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
