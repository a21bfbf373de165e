"""The whole Bitcoin OTC stream replayed with ``gnnstream apply`` in three runs of the command, then ``verify``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gnnstream.model import init_model_dir
from tests.workers.reference import DATA_DIR, call_gnnstream
from gnnstream.workers.cli import main

DATA = DATA_DIR / "soc-sign-bitcoinotc.csv.gz"


@pytest.mark.slow  # the whole Bitcoin OTC stream
def test_full_otc_replay_in_three_runs_verifies(tmp_path: Path) -> None:
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
        done = call_gnnstream("apply", "--state", tmp_path / "state", "--model", tmp_path / "model", growing,
                              "--batch", "1000")
        assert done.returncode == 0, done.stderr[-2000:]
        summary = json.loads(done.stdout)
        assert summary["pending"] == 0 and summary["invalid"] == 0
        assert summary["events"] == end - applied  # only the lines added since the last run
        applied += summary["events"]
    assert applied == len(lines)
    done = call_gnnstream("verify", "--state", tmp_path / "state")
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["ok"] and report["nodes"] == 5881 and report["mismatched"] == 0
