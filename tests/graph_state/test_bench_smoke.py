"""``bench/store.py`` runs at a tiny size and prints one JSON object with the promised fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_store_bench_quick_run(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bench.store", "--hub-degree", "3000", "--random-edges", "500",
         "--reads", "30", "--dir", str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert result["graph"]["hub_degree"] == 3000
    assert result["graph"]["nodes"] == 1 + 3000 + (1 + 10) + (1 + 25)  # hub, its leaves, deg10 and deg25 stars
    assert 3000 + 35 < result["graph"]["edges"] <= 3000 + 35 + 500  # random upserts may repeat an edge
    for mode in ("warm", "cold"):
        for k in (10, 25):
            for node in ("degree10", "hub"):
                case = result["reads"][f"{mode}_k{k}_{node}"]
                assert case["reads_per_s"] > 0 and case["returned"] == (min(k, 10) if node == "degree10" else k)
    assert set(result["hub_over_degree10_read_cost_p50"]) == {"warm_k10", "warm_k25", "cold_k10", "cold_k25"}
    assert result["upserts"]["hub_build_upserts_per_s"] > 0 and result["peak_rss_mib"] > 0
    assert list(tmp_path.iterdir()) == [], "the temporary store must be removed"
