"""``bench/bulk.py`` runs at a tiny size: each worker count loads in a process of its own, and the summary is
theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bulk_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.bulk", "--log2", "10", "--edges", "6000", "--workers", "1,2", "--repeat", "1",
         "--workdir", str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert [(entry["workers"], entry["load"]["workers"]) for entry in result["loads"]] == [(1, 1), (2, 2)]
    for entry in result["loads"]:
        load = entry["load"]
        assert (load["nodes"], load["edges"], load["bulk"]) == (1024, 6000, True), load
        assert load["edges_per_second"] > 0 and entry["peak_rss_mib"] > 0
    assert result["loads"][0]["load"]["worker_cpu_seconds"] == 0 < result["loads"][1]["load"]["worker_cpu_seconds"]
    one, two = result["summary"]["1"], result["summary"]["2"]
    assert two["edges_per_second_over_first"] == round(two["edges_per_second_median"] / one["edges_per_second_median"],
                                                       3)
    assert list(tmp_path.iterdir()) == [], "the graph file and the states must be removed"
