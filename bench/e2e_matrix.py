"""The delivery matrix of ``python -m bench.e2e --graph synthetic``: the engine alone against the whole
pipeline (Kafka in, Kafka out) on a synthetic graph, for each Kafka client and output format, side by side,
then each output format's throughput at the latency bound."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.common import (
    FEATURE_DIM as SYNTH_DIM, CpuSampler, code_fingerprint, log, machine_load, make_graph, model_dir, open_loaded_store,
    peak_rss_mib, percentile,
)
from gnnstream.stream.backends import open_producer
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.events import encode_event, event_key
from gnnstream.stream.kafka import ensure_topics
from gnnstream.workers.settings import WorkerSettings

from bench.kafka_run import worker_settings, cpu_per_event, histogram_quantiles, histogram_state, produce, start_worker, sustained


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


def _paced_producer(bootstrap: str, topic: str, warm: list, events: list, rate: Any, sent: Any, go: Any,
                    stop: Any) -> None:
    """Child process of the freshness run: ``warm`` at once, then after ``go`` ``events`` at ``rate.value``
    events/s (read as it goes: the parent may change it), until they run out or ``stop`` is set.

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
        due = time.perf_counter()
        for i, ev in enumerate(events, 1):
            due += 1.0 / rate.value
            ahead = due - time.perf_counter()
            if ahead > 0.002:
                time.sleep(ahead)
            send(ev)
            if i % 50 == 0:
                producer.flush(30)
                sent.value = i
                if stop.is_set():
                    return
        producer.flush(30)
        sent.value = len(events)
    finally:
        producer.close()


def paced_freshness(bootstrap: str, warm: list, events: list, rate: float, model: str, state: str, client: str,
                    fmt: str, args: argparse.Namespace, query_port: int = 0,
                    alongside: Callable[[], dict[str, Any]] | None = None,
                    pace: Callable[[float, int], float] | None = None) -> dict[str, Any]:
    """``warm`` as a backlog, then ``events`` at ``rate`` on a fresh topic: freshness and lag.

    The producer is a child process (it does not share this process's
    interpreter with the worker). The paced events start once the worker
    has applied and published the backlog (its caches are then warm), and
    the first ``--fresh-warmup-s`` seconds of them are not counted.
    Reported: publish - produce per delivered batch
    (``Worker.latency_timeline``: publish time minus the Kafka time of the
    batch's oldest record), the worker's freshness histogram (publish minus
    event time, per published embedding) and the lag (events produced minus
    events applied) sampled every second, with its least-squares slope; over
    the measured seconds while the producer ran, the cores of each process
    (``/proc``), their CPU per event and per published update, and the
    worker's batches.

    With ``query_port`` the worker serves its query API there, and
    ``alongside()`` runs in a thread from the end of the warm-up; what it
    returns is reported as ``alongside``, and the freshness and lag figures
    cover its run only (``alongside_window``); the producer stops once
    ``alongside()`` has returned.

    With ``pace``, ``pace(rate, lag)`` is called once a second during the
    warm-up (``lag``: events produced but not yet applied) and returns the
    rate to produce at from then on; the rate it last returned is reported
    as ``target_rate``.
    """
    import multiprocessing as mp
    tag = uuid.uuid4().hex[:8]
    topic = f"bench-fresh-ev-{tag}"
    ensure_topics(bootstrap, {topic: args.partitions})
    settings = dataclasses.replace(worker_settings(bootstrap, topic, model, state, tag, client, fmt, args),
                                   query_port=query_port)
    worker, thread, result = start_worker(settings, None)
    ctx = mp.get_context("spawn")
    sent, go, stop, shared_rate = ctx.Value("q", 0), ctx.Event(), ctx.Event(), ctx.Value("d", rate, lock=False)
    child = ctx.Process(target=_paced_producer, args=(bootstrap, topic, warm, events, shared_rate, sent, go, stop),
                        daemon=True)
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
    window_ends: list[tuple[float, int, int, dict[str, Any]]] = []  # (sample time, applied, published, batches)
    sampler = CpuSampler()

    def window_end() -> None:
        window_ends.append((sampler.mark(), worker.health.applied, worker.health.published,
                            histogram_state(worker, "gnnstream_batch_events")))

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
            stop.set()

    with sampler:
        while time.monotonic() < deadline:
            time.sleep(1.0)
            if pace is not None and base_fresh is None:
                rate = shared_rate.value = pace(rate, sent.value - (worker.health.applied - applied0))
                deadline = t0 + 2 * len(events) / rate + 120
            if base_fresh is None and time.monotonic() - t0 >= args.fresh_warmup_s:
                worker.latency_timeline.clear()
                base_fresh = histogram_state(worker, "gnnstream_embedding_freshness_seconds")
                window_end()
                if alongside is not None:
                    side["start_s"] = time.monotonic() - t0
                    side_thread = threading.Thread(target=run_alongside)
                    side_thread.start()
            alongside_done()
            producing = child.is_alive()
            produced, applied = sent.value, worker.health.applied - applied0
            lag.append({"t_s": round(time.monotonic() - t0, 2), "produced": produced, "applied": applied,
                        "lag": max(0, produced - applied), "producing": producing})
            if len(window_ends) == 1 and not producing:  # the producer is done: the window ends
                window_end()
            if "error" in result:
                raise result["error"]
            if int(lag[-1]["t_s"]) % 10 == 0:
                log(f"freshness: {lag[-1]}")
            engine = worker.engine
            if not producing and applied >= sent.value and engine is not None and not engine.pending():
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
    window = [x for x in lag if x["t_s"] >= args.fresh_warmup_s and x["producing"]]
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
        **_window_cost(sampler, window_ends),
        "pass_p99_le_1s": bool(latencies) and p99 <= 1.0,
        # "does not grow": over the whole run the fitted lag rises by less than one second of events
        "pass_lag_flat": growth < rate,
        **(_alongside_report(side, lag) if alongside is not None else {}),
    }


