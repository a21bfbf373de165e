"""``bench/apply_cli.py`` runs at a tiny size in both modes: the command line and the engine alone apply the same
stream, and the ratios are those of the runs reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a bench run each


def _bench(tmp_path: Path, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.apply_cli", *args, "--workdir", str(tmp_path)],
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO), "GNNSTREAM_NO_PROGRESS": "1"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert list(tmp_path.iterdir()) == [], "the temporary states must be removed"
    return json.loads(out.stdout)  # exactly one JSON object on stdout


def test_apply_against_the_engine_quick_run(tmp_path: Path) -> None:
    result = _bench(tmp_path, "--scale", "9", "--edge-factor", "6", "--events", "600", "--batch", "200",
                    "--big-batch", "300", "--repeat", "1", "--no-shape")
    graph = result["setup"]["graph"]
    assert graph["kind"] == "R-MAT" and graph["nodes"] == 512 and 0 < graph["directed_edges"] <= 6 * 512
    assert result["setup"]["graph_lines"] == 512 + graph["directed_edges"]
    assert result["setup"]["graph_load"]["events"] == result["setup"]["graph_lines"]
    assert result["setup"]["backfill"]["nodes"] == 512
    assert sum(result["setup"]["event_counts"][op] for op in ("edge_upsert", "edge_delete", "node_upsert")) == 600
    cli = result["apply"]["median_run"]
    assert cli["events"] == 600 and cli["invalid"] == 0 and cli["pending"] == 0
    assert cli["updates_per_second"] == round(600 / cli["wall_seconds"], 1)
    assert set(cli["seconds_by_phase"]) == {"start", "read", "apply", "recompute", "drain", "close"}
    assert sum(cli["seconds_by_phase"].values()) <= cli["seconds"] + 0.005 and cli["seconds"] <= cli["wall_seconds"]
    assert result["apply_big_batch"]["median_run"]["events"] == 600
    for name in ("engine_alone_warm", "engine_alone_cold"):
        alone = result[name]["median_run"]
        assert alone["pending_after"] == 0 and alone["updates_per_second"] > 0, name
    assert "backfill_seconds" in result["engine_alone_warm"]["median_run"]["setup"]
    assert "backfill_seconds" not in result["engine_alone_cold"]["median_run"]["setup"]
    summary = result["summary"]
    ratio = cli["updates_per_second"] / result["engine_alone_warm"]["median_run"]["updates_per_second"]
    assert summary["apply_over_engine_alone"] == round(ratio, 3)
    assert summary["pass"] == (ratio >= 0.7)


def test_apply_at_two_sizes_quick_run(tmp_path: Path) -> None:
    result = _bench(tmp_path, "--cold", "--small-scale", "8", "--large-scale", "9", "--edge-factor", "6",
                    "--cold-events", "300", "--batch", "100", "--repeat", "1")
    graphs = [result[size]["setup"]["graph"] for size in ("small", "large")]
    assert result["config"]["graph"] == "R-MAT" and all(g["kind"] == "R-MAT" for g in graphs)
    assert [g["nodes"] for g in graphs] == [256, 512] and all(0 < g["directed_edges"] <= 6 * g["nodes"]
                                                              for g in graphs)
    for mode in ("cold", "warm"):
        runs = {size: result[size][mode]["median_run"] for size in ("small", "large")}
        assert all(run["events"] == 300 and run["pending"] == 0 for run in runs.values()), mode
        summary = result["summary"][mode]
        ratio = runs["large"]["updates_per_second"] / runs["small"]["updates_per_second"]
        assert summary["large_over_small"] == round(ratio, 3) and summary["pass"] == (ratio >= 0.67), mode


def test_cold_graphs_of_either_kind() -> None:
    """``--cold-graph``: R-MAT draws (repeats dropped), or the scale bench's Chung-Lu graph with exactly
    ``round(edge_factor * 2^scale)`` distinct edges; and the option needs ``--cold``."""
    from bench.apply_cli import cold_graph, parse_args  # the repository's root is on the path (tests is a package)
    rmat, chung_lu = cold_graph("rmat", 8, 6.0, 0), cold_graph("chung-lu", 8, 6.0, 0)
    assert rmat.stats()["kind"] == "R-MAT" and rmat.num_nodes == 256 and 0 < rmat.num_edges <= 1536
    assert (chung_lu.num_nodes, chung_lu.num_edges, chung_lu.stats()["gamma"]) == (256, 1536, 2.5)
    assert chung_lu.features.shape == (256, 32)
    assert parse_args(["--cold", "--cold-graph", "chung-lu"]).cold_graph == "chung-lu"
    with pytest.raises(SystemExit):
        parse_args(["--cold-graph", "chung-lu"])
