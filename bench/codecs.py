"""The delivery process's cost per update, per output format: encoding alone, or whole delivery rounds.

``python -m bench.codecs [--nodes N] [--dim D] [--partitions P] [--repeat R]`` encodes one batch of update
columns the way :class:`gnnstream.stream.delivery.Delivery` does (JSON and binary: ``encode_columns``;
packed: ``encode_frames`` into frames of at most 1 MB), no broker, and prints JSON: per format the CPU time
per update (best of ``--repeat``), the bytes per update and the messages.

``--rounds K [--round-updates U]`` measures the delivery process instead: per format, a
:class:`gnnstream.stream.delivery.DeliveryProcess` (confluent client) on an embedded broker is handed every
one of the ``N`` nodes once (what it remembers of them, as in a worker that ran a while), then ``K`` rounds
of ``U`` distinct random nodes, 20 ms apart, the way the worker's publisher hands them over (interned ids,
the headers of a worker); reported: the process's CPU (``/proc``, every thread) per round and per update,
and the wall time of a round. Beside it, the client alone: the same rounds' messages encoded beforehand
(in this process, untimed) and sent by a confluent producer with the same settings and headers, each round
flushed; its CPU is this process's (every thread: librdkafka's too) over the sends and flushes only, the
least a delivery process spends with that client, whatever its encoding and hand-over cost.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import numpy as np

from bench.common import log, machine_load
from gnnstream.stream.clients import MAX_MESSAGE_BYTES
from gnnstream.stream.deadletter import RECORD_OVERHEAD
from gnnstream.stream.delivery import (CHUNK, WORKER_HEADER, DeliveryProcess, UpdateColumns, chunk_columns,
                                       encode_columns, encode_frames, keep_freed_memory)
from gnnstream.stream.partitioning import partitions_for

__all__ = ["measure", "rounds", "main"]

logger = logging.getLogger(__name__)
FORMATS = ("json", "binary", "packed")


def measure(nodes: int, dim: int, partitions: int, repeat: int,
            formats: tuple[str, ...] = FORMATS) -> dict[str, dict[str, float]]:
    """``{format: {"cpu_us_per_update", "bytes_per_update", "messages"}}`` of one batch of ``nodes`` updates."""
    rng = np.random.default_rng(0)
    cols = UpdateColumns([str(i) for i in range(nodes)], rng.integers(1, 2**40, nodes),
                         rng.uniform(1.4e9, 1.5e9, nodes), time.time(), ["full"] * nodes,
                         rng.normal(size=(nodes, dim)).astype(np.float32), np.zeros(nodes, dtype=bool))
    runs = {"json": lambda: [v for _, v, _ in encode_columns([cols], "otc-sage:1", "json")],
            "binary": lambda: [v for _, v, _ in encode_columns([cols], "otc-sage:1", "binary")],
            "packed": lambda: [v for _, _, v in encode_frames([cols], "otc-sage:1",
                                                              partitions_for(cols.names, partitions),
                                                              MAX_MESSAGE_BYTES - 2048)]}
    out = {}
    for name in formats:
        run = runs[name]
        best = float("inf")
        for _ in range(repeat):
            t0 = time.process_time()
            values = run()
            best = min(best, time.process_time() - t0)
        out[name] = {"cpu_us_per_update": round(best / nodes * 1e6, 3),
                     "bytes_per_update": round(sum(map(len, values)) / nodes, 1), "messages": len(values)}
    return out


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_alone(bootstrap: str, topic: str, fmt: str, batches: list[list[UpdateColumns]], partitions: int,
                  headers: list[tuple[str, bytes]]) -> tuple[float, int]:
    """CPU seconds of this process, every thread, to send the messages of ``batches`` encoded beforehand and
    flush after each batch, and how many messages that was: sent as the delivery process sends them (its
    allocator settings, producer settings and headers, JSON and binary messages a chunk at a time), the first
    batch once more before, untimed."""
    from gnnstream.stream.backends import open_producer
    keep_freed_memory()
    producer = open_producer("confluent", bootstrap, max_in_flight=1)
    extra = [(WORKER_HEADER, b"w1"), *headers]
    room = producer.max_message_bytes - RECORD_OVERHEAD - sum(len(k.encode()) + len(v) for k, v in extra)
    cpu, sent = 0.0, 0
    try:
        for i, columns in enumerate([batches[0], *batches]):
            if fmt == "packed":
                parts = np.concatenate([partitions_for(c.names, partitions) for c in columns])
                frames = encode_frames(columns, "bench:1", parts, room)
                t = time.process_time()
                for partition, key, value in frames:
                    producer.send(topic, key, value, extra, partition=partition)
                count = len(frames)
            else:
                chunks = [encode_columns([cols], "bench:1", fmt) for cols in chunk_columns(columns, CHUNK)]
                t = time.process_time()
                count = sum(producer.send_many(topic, messages, extra) for messages in chunks)
            producer.flush(60.0)
            if i:
                cpu += time.process_time() - t
                sent += count
            time.sleep(0.02)
    finally:
        producer.close(5.0)
    return cpu, sent


def rounds(nodes: int, dim: int, partitions: int, count: int, size: int,
           formats: tuple[str, ...] = FORMATS) -> dict[str, dict[str, float]]:
    """``{format: {"cpu_ms_per_round", "cpu_us_per_update", "wall_ms_per_round", "messages_per_round",
    "client_alone_cpu_us_per_update", "client_alone_messages_per_round"}}`` of ``count`` delivery rounds of
    ``size`` updates each (see the module's text), for each of ``formats``."""
    from gnnstream.stream.broker import EmbeddedBroker
    from gnnstream.stream.kafka import ensure_topics
    from gnnstream.stream.rollout import stamp_headers
    rng = np.random.default_rng(0)
    names = [str(i) for i in range(nodes)]

    def columns(iids: np.ndarray) -> UpdateColumns:
        n = len(iids)
        return UpdateColumns([names[i] for i in iids.tolist()], rng.integers(1, 2**40, n),
                             rng.uniform(1.7e9, 1.8e9, n), time.time(), ["full"] * n,
                             rng.normal(size=(n, dim)).astype(np.float32), np.zeros(n, dtype=bool), iids)

    every = [columns(np.arange(start, min(start + 50_000, nodes))) for start in range(0, nodes, 50_000)]
    batches = [[columns(np.sort(rng.choice(nodes, size, replace=False)))] for _ in range(count)]
    headers = stamp_headers("bench:1", 0)
    out = {}
    with EmbeddedBroker() as broker:
        for fmt in formats:
            topic = f"bench-codecs-{fmt}"
            ensure_topics(broker.bootstrap, {topic: partitions})
            delivery = DeliveryProcess("confluent", broker.bootstrap, topic, "bench:1", fmt, worker="w1")
            try:
                delivery.deliver(every, 60.0, headers)
                assert delivery.pid is not None
                cpu0, wall, t0, messages = _cpu_s(delivery.pid), 0.0, time.perf_counter(), 0
                for columns_ in batches:
                    start = time.perf_counter()
                    messages += delivery.deliver(columns_, 60.0, headers)
                    wall += time.perf_counter() - start
                    time.sleep(0.02)
                cpu = _cpu_s(delivery.pid) - cpu0
            finally:
                delivery.close()
            alone, sent = _client_alone(broker.bootstrap, topic, fmt, batches, partitions, headers)
            out[fmt] = {"cpu_ms_per_round": round(cpu / count * 1e3, 3),
                        "cpu_us_per_update": round(cpu / (count * size) * 1e6, 3),
                        "wall_ms_per_round": round(wall / count * 1e3, 2),
                        "messages_per_round": round(messages / count, 2),
                        "client_alone_cpu_us_per_update": round(alone / (count * size) * 1e6, 3),
                        "client_alone_messages_per_round": round(sent / count, 2)}
            log(f"{fmt}: {out[fmt]} ({time.perf_counter() - t0:.1f} s)")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=50_000, help="nodes, ids 0 .. N-1 (all of them encoded once)")
    parser.add_argument("--dim", type=int, default=32, help="values per embedding")
    parser.add_argument("--partitions", type=int, default=4, help="partitions of the output topic")
    parser.add_argument("--repeat", type=int, default=5, help="encoding passes, the best reported")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated output formats to measure")
    parser.add_argument("--rounds", type=int, default=0,
                        help="measure this many delivery rounds per format on an embedded broker instead")
    parser.add_argument("--round-updates", type=int, default=3000, help="updates a delivery round (with --rounds)")
    args = parser.parse_args(argv)
    formats = tuple(args.formats.split(","))
    if not formats or not set(formats) <= set(FORMATS):
        parser.error(f"--formats must name some of {', '.join(FORMATS)} (got {args.formats!r})")
    if args.rounds > 0 and not 0 < args.round_updates <= args.nodes:
        parser.error(f"--round-updates must be in 1..--nodes ({args.nodes}) (got {args.round_updates})")
    result = {"nodes": args.nodes, "dim": args.dim, "partitions": args.partitions, "load": machine_load()}
    if args.rounds > 0:
        result.update(rounds=args.rounds, round_updates=args.round_updates,
                      delivery=rounds(args.nodes, args.dim, args.partitions, args.rounds, args.round_updates,
                                      formats))
    else:
        result["formats"] = measure(args.nodes, args.dim, args.partitions, args.repeat, formats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
