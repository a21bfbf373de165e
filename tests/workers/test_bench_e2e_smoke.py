"""``bench/e2e.py --graph synthetic`` runs at a tiny size: the worker behind Kafka ends on the same
embeddings as the engine alone, and the targets are judged from what was measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.broker
def test_e2e_synthetic_quick_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "e2e.py"), "--graph", "synthetic", "--nodes", "1000", "--edges",
         "6000", "--stream-events", "1200", "--warmup-events", "400", "--batch-size", "200", "--max-batch-size",
         "400", "--clients", "confluent", "--formats", "json,binary", "--fresh-seconds", "3", "--fresh-warmup-s",
         "1", "--idle-s", "1", "--workdir", str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert result["graph"]["nodes"] == 1000
    alone = result["engine_alone"]
    runs = alone["runs"]
    assert [(r["batch"], r["when"]) for r in runs[:2]] == [(200, "before"), (400, "before")]
    fastest = max(runs[:2], key=lambda r: r["updates_per_s"])["batch"]
    assert [(r["batch"], r["when"]) for r in runs[2:]] == [(fastest, "after")]  # again, after the workers
    assert all(r["after_warmup"]["events"] == 1200 and r["events"] == 1600 for r in runs)
    assert alone["updates_per_s"] == max(r["updates_per_s"] for r in alone["runs"]) > 0
    for r in runs:  # the engine's CPU over its measured batches: cores x seconds / events
        assert r["cores"]["engine"] > 0
        assert r["cpu_us_per_event"]["engine"] == pytest.approx(r["cores"]["engine"] / r["updates_per_s"] * 1e6,
                                                                rel=0.01)

    matrix = result["matrix"]
    assert [(r["kafka_client"], r["output_format"]) for r in matrix] == [("confluent", "json"), ("confluent", "binary")]
    for row in matrix:
        assert row["run"]["events"] == 1600  # every event applied, none dead-lettered
        assert row["max_abs_diff_to_engine_alone"] <= 1e-5  # through Kafka, the engine's own result
        assert row["ratio_to_engine_alone"] == pytest.approx(row["events_per_s"] / alone["updates_per_s"], abs=1e-3)
        assert row["published_per_event"] > 0
        measured = row["run"]["after_warmup"]
        cores = measured["cores"]  # sampled from /proc at the measured window's two ends
        assert {"worker", "delivery process", "broker"} <= set(cores) and cores["worker"] > 0
        assert cores["total"] == pytest.approx(sum(v for k, v in cores.items() if k != "total"), abs=0.01)
        assert measured["cpu_us_per_event"]["total"] == pytest.approx(
            cores["total"] / measured["events_per_s"] * 1e6, rel=0.01)
    targets = result["targets"]
    assert targets["exact_pass"] is True
    default = next(r for r in matrix if r["default"])
    assert targets["default_ratio_pass"] == (default["ratio_to_engine_alone"] >= 0.5)
    per_event = default["run"]["after_warmup"]["cpu_us_per_event"]["total"]
    assert targets["default_cores_needed"] == pytest.approx(0.5 * alone["updates_per_s"] * per_event / 1e6,
                                                            rel=0.01, abs=0.01)

    fresh = result["freshness"]
    assert fresh["backlog_events"] == 400 and fresh["events"] > 0
    latency = fresh["publish_minus_produce_per_batch"]
    assert latency["batches"] > 0 and latency["max_s"] >= latency["p99_s"] >= latency["p50_s"] > 0
    assert fresh["lag"]["samples"] and targets["freshness_p99_pass"] == (latency["p99_s"] <= 1.0)
    assert list(tmp_path.iterdir()) == [], "the temporary states must be removed"
