"""``bench/rollout.py`` runs at a tiny size: every stretch measures v1's freshness, v2 publishes beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.xdist_group("scale-out")  # several workers at once: one such test at a time


@pytest.mark.broker
def test_rollout_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.rollout", "--nodes", "1000", "--edges", "6000", "--rate", "100",
         "--seconds", "3", "--sample", "1", "--batch-size", "100", "--max-batch-size", "400",
         "--workdir", str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert result["graph"]["nodes"] == 1000 and result["rate"] == 100
    stretches = result["stretches"]
    assert list(stretches) == ["alone", "backfill", "both"]
    for name, stretch in stretches.items():
        v1 = stretch["v1"]
        assert v1["sampled_updates"] > 0, (name, stretch)
        assert v1["max_s"] >= v1["p99_s"] >= v1["p50_s"] >= 0, (name, v1)
        assert stretch["cores"]["v1-worker"] > 0, (name, stretch["cores"])
    assert stretches["backfill"]["cores"]["rollout-start"] > 0
    v2 = stretches["both"]["v2"]
    assert v2["sampled_updates"] > 0 and v2["max_s"] >= v2["p50_s"] >= 0, v2
    assert list(tmp_path.iterdir()) == [], "the temporary states must be removed"