def _window_cost(sampler: CpuSampler, ends: list[tuple[float, int, int, dict[str, Any]]]) -> dict[str, Any]:
    """The cores of each process between the two ``ends`` (sample time, applied, published, batch histogram),
    their CPU per event and per published update, and the worker's batches (count, mean events)."""
    if len(ends) < 2 or ends[1][0] - ends[0][0] < 1.0:  # the producer was done before the warm-up was over
        return {}
    (t0, applied0, published0, batches0), (t1, applied1, published1, batches1) = ends
    seconds = t1 - t0
    events_per_s, published_per_s = (applied1 - applied0) / seconds, (published1 - published0) / seconds
    cost = cpu_per_event(sampler.cores(t0, t1), events_per_s)
    if published_per_s and "cpu_us_per_event" in cost:
        cost["cpu_us_per_update"] = {role: round(c / published_per_s * 1e6, 3) for role, c in cost["cores"].items()}
    batches = batches1["count"] - batches0["count"]
    return {"window": {"seconds": round(seconds, 2), "events_per_s": round(events_per_s, 1),
                       "published_per_s": round(published_per_s, 1),
                       "published_per_event": round(published_per_s / events_per_s, 3) if events_per_s else None,
                       "batches": int(batches),
                       "mean_batch_events": round((batches1["sum"] - batches0["sum"]) / batches, 1)
                       if batches else None,
                       **cost}}


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


BOUND_S = 1.0  # freshness p99 within which the search holds a rate
# the targets: throughput at the bound over the engine alone's at batches of --batch-size, and the delivery
# process's CPU per published update at that rate
RATIO_REQUIRED = {"packed": 0.6, "binary": 0.4, "json": 0.25}
DELIVERY_US_REQUIRED = {"packed": 0.3, "binary": 2.5, "json": 6.0}


