"""Query API benchmark: lookups and what-if requests while the worker streams.

The synthetic delivery graph of ``bench/e2e.py --graph synthetic`` (2^17
nodes, 1.2 M edges, SAGE 128-d, fanouts 25,10), loaded and backfilled
once (``--store-cache`` keeps the loaded store between runs). Then:

1. the worker's sustained rate, default configuration, from a backlog of
   ``--warmup-events`` + ``--stream-events`` on a copy of the state, and the
   CPU per event each process spent;
2. the worker streams on another copy, with ``--query-port`` set (its query
   process beside it), paced to a budget of ``--stream-cores`` (default: all
   cores but one): the cores that the worker, its delivery process and the
   broker use together (the event producer and the query server are not
   counted). It starts at half of what the budget buys at the sustained
   run's CPU per event (a paced stream costs more per event: smaller
   batches); every 2 s of the first half of ``--fresh-warmup-s`` the rate is
   scaled by budget / cores measured over those 2 s (``/proc``), never up
   while the worker is a second or more behind; the last half of the
   warm-up runs at the rate reached and is measured as "stream alone".
   ``--rate`` streams at a fixed rate instead (and skips the sustained run).
   After the warm-up, a load generator in a process of its own sends
     * ``GET /v1/embeddings/{id}`` at ``--lookup-rps`` (2,000) for
       ``--seconds`` (20), ids drawn uniformly;
     * ``POST /v1/infer`` with one new edge between two random nodes, both
       asked for, at ``--infer-rps`` (200) for ``--seconds``;
   open loop: request ``i`` is due at ``i / rps``, and its latency runs from
   when it was due to when its answer was read, so a slow server is charged
   for the requests that waited behind it. At most ``--connections`` are
   open; the run is bounded by the number of requests, not by time.

``--typed`` serves a typed model instead: the seeded payment stream of
``gnnstream.fraud.payments`` (``--accounts``, ``--days``; accounts,
merchants, devices), its first half a typed GraphSAGE with a transaction
head is trained on (``train_typed_model``, ``--train-epochs``) and loaded
into the state (``graph load`` + ``backfill``), its second half the stream
(the sustained run and the paced one each from its start). Where the stream
needs more events than the second half holds, it goes on with the second
half again as a fresh cohort: its accounts and devices renamed (``a7-c1``),
each created with its features before it is first named, paying the same
merchants, and so on. The one load is
``POST /v1/score`` at ``--score-rps`` (200) for ``--seconds``: a payment that
has not landed (a new ``txn_id``) from an account to a merchant, both drawn
from the first half's payments, with the edge features of a third.

Reported: per kind p50, p99 and max latency, achieved requests/s, answers
that were not 200, and the query server's CPU per answered request
(``server_cpu_ms_per_request``: user + system time of the server process
from ``/proc`` over the kind's load, catch-ups with the stream included,
divided by the answers); the stream's publish - produce per batch and lag
while the load ran; the cores each process used (``/proc``): the stream
alone over the last half of its warm-up, then during each kind. Prints
ONE JSON object on stdout; progress on stderr.

    .venv/bin/python -m bench.query --store-cache /tmp/e2e-cache
    .venv/bin/python -m bench.query --typed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np


import bench.e2e_matrix as e2e_matrix
import bench.kafka_run as kafka_run
from bench.common import (
    CpuSampler, FULL_EDGES, FULL_NODES, code_fingerprint, emit, log, machine_load, peak_rss_mib, percentile,
)
from gnnstream.stream.broker import EmbeddedBroker, free_port
from gnnstream.stream.events import encode_event, event_key
from gnnstream.stream.kafka import ensure_topics
from gnnstream.workers.heap import tune_collector
from gnnstream.workers.query.server import run_ahead
from gnnstream.workers.settings import WorkerSettings

_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)
STREAM_ROLES = ("worker", "delivery process", "broker")  # the processes --stream-cores budgets


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=FULL_NODES, help="synthetic graph nodes")
    p.add_argument("--edges", type=int, default=FULL_EDGES, help="synthetic graph directed edges")
    p.add_argument("--store-cache", default=None, help="directory keeping the loaded store between runs")
    p.add_argument("--workdir", default=None, help="where the states go (default: the system temp dir)")
    p.add_argument("--warmup-events", type=int, default=20_000, help="events before the measured ones")
    p.add_argument("--stream-events", type=int, default=30_000, help="measured events of the sustained run")
    p.add_argument("--rate", type=float, default=0.0,
                   help="stream at this fixed rate (events/s) instead of pacing to --stream-cores (no sustained run)")
    p.add_argument("--stream-cores", type=float, default=max(1, (os.cpu_count() or 2) - 1),
                   help="pace the stream so that worker + delivery process + broker use about this many cores "
                        "(default: all cores but one)")
    p.add_argument("--lookup-rps", type=float, default=2000.0, help="lookup requests per second")
    p.add_argument("--infer-rps", type=float, default=200.0, help="what-if requests per second")
    p.add_argument("--score-rps", type=float, default=200.0, help="transaction scores per second (--typed)")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each kind's load")
    p.add_argument("--connections", type=int, default=32, help="most connections open at once")
    p.add_argument("--fresh-warmup-s", type=float, default=30.0,
                   help="seconds of stream before the load starts: its first half paces the stream to "
                        "--stream-cores, its last half is measured as the stream alone")
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--batch-wait-ms", type=int, default=200)
    p.add_argument("--max-batch-size", type=int, default=10_000)
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--typed", action="store_true",
                   help="a typed model on the payment stream, loaded with POST /v1/score (no lookups, no what-ifs)")
    p.add_argument("--accounts", type=int, default=5_000, help="the payment stream's accounts (--typed)")
    p.add_argument("--days", type=int, default=60, help="the payment stream's days (--typed)")
    p.add_argument("--train-epochs", type=int, default=30, help="training steps of the typed model (--typed)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- the load generator
async def _open_loop(port: int, requests: list[bytes], rps: float, connections: int) -> dict[str, Any]:
    """Send ``requests`` at ``rps`` over at most ``connections`` keep-alive connections."""
    queue: asyncio.Queue = asyncio.Queue()
    latencies: list[float] = []
    statuses: dict[int, int] = {}

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                due, request = item
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(_LENGTH.search(head).group(1)))
                latencies.append(time.perf_counter() - due)
                status = int(head[9:12])
                statuses[status] = statuses.get(status, 0) + 1
        finally:
            writer.close()

    workers = [asyncio.create_task(connection()) for _ in range(connections)]
    t0 = time.perf_counter() + 0.05
    i = 0
    while i < len(requests):  # every request due by now, then sleep until the next one (sleeps are coarse)
        now = time.perf_counter()
        while i < len(requests) and t0 + i / rps <= now:
            queue.put_nowait((t0 + i / rps, requests[i]))
            i += 1
        if i < len(requests):
            await asyncio.sleep(max(0.0, t0 + i / rps - time.perf_counter()))
    for _ in workers:
        queue.put_nowait(None)
    await asyncio.gather(*workers)
    seconds = time.perf_counter() - t0
    ms = [x * 1000 for x in latencies]
    return {"requests": len(requests), "answered": len(latencies), "target_rps": rps,
            "achieved_rps": round(len(latencies) / seconds, 1),
            "p50_ms": round(percentile(ms, 50), 3), "p99_ms": round(percentile(ms, 99), 3),
            "max_ms": round(max(ms), 3), "statuses": {str(k): v for k, v in sorted(statuses.items())}}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, every thread of it (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def query_server_pid() -> int:
    """The pid of the query server this process's worker started."""
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            continue
        if parent == me and b"gnnstream.workers.query.server" in cmd:
            return int(entry.name)
    raise SystemExit("the worker's query server process was not found")


