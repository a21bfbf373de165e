"""``bench/query.py`` runs at a tiny size: both loads are answered beside the stream, and the targets are
judged from what was measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.broker
def test_query_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.query", "--nodes", "1000", "--edges", "6000", "--rate", "200",
         "--warmup-events", "300", "--seconds", "2", "--lookup-rps", "50", "--infer-rps", "10",
         "--fresh-warmup-s", "2", "--batch-size", "100", "--max-batch-size", "400", "--workdir", str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert result["config"]["stream_rate"] == 200 and "sustained" not in result  # --rate: no sustained run
    for kind, rps in (("lookup", 50), ("what_if_one_edge", 10)):
        load = result[kind]
        assert load["requests"] == 2 * rps and load["statuses"] == {"200": 2 * rps}
        assert load["max_ms"] >= load["p99_ms"] >= load["p50_ms"] > 0 and load["achieved_rps"] > 0
    window = result["stream_while_serving"]
    assert window["to_s"] > window["from_s"] >= 2
    latency = window["publish_minus_produce_per_batch"]
    assert latency["batches"] > 0 and latency["max_s"] >= latency["p99_s"] > 0
    targets = result["targets"]
    assert targets["all_200"] is True
    assert targets["lookup_p99_le_5ms"] == (result["lookup"]["p99_ms"] <= 5.0)
    assert targets["what_if_p99_le_20ms"] == (result["what_if_one_edge"]["p99_ms"] <= 20.0)
    assert targets["stream_p99_le_1s"] == (latency["p99_s"] <= 1.0)
    assert list(tmp_path.iterdir()) == [], "the temporary states must be removed"
