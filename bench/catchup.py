"""Catch-up benchmark: how long the query API's follower blocks to see one batch of the worker's.

The query server reads the worker's state as a RocksDB secondary instance
(:class:`gnnstream.workers.query.state.QueryState`) and catches up after each
batch the worker commits; requests that arrive meanwhile wait. Here the
writer is ``store.apply`` + ``engine.recompute`` in a process of its own (one
process per RocksDB database), over batches of ``--batch`` events, and the
follower is a ``QueryState`` in this process. They run in lockstep: the
writer commits a batch, then this process times ``QueryState.refresh()``
(wall and thread CPU), then the writer goes on. The first ``--warmup``
batches (the writer's caches cold) are not reported.

Two states:

- untyped: a synthetic power-law graph as ``bench/query.py``'s, smaller
  (``--nodes``, ``--edges``), SAGE 128-d, fanouts 25,10, loaded and
  backfilled; the stream is ``bench/engine.py``'s mix (90 % edge upserts,
  5 % deletes, 5 % feature updates);
- typed (unless ``--no-typed``): the payment stream of
  ``gnnstream.fraud.payments`` (``--accounts``, ``--days``) with a typed model
  trained on its first half, as ``bench/query.py --typed`` builds it; the
  stream is its second half.

Reported per state: catch-up milliseconds (p50, p90, max; wall and CPU),
the CPU mean of each quarter of the batches (the writer's memtables, and so
the follower's, grow until the writer flushes them), catch-ups that found
new table files apart, the write-ahead log bytes each catch-up replayed
(growth of the ``*.log`` files), events per batch. Prints ONE JSON object on stdout; progress on
stderr.

    .venv/bin/python -m bench.catchup
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import code_fingerprint, emit, log, machine_load, percentile


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1 << 15, help="synthetic graph nodes")
    p.add_argument("--edges", type=int, default=300_000, help="synthetic graph directed edges")
    p.add_argument("--accounts", type=int, default=5_000, help="the payment stream's accounts")
    p.add_argument("--days", type=int, default=60, help="the payment stream's days")
    p.add_argument("--train-epochs", type=int, default=5, help="training steps of the typed model")
    p.add_argument("--batch", type=int, default=1000, help="events per batch")
    p.add_argument("--batches", type=int, default=40, help="measured batches per state")
    p.add_argument("--warmup", type=int, default=3, help="batches before the measured ones")
    p.add_argument("--no-typed", action="store_true", help="the untyped state only")
    p.add_argument("--no-untyped", action="store_true", help="the typed state only")
    p.add_argument("--workdir", default=None, help="where the states go (default: the system temp dir)")
    p.add_argument("--state-cache", default=None,
                   help="directory keeping the built states (model, backfilled state, events) between runs")
    args = p.parse_args(argv)
    if min(args.batch, args.batches) < 1 or args.warmup < 0:
        p.error("--batch and --batches must be at least 1 and --warmup at least 0")
    return args


def _writer(state: str, model: str, events: list, batch: int, conn: Any) -> None:
    """The worker's writes: each batch applied and recomputed once ``conn`` says go; replies with its events
    and the CPU seconds it took (every thread of the process: flushes and compactions included)."""
    from gnnstream.workers.heap import freeze_warm_heap
    from gnnstream.workers.state import open_engine, open_store
    with open_store(state, create=False, model_dir=model) as store:
        engine = open_engine(store, model)
        freeze_warm_heap()
        conn.send("ready")
        for start in range(0, len(events), batch):
            if conn.recv() != "go":
                break
            chunk = events[start:start + batch]
            t = time.process_time()
            if engine.typed is not None:  # a typed event is several of the store's, as the worker reads it
                chunk = [held for ev in chunk for held in engine.typed.check(ev)]
            result = store.apply(chunk)
            engine.recompute(event_ts=result.max_ts)
            conn.send((min(batch, len(events) - start), time.process_time() - t))
        conn.recv()  # the follower is done: close
    conn.close()


def _files(state: Path, seen: dict[str, int]) -> tuple[int, int]:
    """Bytes the write-ahead logs grew by and table files that appeared since ``seen`` (updated)."""
    grown = tables = 0
    for entry in os.scandir(state):
        if entry.name.endswith(".log"):
            size = entry.stat().st_size
            grown += size - seen.get(entry.name, 0)
            seen[entry.name] = size
        elif entry.name.endswith(".sst") and entry.name not in seen:
            tables += 1
            seen[entry.name] = 0
    return grown, tables


def follow(state: Path, model: str, events: list, args: argparse.Namespace) -> dict[str, Any]:
    """The writer over ``events`` in a process of its own, a follower here timing each catch-up."""
    from gnnstream.workers.query.state import QueryState
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    writer = ctx.Process(target=_writer, args=(str(state), model, events, args.batch, there))
    writer.start()
    own = Path(tempfile.mkdtemp(prefix="gnnstream-follower-"))
    wall: list[float] = []
    cpu: list[float] = []
    wal: list[int] = []
    tables: list[int] = []
    writer_cpu: list[float] = []  # the writer process's CPU per batch (all its threads)
    sizes: list[int] = []
    try:
        if here.recv() != "ready":
            raise SystemExit("the writer did not start")
        query = QueryState(state, model, own)
        seen: dict[str, int] = {}
        _files(state, seen)
        query.refresh()
        for i in range(-(-len(events) // args.batch)):
            here.send("go")
            size, spent = here.recv()
            sizes.append(size)
            writer_cpu.append(spent)
            grown, new = _files(state, seen)
            wal.append(grown)
            tables.append(new)
            t, c = time.perf_counter(), time.thread_time()
            query.refresh()
            cpu.append(time.thread_time() - c)
            wall.append(time.perf_counter() - t)
        status = query.status()
        query.close()
        here.send("close")
        writer.join(60)
    finally:
        if writer.is_alive():
            writer.kill()
        shutil.rmtree(own, ignore_errors=True)
    skip = args.warmup
    wall, cpu, wal, tables, sizes = wall[skip:], cpu[skip:], wal[skip:], tables[skip:], sizes[skip:]
    writer_cpu = writer_cpu[skip:]

    def ms(values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        return {"count": len(values), "p50": round(1000 * percentile(values, 50), 2), "p90": round(1000 * percentile(values, 90), 2),
                "max": round(1000 * max(values), 2), "mean": round(1000 * float(np.mean(values)), 2)}

    return {"batches": len(wall), "events_per_batch": round(float(np.mean(sizes)), 1),
            "catch_up_ms": ms(wall), "catch_up_cpu_ms": ms(cpu),
            # the writer's memtables (and so the follower's) grow until it flushes: later catch-ups cost more
            "catch_up_cpu_ms_mean_by_quarter": [round(1000 * float(np.mean(q)), 2) for q in np.array_split(cpu, 4)],
            "with_new_tables_ms": ms([w for w, t in zip(wall, tables) if t]),
            "without_new_tables_ms": ms([w for w, t in zip(wall, tables) if not t]),
            "wal_kib_per_batch": {"p50": round(percentile(wal, 50) / 1024, 1), "max": round(max(wal) / 1024, 1)},
            "writer_cpu_ms_per_batch": ms(writer_cpu), "dirty_at_end": status["dirty"]}


def built(kind: str, args: argparse.Namespace, work: Path) -> tuple[str, Path, list, dict[str, Any]]:
    """The model, a fresh copy of the backfilled state, the stream and the setup's stats of ``kind``
    (``--state-cache``: built there once, keyed by the arguments that shape them)."""
    from bench.e2e_matrix import clone_state
    n = (args.warmup + args.batches) * args.batch
    shape = f"n{args.nodes}-e{args.edges}" if kind == "untyped" else \
        f"a{args.accounts}-d{args.days}-t{args.train_epochs}"
    home = Path(args.state_cache) / f"{kind}-{shape}-{n}" if args.state_cache else work / f"{kind}-build"
    if not (home / "built.pickle").exists():
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        setup: dict[str, Any] = {}
        if kind == "untyped":
            import bench.e2e_matrix as e2e_matrix
            import bench.engine as engine_bench
            ns = argparse.Namespace(nodes=args.nodes, edges=args.edges, fanouts=[25, 10], store_cache=None)
            graph, model, base = e2e_matrix.base_state(ns, home, setup)
            events = engine_bench.stream_events(graph, n, np.random.default_rng(1), 0.90, 0.05, 1_750_000_000,
                                                args.batch)[0]
            stats = setup["graph"]
        else:
            from bench.query import payments_workload
            ns = argparse.Namespace(accounts=args.accounts, days=args.days, train_epochs=args.train_epochs,
                                    seconds=1.0, score_rps=1.0)
            model, base, events_of, _ = payments_workload(ns, home, setup)
            events, stats = events_of(n, 0), setup["graph"]["payments"]
        (home / "built.pickle").write_bytes(pickle.dumps((model, str(base), events, stats)))
    model, base, events, stats = pickle.loads((home / "built.pickle").read_bytes())
    state = work / f"{kind}-state"
    clone_state(Path(base), state)
    return model, state, events, stats


def measure(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model, state, events, stats = built(kind, args, work)
    log(f"{kind}: {len(events)} events in batches of {args.batch}")
    return {"graph": stats, **follow(state, model, events, args)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GNNSTREAM_NO_PROGRESS", "1")
    import torch
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="gnnstream-catchup-", dir=args.workdir))
    result: dict[str, Any] = {"bench": "catchup", "code": code_fingerprint(), "machine_load_at_start": machine_load(),
                              "config": {"batch": args.batch, "batches": args.batches, "warmup": args.warmup}}
    try:
        for kind in ("untyped", "typed"):
            if not getattr(args, f"no_{kind}"):
                result[kind] = measure(kind, args, work)
                log(f"{kind}: {result[kind]['catch_up_ms']}")
    finally:
        result["machine_load_at_end"] = machine_load()
        shutil.rmtree(work, ignore_errors=True)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