def _load(port: int, server: int, kinds: list[tuple[str, list[bytes], float]], connections: int, out: Any) -> None:
    """Child process: each kind's requests in turn, open loop (at the query server's priority where allowed: a
    client starved of the CPU would time its own waits), and the CPU the ``server`` process spent meanwhile.
    Puts ``(kind, start, end)`` per kind, then the results."""
    os.setsid()  # a session of its own: where the kernel schedules by session, its priority counts against all
    run_ahead()
    result = {}
    for name, requests, rps in kinds:
        start, cpu = time.time(), cpu_seconds(server)
        result[name] = done = asyncio.run(_open_loop(port, requests, rps, connections))
        done["server_cpu_ms_per_request"] = round(1000 * (cpu_seconds(server) - cpu) / max(done["answered"], 1), 4)
        out.put((name, start, time.time()))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=30) as resp:
            health = json.loads(resp.read())
        result[name]["server"] = {k: health[k] for k in ("catch_up_ms", "rereads", "busy_s", "requests")}
    out.put(result)


def requests_for(names: list[str], args: argparse.Namespace, rng: np.random.Generator) -> list[tuple[str, list[bytes], float]]:
    """The lookup and what-if requests, as raw HTTP/1.1 bytes."""
    n_lookup, n_infer = int(args.lookup_rps * args.seconds), int(args.infer_rps * args.seconds)
    lookups = [f"GET /v1/embeddings/{names[i]} HTTP/1.1\r\nhost: bench\r\n\r\n".encode()
               for i in rng.integers(0, len(names), n_lookup)]
    infers, ts = [], _after_the_stream()
    for a, b in rng.integers(0, len(names), (n_infer, 2)):
        body = (b'{"events":[{"op":"edge_upsert","src":"%s","dst":"%s","ts":%d}],"ids":["%s","%s"]}'
                % (names[a].encode(), names[b].encode(), ts, names[a].encode(), names[b].encode()))
        infers.append(b"POST /v1/infer HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(body), body))
    return [("lookup", lookups, args.lookup_rps), ("what_if_one_edge", infers, args.infer_rps)]


def _after_the_stream() -> int:
    """An event time after every event the bench streams (it runs for minutes), within the day an event may run
    ahead of the clock (``stream.events.MAX_AHEAD_S``)."""
    return int(time.time()) + 6 * 3600


def score_requests(payments: list[dict[str, Any]], args: argparse.Namespace,
                   rng: np.random.Generator) -> list[tuple[str, list[bytes], float]]:
    """``POST /v1/score`` requests, as raw HTTP/1.1 bytes: payments that have not landed, each from the account
    of one of ``payments`` to the merchant of another, with the edge features of a third."""
    scores = []
    for i, (a, b, c) in enumerate(rng.integers(0, len(payments), (int(args.score_rps * args.seconds), 3))):
        event = {**payments[a], "dst": payments[b]["dst"], "features": payments[c]["features"],
                 "txn_id": f"bench-{i}", "ts": _after_the_stream()}
        body = json.dumps({"event": event}, separators=(",", ":")).encode()
        scores.append(b"POST /v1/score HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(body), body))
    return [("score", scores, args.score_rps)]


# each kind's targets: (name in targets, p99 ms, requests/s, server CPU ms per request or None)
TARGETS = {"lookup": ("lookup", 5.0, 2000, 0.1), "what_if_one_edge": ("what_if", 20.0, 200, 4.0),
           "score": ("score", 20.0, 200, None)}


def synthetic_workload(args: argparse.Namespace, work: Path, result: dict[str, Any]) -> tuple[str, Path, Any, list]:
    """The synthetic graph's model and backfilled state, its events (``events(n, seed)``) and the lookups and
    what-ifs."""
    import bench.engine as engine_bench
    args.fanouts = [25, 10]
    graph, model, base = e2e_matrix.base_state(args, work, result)

    def events(n: int, seed: int) -> list:
        return engine_bench.stream_events(graph, n, np.random.default_rng(seed), 0.90, 0.05, 1_750_000_000,
                                          args.batch_size)[0]

    names = [graph.name(i) for i in range(graph.num_nodes)]
    return model, base, events, requests_for(names, args, np.random.default_rng(3))


def payments_workload(args: argparse.Namespace, work: Path, result: dict[str, Any]) -> tuple[str, Path, Any, list]:
    """The payment stream's typed model, trained on its first half, and a state of that half, backfilled; the
    second half as events (``events(n, seed)``: its first ``n``, whatever the seed, then fresh cohorts of it) and
    the score requests."""
    from gnnstream.fraud.payments import SCHEMA, generate
    from gnnstream.stream.events import decode_event
    from gnnstream.workers.offline.jobs import backfill, load_events
    from gnnstream.workers.offline.typed_train import train_typed_model
    stream = generate(0, accounts=args.accounts, days=args.days)
    half = len(stream.events) // 2
    history, path = stream.events[:half], work / "history.jsonl"
    path.write_text("".join(json.dumps(ev, separators=(",", ":")) + "\n" for ev in history))
    model, base = str(work / "model"), work / "base"
    log(f"training a typed model on the first {half} of {len(stream.events)} payment events")
    trained = train_typed_model(path, {t: label for t, (label, _) in stream.labels.items()}, SCHEMA, model,
                                epochs=args.train_epochs, slices=1)
    log("loading and backfilling the base state")
    result["graph"] = {"payments": stream.summary(), "history_events": half,
                       "trained": {k: trained[k] for k in ("model", "train_nodes", "final_loss", "held_out_auc")}}
    result["setup"] = {"load": load_events(str(base), str(path), model_dir=model),
                       "backfill": backfill(str(base), model)}
    tail = stream.events[half:]
    # a cohort: the second half, each account and device of the first half created again (with its features)
    # before the cohort first names it
    features = {(ev["type"], ev["id"]): ev["features"] for ev in history if ev["op"] == "node_upsert"}
    cohort, named = [], set()
    for ev in tail:
        ends = [(ev["type"], ev["id"])] if ev["op"] == "node_upsert" else \
            [(ev["src_type"], ev["src"]), (ev["dst_type"], ev["dst"])]
        for end in ends:
            if end[0] != "merchant" and end not in named:
                named.add(end)
                if end in features and ev["op"] != "node_upsert":
                    cohort.append({"op": "node_upsert", "type": end[0], "id": end[1], "ts": ev["ts"],
                                   "features": features[end]})
        cohort.append(ev)

    def renamed(ev: dict[str, Any], suffix: str) -> dict[str, Any]:
        ev = dict(ev)
        if ev["op"] == "node_upsert":
            if ev["type"] != "merchant":
                ev["id"] += suffix
        else:
            ev["src"] += suffix  # every relation runs from an account
            if ev["dst_type"] != "merchant":
                ev["dst"] += suffix
            if "txn_id" in ev:
                ev["txn_id"] += suffix
        return ev

    def events(n: int, seed: int) -> list:
        out = [decode_event(ev, typed=True) for ev in tail[:n]]
        lap = 0
        while len(out) < n:
            lap += 1
            out += [decode_event(renamed(ev, f"-c{lap}"), typed=True) for ev in cohort[:n - len(out)]]
        return out

    payments = [ev for ev in history if ev.get("txn_id")]
    return model, base, events, score_requests(payments, args, np.random.default_rng(3))


# ---------------------------------------------------------------------- the run
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ.setdefault("GNNSTREAM_NO_PROGRESS", "1")
    tune_collector()
    work = Path(tempfile.mkdtemp(prefix="gnnstream-query-", dir=args.workdir))
    result: dict[str, Any] = {"bench": "query", "mode": "typed" if args.typed else "synthetic",
                              "code": code_fingerprint(), "machine_load_at_start": machine_load()}
    default = (WorkerSettings.kafka_client, WorkerSettings.output_format)
    try:
        model, base, stream_events, kinds = (payments_workload if args.typed else synthetic_workload)(args, work,
                                                                                                     result)
        # each kind's load, with room for a load that falls behind its schedule, then some stream after them
        fresh_seconds = args.seconds * 2.5 * len(kinds) + 10
        warm = args.warmup_events
        rate = cap = args.rate
        if not rate:
            events = stream_events(warm + args.stream_events, 1)
            state = work / "state-sustained"
            e2e_matrix.clone_state(base, state)
            with EmbeddedBroker() as broker:
                topic = f"bench-ev-{uuid.uuid4().hex[:8]}"
                ensure_topics(broker.bootstrap, {topic: args.partitions})
                kafka_run.produce(broker.bootstrap, topic, [(event_key(ev), encode_event(ev)) for ev in events])
                log(f"sustained rate: {default}")
                run = kafka_run.sustained(broker.bootstrap, topic, len(events), model, str(state), args, *default, warm)
            shutil.rmtree(state, ignore_errors=True)
            result["sustained"] = run
            per_event = run["after_warmup"].get("cpu_us_per_event", {})
            if not all(role in per_event for role in STREAM_ROLES):
                raise SystemExit(f"the sustained run measured no CPU per event of {STREAM_ROLES}: {per_event}")
            # what the budget buys at the backlog's CPU per event: more than a paced stream can have
            cap = args.stream_cores / (sum(per_event[role] for role in STREAM_ROLES) / 1e6)
            rate = cap / 2
        result["config"] = {"stream_cores_budget": None if args.rate else args.stream_cores,
                            "rps": {name: rps for name, _, rps in kinds}, "seconds_each": args.seconds,
                            "connections": args.connections,
                            "default_configuration": {"kafka_client": default[0], "output_format": default[1]}}
        # events enough for the fastest stream the pacing may reach (the producer stops once the load is done)
        fresh_events = stream_events(warm + int(cap * (fresh_seconds + args.fresh_warmup_s)), 2)
        port = free_port()
        ctx = mp.get_context("spawn")

        windows: dict[str, tuple[float, float]] = {}

        paced = {"start": 0.0, "last": 0.0}  # when the paced stream started, when its rate was last set

        def pace(now_rate: float, lag: int) -> float:
            """Every 2 s of the warm-up's first half: the rate scaled by budget / the stream's cores (never up
            while the worker is a second or more behind: a stream short of CPU uses fewer cores than it needs)."""
            now = time.time()
            if not paced["start"]:
                paced["start"] = paced["last"] = now
            if now - paced["last"] < 2.0 or now - paced["start"] > args.fresh_warmup_s / 2:
                return now_rate
            used = sum(sampler.cores(paced["last"], now).get(role, 0.0) for role in STREAM_ROLES)
            paced["last"] = now
            if not used:
                return now_rate
            scale = min(1.0 if lag > now_rate else 1.5, max(0.67, args.stream_cores / used))
            new = min(cap, now_rate * scale)
            log(f"pacing: the stream used {used:.2f} cores at {now_rate:.0f} events/s, {lag} events behind; "
                f"now {new:.0f} events/s")
            return new

        def load() -> dict[str, Any]:
            out = ctx.Queue()
            child = ctx.Process(target=_load, args=(port, query_server_pid(), kinds, args.connections, out))
            windows["stream alone"] = (time.time() - args.fresh_warmup_s / 2, time.time())
            child.start()
            sampler.roles[child.pid] = "load generator"
            while True:
                got = out.get(timeout=args.seconds * 2 + 600)
                if isinstance(got, dict):
                    break
                windows[got[0]] = got[1:]
            child.join(30)
            return got

        state = work / "state-fresh"
        e2e_matrix.clone_state(base, state)
        log(f"stream at {rate:.0f} events/s{'' if args.rate else f', paced to {args.stream_cores:g} cores'} with "
            f"the query API on port {port}; load after {args.fresh_warmup_s:g} s")
        with EmbeddedBroker() as broker, CpuSampler() as sampler:
            fresh = e2e_matrix.paced_freshness(broker.bootstrap, fresh_events[:warm], fresh_events[warm:], rate, model,
                                               str(state), *default, args, query_port=port, alongside=load,
                                               pace=None if args.rate else pace)
        result["config"]["stream_rate"] = fresh["target_rate"]
        # cores used by each process of the run: the stream alone (the last half of its warm-up), then each load
        result["cpu_cores"] = {name: sampler.cores(*window) for name, window in windows.items()}
        alone = result["cpu_cores"]["stream alone"]
        stream_cores = round(sum(alone.get(role, 0.0) for role in STREAM_ROLES), 3)
        served = fresh.pop("alongside")
        window = fresh.pop("alongside_window")
        fresh["lag"].pop("samples", None)
        result["stream"] = fresh
        result["stream_while_serving"] = window
        result["targets"] = targets = {}
        for name, _, _ in kinds:
            got = result[name] = served[name]
            key, p99, rps, cpu = TARGETS[name]
            targets.update({f"{key}_p99_ms": got["p99_ms"], f"{key}_p99_le_{p99:g}ms": got["p99_ms"] <= p99,
                            f"{key}_rps_ge_{rps}": got["achieved_rps"] >= rps * 0.99,
                            f"{key}_cpu_ms": got["server_cpu_ms_per_request"]})
            if cpu is not None:
                targets[f"{key}_cpu_le_{cpu:g}ms"] = got["server_cpu_ms_per_request"] <= cpu
        targets.update({
            # worker + delivery process + broker over the stream alone: about one core free up to cpus - 0.9
            "stream_cores": stream_cores, "one_core_free": stream_cores <= (os.cpu_count() or 1) - 0.9,
            "all_200": all(set(served[name]["statuses"]) == {"200"} for name, _, _ in kinds),
            "stream_p99_s": window["publish_minus_produce_per_batch"]["p99_s"],
            "stream_p99_le_1s": window["publish_minus_produce_per_batch"]["p99_s"] <= 1.0,
        })
    finally:
        result["peak_rss_mib"] = round(peak_rss_mib(), 1)
        result["machine_load_at_end"] = machine_load()
        result["cpu_count"] = os.cpu_count()
        shutil.rmtree(work, ignore_errors=True)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
