"""The whole Bitcoin OTC stream replayed with ``gnnstream apply`` in three runs, then ``verify``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model import init_model_dir
from workers.cli import main

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "soc-sign-bitcoinotc.csv"


def test_full_otc_replay_in_three_runs_verifies(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    if not DATA.exists():
        pytest.fail(f"Bitcoin OTC data missing at {DATA}: the repository expects ../shared/data beside it")
    events = tmp_path / "otc.jsonl"
    assert main(["events", "from-snap", str(DATA), "--out", str(events)]) == 0
    lines = events.read_bytes().splitlines(keepends=True)
    assert len(lines) > 35_592  # every rating plus derived feature updates
    init_model_dir(tmp_path / "model", arch="sage", in_dim=8, hidden=32, out_dim=16, layers=2,
                   fanouts=[25, 10], seed=0)
    growing = tmp_path / "replay.jsonl"
    thirds = [len(lines) // 3, 2 * len(lines) // 3, len(lines)]
    applied = 0
    for end in thirds:  # the file grows between runs; each run resumes at the stored position
        growing.write_bytes(b"".join(lines[:end]))
        capsys.readouterr()
        assert main(["apply", "--state", str(tmp_path / "state"), "--model", str(tmp_path / "model"),
                     str(growing), "--batch", "1000"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["pending"] == 0 and summary["invalid"] == 0
        applied += summary["events"]
    assert applied == len(lines)
    assert main(["verify", "--state", str(tmp_path / "state")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["nodes"] == 5881 and report["mismatched"] == 0
