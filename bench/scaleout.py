"""Scale-out benchmark: one group of 1, 2 and 3 workers on the synthetic power-law graph.

The engine bench's seeded graph (2^17 nodes, 1.2 M directed edges, SAGE
128-d, fanouts 25,10) is loaded and backfilled once; each worker of each run
starts from a copy of that state, as ``gnnstream run`` in a process of its
own, with its own health port. For each group size W, on a fresh embedded
broker:

1. the W workers start on an empty events topic and the bench waits until
   the group has shared out the ``--partitions`` output partitions (each
   worker takes its share over: computes and publishes its nodes once);
2. ``--warmup-events`` events are produced and applied by every worker (not
   measured: a state just opened reads its caches in first);
3. ``--events`` events (90 % edge upserts, 5 % deletes, 5 % feature updates)
   are produced as a backlog; each worker's rate is those events over the
   time from the produce to the moment its stored position reached their
   end.

Per worker it reports events/s, final-layer rows computed and embeddings
published in the measured stretch (about 1/W of the group's each), the
seconds of each phase from the worker's ``/healthz`` (``apply`` and
``layers``: replicated in every worker; ``final``: the last layer, sharded;
``write``: the batch's WriteBatch), and the CPU seconds of its processes
(the worker and its delivery process, from ``/proc``). docs/scaling.md turns
these into the cost model.

Prints ONE JSON object on stdout; progress goes to stderr.

    .venv/bin/python -m bench.scaleout --store-cache /tmp/e2e-cache
    .venv/bin/python -m bench.scaleout --nodes 4096 --edges 30000 --events 2000 --warmup-events 500  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np


import bench.engine as engine_bench
from bench.common import FEATURE_DIM, FULL_EDGES, FULL_NODES, code_fingerprint, emit, log, machine_load
from bench.e2e_matrix import base_state, clone_state
from bench.kafka_run import produce
from gnnstream.stream.backends import KAFKA_CLIENTS
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.events import encode_event, event_key
from gnnstream.stream.kafka import ensure_topics
from gnnstream.workers.settings import WorkerSettings

_WAIT_S = 900.0  # the longest any stage may take before the bench gives up


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2,3", help="comma-separated group sizes to run")
    p.add_argument("--events", type=int, default=30_000, help="measured events")
    p.add_argument("--warmup-events", type=int, default=5_000, help="events applied before the measured ones")
    add_worker_args(p, partitions=6)
    return p.parse_args(argv)


def add_worker_args(p: argparse.ArgumentParser, *, partitions: int) -> None:
    """The graph, topic and worker options of the benchmarks that run ``gnnstream run`` processes (:class:`Member`)."""
    p.add_argument("--nodes", type=int, default=FULL_NODES, help="synthetic graph nodes")
    p.add_argument("--edges", type=int, default=FULL_EDGES, help="synthetic graph distinct directed edges")
    p.add_argument("--fanouts", type=lambda t: [int(x) for x in t.split(",")], default=[25, 10])
    p.add_argument("--partitions", type=int, default=partitions, help="partitions of the events and output topics")
    p.add_argument("--batch-size", type=int, default=1000, help="worker --batch-size")
    p.add_argument("--max-batch-size", type=int, default=10_000, help="worker --max-batch-size")
    p.add_argument("--kafka-client", default=WorkerSettings.kafka_client, choices=list(KAFKA_CLIENTS))
    p.add_argument("--output-format", default=WorkerSettings.output_format, choices=["json", "binary"])
    p.add_argument("--store-cache", default=None,
                   help="directory keeping a loaded copy of the synthetic graph store between runs")
    p.add_argument("--workdir", default=None, help="directory for the temporary states (default: system temp)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())
    except (OSError, ValueError):
        return {}


def _cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of a worker process and of its delivery process (its child running stream.delivery)."""
    hz = os.sysconf("SC_CLK_TCK")

    def ticks(p: int) -> float:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / hz

    out = {"worker": ticks(pid), "delivery": 0.0}
    for child in Path("/proc").iterdir():
        if not child.name.isdigit():
            continue
        try:
            stat = (child / "stat").read_text()
            cmd = (child / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"gnnstream.stream.delivery" in cmd:
            out["delivery"] += ticks(int(child.name))
    return out


class Member:
    """One ``gnnstream run`` process of the group."""

    def __init__(self, name: str, state: Path, model: str, bootstrap: str, topics: dict[str, str],
                 group: str, args: argparse.Namespace, logs: Path):
        self.name, self.port = name, _free_port()
        script = Path(sys.executable).with_name("gnnstream")
        base = [str(script)] if script.is_file() else [sys.executable, "-m", "gnnstream.workers.cli"]
        cmd = base + ["-v", "run", "--bootstrap", bootstrap, "--state", str(state), "--model", model,
                      "--events-topic", topics["events"], "--output-topic", topics["output"],
                      "--dlq-topic", topics["dlq"], "--group", group, "--worker-id", name,
                      "--partitions", str(args.partitions), "--metrics-port", str(self.port),
                      "--batch-size", str(args.batch_size), "--max-batch-size", str(args.max_batch_size),
                      "--kafka-client", args.kafka_client, "--output-format", args.output_format]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GNNSTREAM_")}
        env["GNNSTREAM_NO_PROGRESS"] = "1"
        self.log = logs / f"{name}.log"
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh, env=env)

    def health(self) -> dict[str, Any]:
        if self.proc.poll() is not None:
            raise SystemExit(f"worker {self.name} exited with {self.proc.returncode}:\n"
                             f"{self.log.read_text()[-3000:]}")
        return _health(self.port)

    def snapshot(self) -> dict[str, Any]:
        h = self.health()
        return {"t": time.time(), "position": h.get("position", 0), "published": h.get("published", 0),
                "changed": list(h.get("changed", [])),
                "final_recomputed": h.get("final_recomputed", 0), "seconds": dict(h.get("seconds", {})),
                "cpu": _cpu_seconds(self.proc.pid), "owned": h.get("owned_partitions", [])}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wait(cond: Any, what: str) -> Any:
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise SystemExit(f"timed out after {_WAIT_S:g} s waiting for {what}")


