"""Rollout benchmark: the serving version's freshness while a new version is prepared and then runs beside it.

The engine bench's seeded graph (2^17 nodes, 1.2 M directed edges, SAGE
128-d, fanouts 25,10) is loaded and backfilled once as v1's state. On an
embedded broker, a v1 worker (``gnnstream run``, its own process) consumes a
paced stream of events (90 % edge upserts, 5 % deletes, 5 % feature
updates), each stamped with the wall-clock time it was produced as its event
time; so an update's freshness, its Kafka timestamp (publish time) minus its
``event_ts``, is how late the newest event behind it reaches the output
topic. Three stretches of the same run, at the same rate, side by side:

1. ``alone``: v1 alone, ``--seconds`` long;
2. ``backfill``: ``gnnstream rollout start`` copies v1's live state and
   computes v2 (other weights) on the copy, as long as that takes;
3. ``both``: a v2 worker on the copy catches up (not measured), then both
   publish for ``--seconds``; v2's freshness is reported too.

Per stretch: v1's freshness p50/p99/max over every ``--sample``-th update,
and the cores each process used (CPU seconds over the stretch's seconds).
Prints ONE JSON object on stdout; progress goes to stderr.

    .venv/bin/python -m bench.rollout --store-cache /tmp/e2e-cache
    .venv/bin/python -m bench.rollout --nodes 4096 --edges 30000 --seconds 5 --rate 200   # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np


import bench.engine as engine_bench
from bench.common import code_fingerprint, emit, log, machine_load
from bench.e2e_matrix import base_state
from bench.scaleout import Member, _wait, add_worker_args
from gnnstream.stream.backends import open_consumer, open_producer
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.events import encode_event, event_key
from gnnstream.stream.kafka import ensure_topics
from gnnstream.stream.rollout import version_topic
from gnnstream.stream.updates import decode_update


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=500.0, help="events per second of the stream")
    p.add_argument("--seconds", type=float, default=30.0, help="length of the alone and both stretches")
    p.add_argument("--sample", type=int, default=10, help="measure the freshness of every N-th update (by offset)")
    add_worker_args(p, partitions=4)
    return p.parse_args(argv)


class Stream(threading.Thread):
    """Produces ``events`` at ``rate``, each stamped with the time it is sent as its event time."""

    def __init__(self, bootstrap: str, topic: str, events: list, rate: float, client: str):
        super().__init__(daemon=True)
        self.producer = open_producer(client, bootstrap)
        self.topic, self.events, self.rate = topic, events, rate
        self.sent = 0
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        step = max(1, int(self.rate / 20))  # 20 sends a second
        while not self.stop.is_set() and self.sent < len(self.events):
            now = time.time()
            for ev in self.events[self.sent:self.sent + step]:
                ev = dataclasses.replace(ev, ts=now)
                self.producer.send(self.topic, event_key(ev), encode_event(ev))
            self.producer.flush(30)
            self.sent += step
            pause = t0 + self.sent / self.rate - time.monotonic()
            if pause > 0:
                self.stop.wait(pause)
        if self.sent >= len(self.events):
            log("the stream ran out of events: raise the graph size or lower --rate/--seconds")

    def close(self) -> None:
        self.stop.set()
        self.join(10)
        self.producer.close()


class Freshness(threading.Thread):
    """Reads an output topic from its start: ``(publish time, publish time - event_ts)`` of every ``every``-th
    update (by offset: decoding them all would cost the bench a good share of a core)."""

    def __init__(self, bootstrap: str, topic: str, client: str, every: int):
        super().__init__(daemon=True)
        self.every = every
        self.consumer = open_consumer(client, bootstrap, topic, f"bench-{uuid.uuid4().hex[:8]}", assign_all=True)
        self.points: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for r in self.consumer.poll_batch(20_000, 0.2):
                if r.value is not None and r.offset % self.every == 0:
                    at = r.timestamp_ms / 1000
                    self.points.append((at, at - decode_update(r.value).event_ts))

    def stretch(self, t0: float, t1: float, since: float) -> dict[str, Any]:
        """The updates published in ``[t0, t1)`` of events produced after ``since`` (the stream's start)."""
        lat = np.asarray([lag for at, lag in list(self.points) if t0 <= at < t1 and at - lag >= since])
        if not len(lat):
            return {"sampled_updates": 0}
        return {"sampled_updates": int(len(lat)), "p50_s": round(float(np.percentile(lat, 50)), 3),
                "p99_s": round(float(np.percentile(lat, 99)), 3), "max_s": round(float(lat.max()), 3)}

    def close(self) -> None:
        self.stop.set()
        self.join(10)
        self.consumer.close()


def _cpu() -> dict[str, float]:
    """CPU seconds so far of every process on the machine that belongs to this bench (by command line)."""
    hz = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for child in Path("/proc").iterdir():
        if not child.name.isdigit():
            continue
        try:
            cmd = (child / "cmdline").read_bytes().replace(b"\0", b" ")
            fields = (child / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = ("v1-worker" if b"--worker-id v1" in cmd else "v2-worker" if b"--worker-id v2" in cmd
                else "delivery" if b"gnnstream.stream.delivery" in cmd else "rollout-start" if b"rollout start" in cmd
                else "broker" if b"tansu" in cmd else "bench" if int(child.name) == os.getpid() else None)
        if name:
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / hz
    return out


def _spent(a: dict[str, float], b: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores used per process group between two :func:`_cpu` readings ``seconds`` apart."""
    return {k: round((b.get(k, 0.0) - a.get(k, 0.0)) / seconds, 2) for k in sorted(set(a) | set(b))}


def second_version(model: str, path: Path) -> str:
    """v2 of the bench model: the same config and sampling seed, other weights."""
    import torch

    from gnnstream.model.directory import load_model_dir, save_model_dir
    loaded = load_model_dir(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        state = {k: torch.randn_like(v) * v.std() if v.is_floating_point() and v.numel() > 1 else v
                 for k, v in loaded.model.state_dict().items()}
    save_model_dir(path, dataclasses.replace(loaded.config, version=loaded.config.version + 1,
                                             weights_sha256=None), state)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gnnstream-rollout-", dir=args.workdir))
    result: dict[str, Any] = {"bench": "rollout", "code": code_fingerprint(), "cpu_count": os.cpu_count(),
                              "machine_load_at_start": machine_load(), "rate": args.rate}
    members: list[Member] = []
    try:
        graph, v1, base = base_state(args, work, result)
        v2 = second_version(v1, work / "model-v2")
        need = int(args.rate * (3 * args.seconds + 240))  # warm-up, alone, both, and backfill and catch-up
        events, counts = engine_bench.stream_events(graph, need, np.random.default_rng(1), 0.90, 0.05,
                                                    1_750_000_000, args.batch_size)
        result["config"] = {"event_counts": counts, "partitions": args.partitions, "kafka_client": args.kafka_client,
                            "output_format": args.output_format, "seconds": args.seconds}
        tag = uuid.uuid4().hex[:8]
        with EmbeddedBroker() as broker:
            topics = {"events": f"roll-ev-{tag}", "dlq": f"roll-dlq-{tag}"}
            out1, out2 = version_topic("model:1"), version_topic("model:2")
            ensure_topics(broker.bootstrap, {topics["events"]: args.partitions, out1: args.partitions,
                                             out2: args.partitions, topics["dlq"]: 1})
            members.append(Member("v1", base, v1, broker.bootstrap, {**topics, "output": out1}, f"roll-{tag}",
                                  args, work))
            _wait(lambda: members[0].health().get("owned_partitions"), "v1 to own its partitions")
            fresh1 = Freshness(broker.bootstrap, out1, args.kafka_client, args.sample)
            fresh1.start()
            stream = Stream(broker.bootstrap, topics["events"], events, args.rate, args.kafka_client)
            start = time.time()
            stream.start()
            time.sleep(min(10.0, args.seconds))  # v1 reads its caches in: not measured
            stretches: dict[str, Any] = {}

            t0, c0 = time.time(), _cpu()
            time.sleep(args.seconds)
            t1, c1 = time.time(), _cpu()
            stretches["alone"] = {"seconds": round(t1 - t0, 1), "v1": fresh1.stretch(t0, t1, start),
                                  "cores": _spent(c0, c1, t1 - t0)}
            log(f"alone: {stretches['alone']}")

            cmd = [str(Path(sys.executable).with_name("gnnstream")), "rollout", "start", "--from", str(base),
                   "--state", str(work / "v2"), "--model", v2, "--bootstrap", broker.bootstrap]
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("GNNSTREAM_")},
                   "GNNSTREAM_NO_PROGRESS": "1"}
            t0, c0, r0 = time.time(), _cpu(), resource.getrusage(resource.RUSAGE_CHILDREN)
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            t1, c1, r1 = time.time(), _cpu(), resource.getrusage(resource.RUSAGE_CHILDREN)
            if done.returncode:
                raise SystemExit(f"rollout start failed:\n{done.stderr[-3000:]}")
            # the command has exited: its CPU time is the children's (the workers still run)
            c1["rollout-start"] = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
            stretches["backfill"] = {"seconds": round(t1 - t0, 1), "v1": fresh1.stretch(t0, t1, start),
                                     "rollout_start": json.loads(done.stdout), "cores": _spent(c0, c1, t1 - t0)}
            log(f"backfill: {stretches['backfill']}")

            fresh2 = Freshness(broker.bootstrap, out2, args.kafka_client, args.sample)
            fresh2.start()
            members.append(Member("v2", work / "v2", v2, broker.bootstrap, {**topics, "output": out2},
                                  f"roll-{tag}", args, work))
            t2 = time.time()
            lead = 2 * args.rate  # within two seconds of events of v1
            _wait(lambda: members[1].health().get("position", 0) >= members[0].health().get("position", 1) - lead,
                  "v2 to catch up")
            caught = time.time()
            t0, c0 = time.time(), _cpu()
            time.sleep(args.seconds)
            t1, c1 = time.time(), _cpu()
            stretches["both"] = {"seconds": round(t1 - t0, 1), "v2_catch_up_s": round(caught - t2, 1),
                                 "v1": fresh1.stretch(t0, t1, start), "v2": fresh2.stretch(t0, t1, caught),
                                 "cores": _spent(c0, c1, t1 - t0)}
            log(f"both: {stretches['both']}")
            result["stretches"] = stretches
            result["events_sent"] = stream.sent
            stream.close()
            fresh1.close()
            fresh2.close()
    finally:
        for m in members:
            m.stop()
        result["machine_load_at_end"] = machine_load()
        if not os.environ.get("ROLLOUT_KEEP"):
            import shutil
            shutil.rmtree(work, ignore_errors=True)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
