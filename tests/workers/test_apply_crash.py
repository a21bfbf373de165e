"""``gnnstream apply`` survives SIGKILL at any moment and resumes exactly.

A subprocess applies ~4,000 Bitcoin OTC events in batches of 50 and is
SIGKILLed at moments spread over its working time, ten times (a run that
finishes before its kill does not count); after each kill the same ``apply``
command is run once more and must complete, then ``verify`` must exit 0 and
the exported embeddings must equal the independent PyG reference.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.workers.reference import (DATA_DIR, assert_embeddings_close, fast_tempdir, fold_jsonl, gnnstream_command,
                                     reference_embeddings)
from gnnstream.workers.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.xdist_group("crash-loops")]  # kills spread over its run time: not beside another loop

OTC = DATA_DIR / "soc-sign-bitcoinotc.csv.gz"
RATINGS = 2_400  # -> about 4,100 events with the derived node_upsert events
TRIALS = 10
BATCH = 50


def _cli(capsys: pytest.CaptureFixture, *argv: Any) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> float:
    start = time.monotonic()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"apply exited with {proc.returncode} before creating {path}: "
                                 f"{proc.stderr.read().decode(errors='replace')[-2000:]}")
        if time.monotonic() - start > timeout:
            raise AssertionError(f"apply did not create {path} within {timeout} s")
        time.sleep(0.005)
    return time.monotonic()


def _wal_bytes(state: Path) -> int:
    """Bytes in the state's RocksDB write-ahead log: grows with every batch an apply run writes."""
    total = 0
    try:
        entries = list(os.scandir(state))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if entry.name.endswith(".log"):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
    return total


def _export(capsys: pytest.CaptureFixture, state: Path, out: Path) -> dict[str, list[float]]:
    rc, _, err = _cli(capsys, "embeddings", "--state", state, "--out", out)
    assert rc == 0, err
    with open(out) as fh:
        return {rec["id"]: rec["embedding"] for rec in map(json.loads, fh)}


def test_apply_resumes_exactly_after_sigkill(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setenv("GNNSTREAM_NO_PROGRESS", "1")
    env = dict(os.environ, GNNSTREAM_NO_PROGRESS="1")
    gc.collect()
    gc.freeze()  # GraphStore.close() runs gc.collect(); keep it cheap with torch + PyG loaded
    work = tmp_path_factory.mktemp("crash")
    events = work / "otc.jsonl"
    model = work / "model"
    assert main(["events", "from-snap", str(OTC), "--out", str(events), "--limit", str(RATINGS)]) == 0
    assert main(["model", "init", str(model), "--arch", "gcn", "--in-dim", "8", "--hidden", "16", "--out-dim", "8",
                 "--fanouts", "10,5", "--seed", "5"]) == 0
    n_events = len(events.read_bytes().splitlines())
    assert n_events > 3_500
    fold = fold_jsonl(events)
    reference = reference_embeddings(fold.nodes, fold.edges, fold.features, model)
    rnd = random.Random(20240611)
    procs: list[subprocess.Popen] = []
    try:
        with fast_tempdir() as root:
            root = Path(root)
            apply_args = ("apply", "--model", model, events, "--batch", BATCH)

            # calibration: how much an uninterrupted run writes to its write-ahead log; kills are
            # placed by that progress measure, not by wall time, so that a loaded machine does not
            # push them all to the start or past the end of the run
            clean = root / "clean"
            proc = subprocess.Popen(gnnstream_command(apply_args[0], "--state", clean, *apply_args[1:]), env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(proc)
            ready = _wait_for(clean, proc)
            wal_total = 0
            while proc.poll() is None:
                wal_total = max(wal_total, _wal_bytes(clean))
                time.sleep(0.002)
            work_s = time.monotonic() - ready
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
            assert json.loads(out)["events"] == n_events
            assert wal_total > 0
            assert_embeddings_close(_export(capsys, clean, root / "clean.jsonl"), reference,
                                    what="uninterrupted apply vs PyG reference")

            def spawn(state: Path) -> subprocess.Popen:
                proc = subprocess.Popen(gnnstream_command(apply_args[0], "--state", state, *apply_args[1:]), env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                procs.append(proc)
                return proc

            killed, runs, progress = 0, 0, []
            upcoming = spawn(root / "s0")
            while killed < TRIALS:
                assert runs < 2 * TRIALS, f"only {killed} of {runs} runs were still working when their kill came"
                state = root / f"s{runs}"
                proc = upcoming
                _wait_for(state, proc)
                # stratified over the run's progress, so kills land early, in the middle and late; a run that
                # finished before its kill came is not a trial, and the next one aims a little earlier
                target = wal_total * (killed + rnd.random()) / TRIALS * 0.9 ** (runs - killed)
                while proc.poll() is None and _wal_bytes(state) < target:
                    time.sleep(0.001)
                hit = proc.poll() is None
                if hit:
                    proc.send_signal(signal.SIGKILL)
                    killed += 1
                proc.wait(timeout=60)
                proc.stderr.close()
                runs += 1
                # the next victim starts up (imports torch) while this trial is checked
                upcoming = spawn(root / f"s{runs}") if killed < TRIALS else None
                if not hit:
                    continue

                # rerun the same command once: it must complete
                rc, out, err = _cli(capsys, apply_args[0], "--state", state, *apply_args[1:])
                assert rc == 0, f"trial {killed}: apply after SIGKILL failed: {err[-2000:]}"
                summary = json.loads(out)
                assert summary["pending"] == 0
                progress.append(n_events - summary["events"])

                rc, out, err = _cli(capsys, "verify", "--state", state)
                verified = json.loads(out)
                assert rc == 0 and verified["ok"] is True, f"trial {killed}: verify after SIGKILL: {verified} {err}"
                assert verified["nodes"] == len(fold.nodes)
                assert_embeddings_close(_export(capsys, state, root / f"s{killed}.jsonl"), reference,
                                        what=f"trial {killed} (killed after {progress[-1]} events) vs PyG reference")

            print(f"apply works {work_s:.2f} s, writes {wal_total} WAL bytes; killed {killed} of {runs} runs; "
                  f"events applied before each kill: {progress}")
            mid_run = [p for p in progress if 0 < p < n_events]
            assert len(mid_run) >= 3, f"too few kills landed in the middle of the event file: {progress}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        gc.unfreeze()
