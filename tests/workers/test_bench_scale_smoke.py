"""``bench/scale.py`` runs at a tiny size: both sizes stream every batch, in lock step, and the ratio is theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_scale_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.scale", "--large-log2", "11", "--large-edges", "12000",
         "--small-log2", "9", "--events", "600", "--batch", "200", "--workdir", str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert "streaming both sizes in lock step" in out.stderr
    for name, nodes, edges in (("large", 2048, 12000), ("small", 512, 3000)):
        size = result[name]
        assert (size["nodes"], size["load"]["edges"], size["load"]["bulk"]) == (nodes, edges, True), name
        assert size["stream"]["events"] == 600, (name, size["stream"])
        assert size["stream"]["updates_per_second"] > 0 and size["peak_rss_mib"] > 0, (name, size)
    summary = result["summary"]
    ratio = result["large"]["stream"]["updates_per_second"] / result["small"]["stream"]["updates_per_second"]
    assert summary["ratio_large_over_small"] == round(ratio, 3)
    assert summary["targets"]["ratio_large_over_small"] == [0.67, ratio >= 0.67]
    assert list(tmp_path.iterdir()) == [], "the temporary states must be removed"
