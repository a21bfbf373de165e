"""``bench/e2e.py --graph synthetic`` runs at a tiny size: the worker behind Kafka ends on the same
embeddings as the engine alone, the latency-bound search bisects between 0 and each backlog rate, and the
targets are judged from what was measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.broker
def test_e2e_synthetic_quick_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "e2e.py"), "--graph", "synthetic", "--nodes", "1000", "--edges",
         "6000", "--stream-events", "1200", "--warmup-events", "400", "--batch-size", "200", "--max-batch-size",
         "400", "--clients", "confluent", "--formats", "json,packed", "--hold-seconds", "3", "--search-steps", "2",
         "--fresh-warmup-s", "1", "--idle-s", "1", "--workdir", str(tmp_path)],
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
    assert [(r["kafka_client"], r["output_format"]) for r in matrix] == [("confluent", "json"), ("confluent", "packed")]
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

    bound = result["latency_bound"]  # each format's highest paced rate within the bound, by bisection
    engine_rate = next(r for r in runs if r["batch"] == 200)["updates_per_s"]  # batches of --batch-size
    assert bound["engine_alone_updates_per_s"] == engine_rate and bound["client"] == "confluent"
    assert [row["output_format"] for row in bound["formats"]] == ["json", "packed"]
    for row in bound["formats"]:
        backlog = next(r for r in matrix if r["output_format"] == row["output_format"])["events_per_s"]
        first, second = row["probes"]
        assert row["backlog_rate"] == backlog and first["rate"] == pytest.approx(backlog / 2, abs=0.1)
        assert second["rate"] == pytest.approx(backlog * (3 / 4 if first["holds"] else 1 / 4), abs=0.1)
        for probe in row["probes"]:
            fresh = probe["embedding_freshness"]
            flat = probe["lag"]["growth_over_run_events"] < probe["rate"]
            assert fresh["count"] > 0 and probe["holds"] == (fresh["p99_s"] <= 1.0 and flat)
            assert probe["max_abs_diff_to_engine_alone"] <= 1e-5  # every probe ends on the engine's embeddings
            window = probe["window"]
            cores = window["cores"]
            assert {"worker", "delivery process", "broker"} <= set(cores) and window["published_per_s"] > 0
            assert window["cpu_us_per_update"]["delivery process"] == pytest.approx(
                cores["delivery process"] / window["published_per_s"] * 1e6, rel=0.01, abs=0.002)
            assert window["batches"] > 0 and window["mean_batch_events"] > 0
        held = [p["rate"] for p in row["probes"] if p["holds"]]
        assert row["rate_at_bound"] == max(held, default=0.0)
        assert row["ratio"] == pytest.approx(row["rate_at_bound"] / engine_rate, abs=1e-3)
        assert row["exact"] is True and row["ratio_pass"] == (row["ratio"] >= row["ratio_required"])
        assert targets["latency_bound"][row["output_format"]]["ratio_pass"] == row["ratio_pass"]
    assert list(tmp_path.iterdir()) == [], "the temporary states must be removed"