def _diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    seconds = {k: round(b["seconds"].get(k, 0.0) - a["seconds"].get(k, 0.0), 3)
               for k in sorted(set(a["seconds"]) | set(b["seconds"]))}
    cpu = {k: round(b["cpu"][k] - a["cpu"][k], 2) for k in b["cpu"]}
    changed = [y - x for x, y in zip(a["changed"] or [0] * len(b["changed"]), b["changed"])]
    return {"published": b["published"] - a["published"], "changed_per_layer": changed,
            "final_recomputed": b["final_recomputed"] - a["final_recomputed"], "seconds": seconds, "cpu_s": cpu}


def cost_model(one: dict[str, Any], dim: int) -> dict[str, Any]:
    """The lone worker's costs per event, split into replicated and sharded work, and what W workers on W
    machines would do with them (docs/scaling.md).

    Replicated (every worker): apply, the layers below the last, the write.
    Sharded (1/W each): the final layer, and the delivery process's CPU.
    """
    w = one["per_worker"][0]
    n = one["measured_events"]
    sec = w["seconds"]
    us = {"apply": sec.get("apply", 0.0), "layers": sec.get("layers", 0.0), "write": sec.get("write", 0.0),
          "final": sec.get("final", 0.0), "delivery": w["cpu_s"]["delivery"]}
    us = {k: round(v / n * 1e6, 1) for k, v in us.items()}
    r = us["apply"] + us["layers"] + us["write"]
    s = us["final"] + us["delivery"]
    changed = [round(c / n, 2) for c in w["changed_per_layer"]]
    row_bytes = 4 * dim + 16  # a float32 row and a key
    return {"us_per_event": us, "replicated_us": round(r, 1), "sharded_us": round(s, 1),
            "speedup": {str(k): round((r + s) / (r + s / k), 2) for k in (2, 4, 8, 16, 32, 64)},
            "ceiling": round((r + s) / r, 2), "changed_rows_per_event_by_layer": changed,
            "intermediate_row_bytes": row_bytes,
            "intermediate_bytes_per_event_per_remote_owner": round(sum(changed[:-1]) * row_bytes)}


