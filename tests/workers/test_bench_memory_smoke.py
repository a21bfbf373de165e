"""``bench/memory.py`` runs at a tiny size and prints one JSON object with a timing for every pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_memory_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--chunks", "2", "--chunk-mib", "4", "--frames", "8",
         "--dim", "4", "--workdir", str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert result["config"] == {"chunks": 2, "chunk_mib": 4, "frames": 8, "dim": 4, "frame_bytes": 128 * 4 * 4}
    anon = result["anonymous_us_per_page"]
    assert len(anon["first_pass"]) == len(anon["second_pass"]) == 2
    assert all(x > 0 for x in anon["first_pass"] + anon["second_pass"])
    assert anon["first_pass_max"] == max(anon["first_pass"]) and anon["second_pass_min"] == min(anon["second_pass"])
    assert sorted(result["row_file"]) == ["fresh_us_per_frame", "rewrite_again_us_per_frame", "rewrite_us_per_frame"]
    assert all(v > 0 for v in result["row_file"].values())
    assert list(tmp_path.iterdir()) == [], "the row file's directory must be removed"
    assert len(result["code"]["git_head"]) >= 7  # the revision it measured