def search_bound(events: list, warm: int, backlog_rate: float, engine_rate: float, model: str, base: Path,
                 work: Path, client: str, fmt: str, args: argparse.Namespace) -> dict[str, Any]:
    """The highest paced rate at which the worker publishing ``fmt`` keeps freshness p99 (publish minus event
    time, per published embedding) within ``BOUND_S`` and its lag flat, for ``--hold-seconds``.

    A bisection of ``--search-steps`` probes between 0 and ``backlog_rate`` (its rate on a backlog): each probe
    is :func:`paced_freshness` on a fresh broker (it keeps every message in memory) from a copy of ``base``,
    ``warm`` events as a backlog then ``--fresh-warmup-s`` + ``--hold-seconds`` of ``events`` at the probed
    rate; its final embeddings are compared with the engine alone's over the same events (the model's
    cold-start policy is plain and the state has no edge window, so event times, here the send times, do not
    change embeddings).
    """
    low, high = 0.0, backlog_rate
    probes = []
    for step in range(args.search_steps):
        rate = (low + high) / 2
        paced = events[warm:warm + int(rate * (args.fresh_warmup_s + args.hold_seconds))]
        log(f"latency bound, {fmt}: probe {step + 1}/{args.search_steps} at {rate:.0f} events/s")
        state, expected = work / f"bound-{fmt}", work / "bound-engine"
        clone_state(base, state)
        with EmbeddedBroker() as broker:
            run = paced_freshness(broker.bootstrap, events[:warm], paced, rate, model, str(state), client, fmt, args)
            broker_rss = _rss_mib(broker.pid)
        clone_state(base, expected)
        engine_alone(expected, model, events[:warm + len(paced)], args.max_batch_size, 0)
        diff = max_abs_diff(final_rows(state, model), final_rows(expected, model))
        shutil.rmtree(state)
        shutil.rmtree(expected)
        fresh = run["embedding_freshness"]
        holds = fresh["p99_s"] is not None and fresh["p99_s"] <= BOUND_S and run["pass_lag_flat"]
        probes.append({"rate": round(rate, 1), "holds": holds, "achieved_rate": run["achieved_rate"],
                       "measured_s": run["measured_s"], "embedding_freshness": fresh,
                       "publish_minus_produce_per_batch": run["publish_minus_produce_per_batch"],
                       "lag": {k: v for k, v in run["lag"].items() if k != "samples"},
                       "window": run.get("window"), "broker_rss_mib": broker_rss,
                       "max_abs_diff_to_engine_alone": diff})
        log(f"latency bound, {fmt}: {probes[-1]}")
        low, high = (rate, high) if holds else (low, rate)
    best = max((p for p in probes if p["holds"]), key=lambda p: p["rate"], default=None)
    cost = (best or {}).get("window") or {}
    delivery = cost.get("cpu_us_per_update", {}).get("delivery process")
    ratio = round(best["rate"] / engine_rate, 3) if best else 0.0
    return {"output_format": fmt, "backlog_rate": backlog_rate, "rate_at_bound": best["rate"] if best else 0.0,
            "ratio": ratio, "ratio_required": RATIO_REQUIRED.get(fmt),
            "ratio_pass": ratio >= RATIO_REQUIRED.get(fmt, float("inf")),
            "cores_at_bound": cost.get("cores"), "cpu_us_per_event_at_bound": cost.get("cpu_us_per_event"),
            "delivery_cpu_us_per_update": delivery, "delivery_cpu_required_us": DELIVERY_US_REQUIRED.get(fmt),
            "delivery_cpu_pass": delivery is not None and delivery <= DELIVERY_US_REQUIRED.get(fmt, -1.0),
            "exact": all(p["max_abs_diff_to_engine_alone"] <= 1e-4 for p in probes), "probes": probes}


def _rss_mib(pid: int | None) -> float | None:
    """Resident memory of process ``pid`` (MiB), from ``/proc``; None where unknown."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(round(int(line.split()[1]) / 1024, 1) for line in fh if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


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
    work = Path(tempfile.mkdtemp(prefix="gnnstream-e2e-", dir=args.workdir))
    result: dict[str, Any] = {"bench": "e2e", "mode": "synthetic", "code": code_fingerprint(),
                              "machine_load_at_start": machine_load()}
    try:
        graph, model, base = base_state(args, work, result)
        rng = np.random.default_rng(1)
        warm = args.warmup_events
        events, counts = engine_bench.stream_events(graph, warm + args.stream_events, rng, 0.90, 0.05,
                                                    1_750_000_000, args.batch_size)
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
        if args.hold_seconds <= 0:
            return result
        reference = next(a for a in alone if a["batch"] == args.batch_size)  # the bound needs small batches
        backlog = {r["output_format"]: r["events_per_s"] for r in matrix if r["kafka_client"] == default[0]}
        fresh_events, _ = engine_bench.stream_events(
            graph, warm + int(max(backlog.values()) * (args.fresh_warmup_s + args.hold_seconds)) + 1,
            np.random.default_rng(2), 0.90, 0.05, 1_750_000_000, args.batch_size)
        bound = result["latency_bound"] = {
            "engine_alone_batch": args.batch_size, "engine_alone_updates_per_s": reference["updates_per_s"],
            "client": default[0], "freshness_p99_bound_s": BOUND_S, "hold_s": args.hold_seconds,
            "steps": args.search_steps,
            "formats": [search_bound(fresh_events, warm, backlog[fmt], reference["updates_per_s"], model, base,
                                     work, default[0], fmt, args) for fmt in formats]}
        result["targets"]["latency_bound"] = {
            row["output_format"]: {k: row[k] for k in ("ratio", "ratio_required", "ratio_pass",
                                                       "delivery_cpu_us_per_update", "delivery_cpu_required_us",
                                                       "delivery_cpu_pass", "exact")}
            for row in bound["formats"]}
    finally:
        result["peak_rss_mib"] = round(peak_rss_mib(), 1)
        result["machine_load_at_end"] = machine_load()
        result["cpu_count"] = os.cpu_count()
        shutil.rmtree(work, ignore_errors=True)
    return result
