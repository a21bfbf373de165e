"""``make demo``: the whole pipeline on real data, on one machine, without Docker.

Starts the embedded broker, creates a GraphSAGE model directory, runs the
worker in this process, replays the Bitcoin OTC trust network through Kafka,
checks every stored embedding against a from-scratch computation and prints a
readable summary (and the same as JSON in ``out/demo-summary.json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from model import init_model_dir
from stream.broker import EmbeddedBroker
from stream.kafka import EventConsumer
from workers.offline import verify
from workers.replay import produce_file
from workers.settings import WorkerSettings
from workers.worker import Worker

__all__ = ["main", "run_demo"]

logger = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "soc-sign-bitcoinotc.csv"


def _histogram_quantile(worker: Worker, name: str, q: float) -> float | None:
    """Quantile estimated from a Prometheus histogram's cumulative buckets (upper bound)."""
    for metric in worker.metrics.registry.collect():
        if metric.name != name:
            continue
        buckets = [(float(s.labels["le"]), s.value) for s in metric.samples if s.name.endswith("_bucket")]
        total = buckets[-1][1] if buckets else 0
        if not total:
            return None
        for le, count in buckets:
            if count >= q * total:
                return le
    return None


def _count_dead_letters(bootstrap: str, topic: str) -> int:
    consumer = EventConsumer(bootstrap, topic, f"demo-dlq-{os.getpid()}")
    count, idle = 0, 0
    try:
        while idle < 3:
            records = consumer.poll_batch(1000, 1.0)
            count += len(records)
            idle = 0 if records else idle + 1
    finally:
        consumer.close()
    return count


def run_demo(data: Path, workdir: Path, limit: int = 0) -> dict[str, Any]:
    if not data.exists():
        raise SystemExit(f"demo data not found at {data}; it ships in ../shared/data next to the repository")
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    model_dir = workdir / "model"
    init_model_dir(model_dir, arch="sage", in_dim=8, hidden=64, out_dim=32, layers=2, fanouts=[25, 10],
                   seed=0, name="otc-sage", version=1)
    with EmbeddedBroker(log_path=workdir / "broker.log") as broker:
        print(f"embedded broker at {broker.bootstrap}", file=sys.stderr)
        settings = WorkerSettings(bootstrap=broker.bootstrap, state=str(workdir / "state"), model=str(model_dir),
                                  metrics_port=0, batch_size=1000, batch_wait_ms=100)
        produced = produce_file(broker.bootstrap, str(data), fmt="snap", limit=limit,
                                partitions=settings.partitions, topic=settings.events_topic)
        worker = Worker(settings)
        summary: dict[str, Any] = {}
        t0 = time.perf_counter()
        thread = threading.Thread(target=lambda: summary.update(worker.run(max_idle_s=3.0)), name="worker")
        thread.start()
        while thread.is_alive():
            thread.join(2.0)
            h = worker.health
            print(f"\rworker: {h.applied:,}/{produced['produced']:,} events applied, "
                  f"{h.published:,} embeddings published", end="", file=sys.stderr)
        print(file=sys.stderr)
        seconds = time.perf_counter() - t0 - 3.0  # minus the idle wait that ends the run
        dead = _count_dead_letters(broker.bootstrap, settings.dlq_topic)
        fresh50 = _histogram_quantile(worker, "gnnstream_pipeline_latency_seconds", 0.5)
        fresh99 = _histogram_quantile(worker, "gnnstream_pipeline_latency_seconds", 0.99)
    check = verify(settings.state)
    return {
        "events_produced": produced["produced"],
        "events_applied": summary.get("applied"),
        "events_per_s": round((summary.get("applied") or 0) / max(seconds, 1e-9), 1),
        "embeddings_published": summary.get("published"),
        "dead_letters": dead,
        "pipeline_latency_p50_s_upper_bound": fresh50,
        "pipeline_latency_p99_s_upper_bound": fresh99,
        "nodes": check["nodes"],
        "exact": check["ok"],
        "max_abs_error_vs_from_scratch": check["max_abs_error"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.demo", description=__doc__)
    parser.add_argument("--data", type=Path, default=DATA, help=f"SNAP CSV to replay (default {DATA})")
    parser.add_argument("--workdir", type=Path, default=Path("out/demo"), help="scratch directory (default out/demo)")
    parser.add_argument("--limit", type=int, default=0, help="replay only the first N events")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run_demo(args.data, args.workdir, args.limit)
    print("\ngnnstream demo — Bitcoin OTC trust network replayed through Kafka")
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"  {key.ljust(width)}  {value}")
    Path("out").mkdir(exist_ok=True)
    Path("out/demo-summary.json").write_text(json.dumps(result, indent=2))
    complete = result["events_applied"] == result["events_produced"] - result["dead_letters"]
    return 0 if result["exact"] and complete and result["nodes"] else 1


if __name__ == "__main__":
    sys.exit(main())