def run_group(size: int, base: Path, model: str, messages: list[tuple[bytes, bytes]], warm: int,
              args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One group of ``size`` workers: form it, warm it up, then time the measured events."""
    tag = uuid.uuid4().hex[:8]
    topics = {"events": f"scale-ev-{tag}", "output": f"scale-emb-{tag}", "dlq": f"scale-dlq-{tag}"}
    members: list[Member] = []
    with EmbeddedBroker() as broker:  # a fresh broker each: it keeps every message in memory
        ensure_topics(broker.bootstrap, {topics["events"]: args.partitions, topics["output"]: args.partitions,
                                         topics["dlq"]: 1})
        try:
            for i in range(size):
                state = work / f"w{size}-{i + 1}"
                clone_state(base, state)
                members.append(Member(f"w{i + 1}", state, model, broker.bootstrap, topics, f"scale-{tag}",
                                       args, work))
            t0 = time.time()

            def formed() -> bool:
                owned = [m.health().get("owned_partitions") or [] for m in members]
                flat = [p for o in owned for p in o]
                return all(owned) and sorted(flat) == list(range(args.partitions))
            _wait(formed, f"{size} workers to share the output partitions")
            formation_s = time.time() - t0
            log(f"{size} workers: group formed in {formation_s:.1f} s")
            produce(broker.bootstrap, topics["events"], messages[:warm])
            _wait(lambda: all(m.health().get("position", 0) >= warm for m in members), "the warm-up events")
            seen: list[int] = []

            def delivered() -> bool:  # the takeovers' and the warm-up's embeddings are out: published holds still
                seen.append(sum(m.health().get("published", 0) for m in members))
                time.sleep(0.9)
                return len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]
            _wait(delivered, "the warm-up's embeddings to be delivered")
            before = [m.snapshot() for m in members]
            t1 = time.time()
            produce(broker.bootstrap, topics["events"], messages[warm:])
            total = len(messages)
            done: dict[str, dict[str, Any]] = {}

            def finished() -> bool:
                for m in members:
                    if m.name not in done and m.health().get("position", 0) >= total:
                        done[m.name] = m.snapshot()
                return len(done) == len(members)
            _wait(finished, "every worker to apply the measured events")
            measured = total - warm
            rows = []
            for m, b in zip(members, before):
                after = done[m.name]
                seconds = after["t"] - t1
                row = {"worker": m.name, "owned_partitions": after["owned"],
                       "events_per_s": round(measured / seconds, 1), "seconds": round(seconds, 2), **_diff(b, after)}
                rows.append(row)
                log(f"  {row}")
            slowest = max(d["t"] for d in done.values()) - t1
            return {"workers": size, "formation_s": round(formation_s, 1), "measured_events": measured,
                    "group_events_per_s": round(measured / slowest, 1),
                    "published": sum(r["published"] for r in rows),
                    "final_recomputed": sum(r["final_recomputed"] for r in rows), "per_worker": rows}
        finally:
            for m in members:
                m.stop()
            for i in range(size):
                shutil.rmtree(work / f"w{size}-{i + 1}", ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [int(x) for x in args.workers.split(",") if x]
    work = Path(tempfile.mkdtemp(prefix="gnnstream-scaleout-", dir=args.workdir))
    result: dict[str, Any] = {"bench": "scaleout", "code": code_fingerprint(), "cpu_count": os.cpu_count(),
                              "machine_load_at_start": machine_load()}
    try:
        graph, model, base = base_state(args, work, result)
        events, counts = engine_bench.stream_events(graph, args.warmup_events + args.events,
                                                    np.random.default_rng(1), 0.90, 0.05, 1_750_000_000,
                                                    args.batch_size)
        messages = [(event_key(ev), encode_event(ev)) for ev in events]
        result["config"] = {"model": {"arch": "sage", "fanouts": args.fanouts}, "event_counts": counts,
                            "partitions": args.partitions, "kafka_client": args.kafka_client,
                            "output_format": args.output_format, "batch_size": args.batch_size,
                            "max_batch_size": args.max_batch_size, "warmup_events": args.warmup_events,
                            "measured_events": args.events}
        runs = []
        for size in sizes:
            log(f"group of {size}")
            runs.append(run_group(size, base, model, messages, args.warmup_events, args, work))
        result["runs"] = runs
        one = next((r for r in runs if r["workers"] == 1), None)
        if one is not None:
            result["cost_model"] = cost_model(one, FEATURE_DIM)
            for r in runs:
                for key in ("final_recomputed", "published"):
                    r[f"{key}_share_per_worker"] = [round(w[key] / max(one[key], 1), 3) for w in r["per_worker"]]
    finally:
        result["machine_load_at_end"] = machine_load()
        if not os.environ.get("SCALEOUT_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
