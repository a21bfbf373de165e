"""A state's identity at the command line: which commands create, change or only read a state.

Most checks run the real ``gnnstream`` command line (its ``main``, in this
process; in a process of its own where a lock is held) and look at what a
user sees: the exit status, the one error line on stderr, the JSON summary,
and the state directory's files before and after. A small synthetic graph
keeps each command short.
"""

from __future__ import annotations

import base64
import errno
import gc
import hashlib
import json
import os
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gnnstream.graph_state.exceptions import StateModelMismatch, StateNotFoundError, StateSeedMismatch
from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.events import EdgeUpsert
from tests.workers.reference import call_gnnstream, fast_tempdir, run_gnnstream
from gnnstream.workers.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

NODES = 80
EDGES = 400
DIM = 4
SEED = 3
ENV = dict(os.environ, GNNSTREAM_NO_PROGRESS="1", COLUMNS="200")


def error_line(res: subprocess.CompletedProcess) -> str:
    """The stderr of a command that failed: exactly one line, ``gnnstream: error: ...``, no traceback."""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(lines) == 1, f"expected one error line, got:\n{res.stderr[-3000:]}"
    assert lines[0].startswith("gnnstream: error: "), lines[0]
    return lines[0]


def strict_json(text: str) -> Any:
    """Parse JSON as the standard has it (no NaN or Infinity)."""
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} is not valid JSON:\n{text[:2000]}")
    return json.loads(text, parse_constant=refuse)


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` by relative name."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def event_lines(seed: int = 1, nodes: int = NODES, edges: int = EDGES) -> list[bytes]:
    """A random graph as JSONL lines: every node gets ``DIM`` features when it first appears."""
    rnd = random.Random(seed)
    seen: set[str] = set()
    out: list[bytes] = []
    for i in range(edges):
        src, dst = str(rnd.randrange(nodes)), str(rnd.randrange(nodes))
        for node in (src, dst):
            if node not in seen:
                seen.add(node)
                feats = [round(rnd.uniform(-1, 1), 4) for _ in range(DIM)]
                out.append(json.dumps({"op": "node_upsert", "id": node, "ts": i, "features": feats}).encode() + b"\n")
        out.append(json.dumps({"op": "edge_upsert", "src": src, "dst": dst, "ts": i}).encode() + b"\n")
    return out


@pytest.fixture(scope="module", autouse=True)
def _env() -> Any:
    mp = pytest.MonkeyPatch()
    mp.setenv("GNNSTREAM_NO_PROGRESS", "1")
    gc.collect()
    gc.freeze()  # GraphStore.close() runs gc.collect(); keep it cheap with torch loaded
    yield
    gc.unfreeze()
    mp.undo()


@pytest.fixture(scope="module")
def work() -> Any:
    with fast_tempdir() as d:
        yield Path(d)


@pytest.fixture
def tmp(work: Path, request: pytest.FixtureRequest) -> Path:
    path = work / request.node.name.replace("[", "_").replace("]", "_")
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def events(work: Path) -> Path:
    path = work / "events.jsonl"
    path.write_bytes(b"".join(event_lines()))
    return path


def _model(work: Path, name: str, *extra: Any) -> Path:
    path = work / name
    assert main([str(a) for a in ("model", "init", path, "--in-dim", DIM, "--hidden", 8, "--out-dim", 4,
                                  "--fanouts", "5,3", "--seed", SEED, *extra)]) == 0
    return path


@pytest.fixture(scope="module")
def models(work: Path) -> dict[str, Path]:
    return {
        "m": _model(work, "m"),
        "bigger": _model(work, "bigger", "--out-dim", "6"),  # same seed and tag, other dims and weights
        "m7": _model(work, "m7", "--seed", "7"),
    }


@pytest.fixture(scope="module")
def good(work: Path, events: Path, models: dict[str, Path]) -> Path:
    """A state with the embeddings of model ``m`` for the whole event file (built once, then copied)."""
    state = work / "good"
    assert main(["apply", "--state", str(state), "--model", str(models["m"]), str(events)]) == 0
    return state


def copy_state(good: Path, tmp: Path, name: str = "state") -> Path:
    dest = tmp / name
    shutil.copytree(good, dest)
    return dest


# ---------------------------------------------------------------------- read-only commands
def test_read_only_commands_refuse_a_missing_state_and_create_nothing(tmp: Path, events: Path,
                                                                     models: dict[str, Path]) -> None:
    typo = tmp / "typo"
    out = tmp / "emb.jsonl"
    for argv in (["verify", "--state", typo, "--model", models["m"]],
                 ["embeddings", "--state", typo, "--out", out],
                 ["graph", "show", "--state", typo, "1"],
                 ["backfill", "--state", typo, "--model", models["m"]],  # an empty new state has nothing to embed
                 ["apply", "--state", typo, events]):  # creates a state only with a model to take its seed from
        res = call_gnnstream(*argv)
        assert res.returncode == 2, (argv, res.stdout, res.stderr)
        line = error_line(res)
        assert f"state directory {str(typo)!r} does not exist" in line, line
        assert not typo.exists(), f"{argv[0]} created {typo}"
        assert res.stdout == ""
    assert not out.exists()


def test_a_missing_events_file_creates_no_state(tmp: Path, models: dict[str, Path]) -> None:
    state, missing = tmp / "new", tmp / "nosuch.jsonl"
    for argv in (["graph", "load", "--state", state, missing],
                 ["apply", "--state", state, "--model", models["m"], missing]):
        res = call_gnnstream(*argv)
        assert res.returncode == 2, (argv, res.stdout, res.stderr)
        assert "events file not found" in error_line(res) and str(missing) in error_line(res)
        assert not state.exists(), f"{argv[0]} created {state}"


def test_a_state_path_that_is_a_file_is_one_line(tmp: Path, events: Path, models: dict[str, Path]) -> None:
    plain = tmp / "plain"
    plain.write_bytes(b"not a state\n")
    for argv in (["verify", "--state", plain], ["apply", "--state", plain, "--model", models["m"], events],
                 ["graph", "load", "--state", plain, events]):
        res = call_gnnstream(*argv)
        assert res.returncode == 2, (argv, res.stdout, res.stderr)
        line = error_line(res)
        assert f"state path {str(plain)!r} is a file, not a state directory" in line, line
    assert plain.read_bytes() == b"not a state\n"


def test_verify_with_another_model_refuses_and_changes_nothing(tmp: Path, good: Path, events: Path,
                                                               models: dict[str, Path]) -> None:
    state = copy_state(good, tmp)
    before = tree_digest(state)
    res = call_gnnstream("verify", "--state", state, "--model", models["bigger"])
    assert res.returncode == 2, (res.stdout, res.stderr)
    line = error_line(res)
    assert "holds the embeddings of model model:1" in line and str(models["bigger"]) in line, line
    assert "weights_sha256" in line, line
    assert f"gnnstream backfill --state {state} --model {models['bigger']}" in line, line
    assert tree_digest(state) == before, "verify with another model changed the state's files"

    # nor does a plain verify, which still passes with the state's own model
    res = call_gnnstream("verify", "--state", state)
    summary = strict_json(res.stdout)
    assert res.returncode == 0 and summary["ok"] is True and summary["status"] == "ok", res.stdout + res.stderr
    assert summary["nodes"] == NODES and summary["model"] == "model:1"
    res = call_gnnstream("embeddings", "--state", state, "--out", "-")
    assert res.returncode == 0, res.stderr
    widths = {len(json.loads(line)["embedding"]) for line in res.stdout.splitlines()}
    assert widths == {4}
    assert tree_digest(state) == before, "verify or embeddings changed the state's files"

    # apply with another model is refused too; backfill is the one way to switch
    res = call_gnnstream("apply", "--state", state, "--model", models["bigger"], events)
    assert res.returncode == 2 and "gnnstream backfill" in error_line(res), res.stderr
    res = call_gnnstream("backfill", "--state", state, "--model", models["bigger"])
    assert res.returncode == 0, res.stderr
    res = call_gnnstream("verify", "--state", state)
    assert res.returncode == 0 and strict_json(res.stdout)["ok"] is True, res.stdout + res.stderr
    res = call_gnnstream("embeddings", "--state", state, "--out", "-")
    assert {len(json.loads(line)["embedding"]) for line in res.stdout.splitlines()} == {6}


def test_verify_reports_non_finite_rows_as_mismatches_in_valid_json(tmp: Path, good: Path) -> None:
    state = copy_state(good, tmp)
    rows = [p for p in state.iterdir() if p.name.startswith("final-rows-") and p.suffix == ".f32"]
    assert rows, sorted(p.name for p in state.iterdir())
    for path in rows:  # every stored final row becomes NaN (unused frames stay zero)
        data = np.fromfile(path, dtype="<f4")
        np.where(data != 0, np.float32(np.nan), data).astype("<f4").tofile(path)
    before = tree_digest(state)
    res = call_gnnstream("verify", "--state", state)
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    summary = strict_json(res.stdout)
    assert summary["ok"] is False and summary["status"] == "mismatch", summary
    assert summary["mismatched"] == NODES and summary["nodes"] == NODES, summary
    assert summary["non_finite"] + summary["missing"] == NODES, summary
    assert isinstance(summary["max_abs_error"], float) and np.isfinite(summary["max_abs_error"])
    assert tree_digest(state) == before, "verify changed the state's files"


def test_verify_tells_pending_work_from_a_mismatch(tmp: Path, good: Path, models: dict[str, Path]) -> None:
    state = copy_state(good, tmp)
    with GraphStore(state) as store:  # events applied without their recompute: dirty marks wait
        store.apply([EdgeUpsert("0", "new-node", 10_000.0, 1.0), EdgeUpsert("1", "0", 10_001.0, 1.0)])
    res = call_gnnstream("verify", "--state", state)
    summary = strict_json(res.stdout)
    assert res.returncode == 3, (res.returncode, summary, res.stderr)
    assert summary["status"] == "pending" and summary["ok"] is False, summary
    assert summary["pending_dirty"] > 0 and summary["non_finite"] == 0, summary

    empty = tmp / "nothing.jsonl"
    empty.write_bytes(b"")
    assert call_gnnstream("apply", "--state", state, empty).returncode == 0  # finishes the work
    res = call_gnnstream("verify", "--state", state)
    summary = strict_json(res.stdout)
    assert res.returncode == 0 and summary["status"] == "ok" and summary["pending_dirty"] == 0, summary


# ---------------------------------------------------------------------- creating a state
def test_graph_load_with_a_seed_7_model_then_apply(tmp: Path, events: Path, models: dict[str, Path]) -> None:
    state = tmp / "state"
    res = call_gnnstream("graph", "load", "--state", state, "--model", models["m7"], "--seed", "3", events)
    assert res.returncode == 2 and "--seed 3 disagrees with model" in error_line(res), res.stderr
    assert not state.exists()
    res = call_gnnstream("graph", "load", "--state", state, "--model", models["m7"], events)
    assert res.returncode == 0, res.stderr
    summary = strict_json(res.stdout)
    assert summary["seed"] == 7 and summary["nodes"] == NODES and summary["invalid"] == 0, summary
    res = call_gnnstream("apply", "--state", state, "--model", models["m7"], events)
    assert res.returncode == 0, res.stderr
    res = call_gnnstream("verify", "--state", state)
    assert res.returncode == 0 and strict_json(res.stdout)["ok"] is True, res.stdout + res.stderr
    # the seed-3 model does not fit the seed-7 state: one line, both seeds named
    res = call_gnnstream("apply", "--state", state, "--model", models["m"], events)
    line = error_line(res)
    assert res.returncode == 2 and "samples with seed 7" in line and "seed 3" in line, line


def test_open_store_takes_the_seed_from_the_model(tmp: Path, models: dict[str, Path]) -> None:
    """What ``run`` does (``Worker.run`` opens its state this way): a fresh state gets the model's seed."""
    from gnnstream.workers.state import open_engine, open_store
    fresh = tmp / "fresh"
    with pytest.raises(StateNotFoundError, match="does not exist"):
        open_store(fresh, create=False, model_dir=str(models["m7"]))
    assert not fresh.exists()
    with pytest.raises(StateNotFoundError, match="pass --model"):
        open_store(fresh, create=True)  # nothing says which seed
    assert not fresh.exists()
    with open_store(fresh, create=True, model_dir=str(models["m7"])) as store:
        assert store.seed == 7
        engine = open_engine(store, str(models["m7"]))
        engine.backfill()
    with pytest.raises(StateSeedMismatch, match="seed 7"):
        open_store(fresh, create=True, model_dir=str(models["m"]))
    other = _model(tmp, "m7-other", "--seed", "7", "--out-dim", "6")
    with open_store(fresh, create=True, model_dir=str(other)) as store:
        with pytest.raises(StateModelMismatch, match="backfill"):
            open_engine(store, str(other))
        assert open_engine(store, str(other), switch_model=True).model_tag == "model:1"


# ---------------------------------------------------------------------- bad lines
def _report(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_wrong_length_feature_line_is_skipped_counted_and_reported(tmp: Path, events: Path,
                                                                     models: dict[str, Path]) -> None:
    lines = event_lines()
    bad_short = json.dumps({"op": "node_upsert", "id": "5", "ts": 50, "features": [1.0, 2.0]}).encode() + b"\n"
    bad_bytes = b'{"op":"edge_upsert","src":"\xff","dst":"1","ts":1}\n'
    mixed = lines[:100] + [bad_short] + lines[100:300] + [bad_bytes] + lines[300:]
    path = tmp / "mixed.jsonl"
    path.write_bytes(b"".join(mixed[:250]))
    state = tmp / "state"
    letters = tmp / "dead.jsonl"
    argv = ("apply", "--state", state, "--model", models["m"], path, "--batch", 40, "--dead-letters", letters)
    res = call_gnnstream(*argv)
    assert res.returncode == 0, res.stderr
    first = strict_json(res.stdout)
    assert first["events"] == 249 and first["invalid"] == 1, first
    assert first["invalid_reasons"] == {"wrong_feature_length": 1}
    report = state / "invalid-mixed.jsonl"
    assert first["report"] == str(report) and first["dead_letters"] == str(letters)
    assert "skipped 1 invalid lines" in res.stderr and str(report) in res.stderr
    assert [(r["line"], r["reason"]) for r in _report(report)] == [(101, "wrong_feature_length")]
    assert _report(report)[0]["file"] == str(path.resolve())
    assert "has 2 features, the model expects 4" in _report(report)[0]["detail"]

    # the rest of the file, with a line that is not UTF-8: the rerun continues, never stops at the bad lines
    path.write_bytes(b"".join(mixed))
    res = call_gnnstream(*argv)
    assert res.returncode == 0, res.stderr
    second = strict_json(res.stdout)
    assert second["events"] == len(lines) - 249 and second["invalid"] == 1, second
    assert second["invalid_reasons"] == {"not_utf8": 1}
    res = call_gnnstream(*argv)  # nothing new: nothing counted twice
    third = strict_json(res.stdout)
    assert res.returncode == 0 and third["events"] == 0 and third["invalid"] == 0, third
    assert [(r["line"], r["reason"]) for r in _report(report)] == [(101, "wrong_feature_length"), (302, "not_utf8")]
    dead = _report(letters)
    assert [(d["line"], d["reason"]) for d in dead] == [(101, "wrong_feature_length"), (302, "not_utf8")]
    assert dead[0]["value"].encode() + b"\n" == bad_short
    assert base64.b64decode(dead[1]["value_base64"]) + b"\n" == bad_bytes

    res = call_gnnstream("verify", "--state", state)
    assert res.returncode == 0 and strict_json(res.stdout)["ok"] is True, res.stdout + res.stderr
    res = call_gnnstream("graph", "show", "--state", state, "5")
    shown = strict_json(res.stdout)
    want = next(json.loads(line)["features"] for line in lines if b'"id": "5"' in line)
    np.testing.assert_allclose(shown["features"], want, atol=1e-6)


def test_bad_lines_after_a_crash_are_reported_once(tmp: Path, models: dict[str, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that dies after writing a batch's report records but before committing the batch: the rerun
    finds those lines again, and the report holds each bad line once."""
    from gnnstream.workers.offline import jobs as offline
    lines = event_lines()
    bad = [json.dumps({"op": "node_upsert", "id": str(i), "ts": 1, "features": [0.5] * (DIM + 1)}).encode() + b"\n"
           for i in range(3)]
    mixed = lines[:50] + [bad[0]] + lines[50:120] + [bad[1], b"not json\n"] + lines[120:200] + [bad[2]] + lines[200:]
    path = tmp / "events.jsonl"
    path.write_bytes(b"".join(mixed))
    bad_lines = [i + 1 for i, line in enumerate(mixed) if line in bad or line == b"not json\n"]
    state = tmp / "state"
    report = tmp / "report.jsonl"
    real_apply = GraphStore.apply
    calls = {"n": 0}

    def dying_apply(self: GraphStore, events: Any, offsets: Any = None, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt("killed")  # after the batch's report was written, before its commit
        return real_apply(self, events, offsets, **kwargs)

    monkeypatch.setattr(GraphStore, "apply", dying_apply)
    with pytest.raises(KeyboardInterrupt):
        offline.apply_events(str(state), str(models["m"]), str(path), batch=40, report=str(report))
    monkeypatch.setattr(GraphStore, "apply", real_apply)
    # batches of 40 events end at lines 40, 81, 121 and 163: the dying 4th batch had put 122 and 123 on record
    assert bad_lines == [51, 122, 123, 204]
    assert [r["line"] for r in _report(report)] == [51, 122, 123]
    summary = offline.apply_events(str(state), str(models["m"]), str(path), batch=40, report=str(report))
    assert [r["line"] for r in _report(report)] == bad_lines
    assert summary["pending"] == 0
    again = offline.apply_events(str(state), None, str(path), batch=40, report=str(report))
    assert again["events"] == 0 and again["invalid"] == 0
    assert [r["line"] for r in _report(report)] == bad_lines
    assert offline.verify(str(state))["ok"] is True


# ---------------------------------------------------------------------- --out files and error lines
def test_embeddings_out_keeps_the_old_file_when_the_state_is_locked(tmp: Path, good: Path) -> None:
    state = copy_state(good, tmp)
    out = tmp / "emb.jsonl"
    out.write_text("precious\n")
    with GraphStore(state):  # a worker holds the state
        res = run_gnnstream("embeddings", "--state", state, "--out", out)
    assert res.returncode == 2, (res.stdout, res.stderr)
    line = error_line(res)
    assert "locked by another process" in line and str(state) in line, line
    assert out.read_text() == "precious\n"
    assert sorted(p.name for p in tmp.iterdir()) == ["emb.jsonl", "state"], "a temporary file was left behind"
    res = call_gnnstream("embeddings", "--state", state, "--out", out)  # free again: the file is replaced whole
    assert res.returncode == 0, res.stderr
    assert len(out.read_text().splitlines()) == NODES


def test_out_files_are_replaced_only_when_complete(tmp: Path) -> None:
    from gnnstream.workers.atomic import atomic_output
    out = tmp / "file.jsonl"
    out.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_output(str(out)) as fh:
            fh.write("half")
            raise RuntimeError("the command failed part-way")
    assert out.read_text() == "old\n"
    assert [p.name for p in tmp.iterdir()] == ["file.jsonl"]
    with atomic_output(str(out), "wb") as fh:
        fh.write(b"new\n")
    assert out.read_bytes() == b"new\n"
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _rocksdb(message: str) -> Exception:
    return Exception(message)  # rocksdict raises a plain Exception carrying RocksDB's status text


def _kafka_down() -> Exception:
    from kafka.errors import KafkaTimeoutError
    return KafkaTimeoutError("Failed to update metadata after 60.0 secs.")


def _stream_error() -> Exception:
    from gnnstream.stream.exceptions import TopicSetupError
    return TopicSetupError("topic graph-events could not be created on localhost:9092: broker down; start it")


ERRORS = {
    "lock": (lambda: _rocksdb("IO error: While lock file: /s/LOCK: Resource temporarily unavailable"),
             ["locked by another process", "one process per state"]),
    "corruption": (lambda: _rocksdb("Corruption: block checksum mismatch: stored = 1, computed = 2 in /s/000012.sst"),
                   ["000012.sst is damaged", "restore a snapshot of the state directory", "`gnnstream graph load`",
                    "`gnnstream backfill`"]),
    "rocksdb_disk_full": (lambda: _rocksdb("IO error: No space left on device: While appending to file: /s/000009.log"),
                          ["no space left", "free some space"]),
    "rocksdb_after_failed_write": (lambda: _rocksdb("IO error: Writer has previous error.; IO error: Writer has "
                                                    "previous error."),
                                   ["an earlier write failed", "full disk", "free some space"]),
    "read_only_fs": (lambda: OSError("Read-only file system (os error 30)"),  # as rocksdict raises it: no errno
                     ["Read-only file system", "copy it to a writable directory"]),
    "disk_full": (lambda: OSError(errno.ENOSPC, "No space left on device", "/s/final-rows-4.f32"),
                  ["No space left on device", "final-rows-4.f32", "free some space"]),
    "permission": (lambda: PermissionError(errno.EACCES, "Permission denied", "/s/LOCK"),
                   ["Permission denied", "/s/LOCK", "permissions"]),
    "kafka": (_kafka_down, ["Kafka: KafkaTimeoutError: Failed to update metadata", "reachable"]),
    "stream": (_stream_error, ["graph-events", "broker down"]),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_are_one_line_and_v_shows_the_traceback(case: str, tmp: Path, capsys: pytest.CaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from gnnstream.workers.offline import jobs as offline
    make, words = ERRORS[case]

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise make()

    monkeypatch.setattr(offline, "verify", failing)
    capsys.readouterr()
    assert main(["verify", "--state", str(tmp)]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("gnnstream: error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    if case in ("lock", "corruption", "rocksdb_disk_full", "rocksdb_after_failed_write", "read_only_fs"):
        assert repr(str(tmp)) in lines[0], lines[0]  # names the state directory
    with pytest.raises(type(make())):
        main(["-v", "verify", "--state", str(tmp)])
