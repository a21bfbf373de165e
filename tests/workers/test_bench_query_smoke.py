"""``bench/query.py`` runs at a tiny size: the synthetic graph's lookups and what-ifs (paced to a core budget)
and the payment stream's transaction scores (``--typed``, at a fixed rate) are answered beside the stream, and
the targets are judged from what was measured."""

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
@pytest.mark.parametrize("pacing", [
    ["--typed", "--accounts", "200", "--days", "10", "--train-epochs", "5", "--rate", "50", "--score-rps", "20"],
    ["--nodes", "1000", "--edges", "6000", "--lookup-rps", "50", "--infer-rps", "10", "--stream-cores", "1",
     "--stream-events", "2000"]], ids=["typed-fixed-rate", "core-budget"])
def test_query_bench_quick_run(tmp_path: Path, pacing: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.query", *pacing, "--warmup-events", "300", "--seconds", "2",
         "--fresh-warmup-s", "6", "--batch-size", "100", "--max-batch-size", "400", "--workdir", str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)  # exactly one JSON object on stdout
    typed = pacing[0] == "--typed"
    if typed:
        assert result["mode"] == "typed" and result["graph"]["trained"]["model"] == "model:1"
        assert result["config"]["stream_rate"] == 50 and "sustained" not in result  # --rate: no sustained run
        assert result["config"]["stream_cores_budget"] is None
    else:  # paced from the sustained run's CPU per event, at most to what the budget buys at that cost (rounded)
        per_event = result["sustained"]["after_warmup"]["cpu_us_per_event"]
        cap = 1e6 / sum(per_event[role] for role in ("worker", "delivery process", "broker"))
        assert result["config"]["stream_cores_budget"] == 1 and 0 < result["config"]["stream_rate"] <= cap * 1.01
    alone = result["cpu_cores"]["stream alone"]
    assert result["targets"]["stream_cores"] == round(sum(alone[r] for r in ("worker", "delivery process", "broker")), 3)
    kinds = {"score": 20} if typed else {"lookup": 50, "what_if_one_edge": 10}
    assert result["config"]["rps"] == kinds
    for kind, rps in kinds.items():
        load = result[kind]
        assert load["requests"] == load["answered"] == 2 * rps and load["statuses"] == {"200": 2 * rps}
        assert load["max_ms"] >= load["p99_ms"] >= load["p50_ms"] > 0 and load["achieved_rps"] > 0
        assert load["server_cpu_ms_per_request"] > 0  # the server's own CPU over the load, per answer
    window = result["stream_while_serving"]
    assert window["to_s"] > window["from_s"] >= 2
    latency = window["publish_minus_produce_per_batch"]
    assert latency["batches"] > 0 and latency["max_s"] >= latency["p99_s"] > 0
    targets = result["targets"]
    assert targets["all_200"] is True
    if typed:  # every score a 200: the transactions were scored by the trained head
        assert targets["score_p99_le_20ms"] == (result["score"]["p99_ms"] <= 20.0) and "lookup_p99_ms" not in targets
    else:
        assert targets["lookup_p99_le_5ms"] == (result["lookup"]["p99_ms"] <= 5.0)
        assert targets["what_if_p99_le_20ms"] == (result["what_if_one_edge"]["p99_ms"] <= 20.0)
    assert targets["stream_p99_le_1s"] == (latency["p99_s"] <= 1.0)
    assert list(tmp_path.iterdir()) == [], "the temporary states must be removed"
