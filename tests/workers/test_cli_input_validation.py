"""User mistakes on the command line: one ``error:`` line and exit status 2, never a traceback.

Numbers out of range are refused when the arguments are parsed (from a flag
or from its ``GNNSTREAM_*`` variable), before anything is opened or created;
paths that cannot work are named as the user gave them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

from gnnstream.workers.cli import build_parser, main
from gnnstream.workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


def run_cli(capsys: pytest.CaptureFixture, *argv: Any) -> tuple[int, str, str]:
    """``gnnstream ARGV`` in-process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse: usage errors, --help
        rc = exc.code if isinstance(exc.code, int) else 1
    except Exception:  # what the console script would show: a traceback, exit status 1
        out, err = capsys.readouterr()
        return 1, out, err + traceback.format_exc()
    out, err = capsys.readouterr()
    return rc, out, err


def usage_error(capsys: pytest.CaptureFixture, *argv: Any) -> str:
    """The last stderr line of a command that must stop with exit status 2 and print nothing on stdout."""
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2, f"gnnstream {' '.join(map(str, argv))} exited {rc}: {err[-1500:]}"
    assert out == "" and "Traceback" not in err, err[-1500:]
    return err.strip().splitlines()[-1]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("GNNSTREAM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("GNNSTREAM_NO_PROGRESS", "1")
    monkeypatch.setenv("COLUMNS", "250")


# ---------------------------------------------------------------------- 1. ports
@pytest.mark.parametrize("argv, expected", [
    (["run", "--metrics-port", "99999"],
     "argument --metrics-port: expected a port in 0..65535 (0 = off) (got '99999')"),
    (["run", "--metrics-port", "-1"], "argument --metrics-port: expected a port in 0..65535 (0 = off) (got '-1')"),
    (["run", "--query-port", "99999"], "argument --query-port: expected a port in 0..65535 (0 = off) (got '99999')"),
    (["serve", "--query-port", "-1"], "argument --query-port: expected a port in 0..65535 (0 = off) (got '-1')"),
    (["broker", "--port", "99999"], "argument --port: expected a port in 1..65535 (got '99999')"),
    (["broker", "--port", "0"], "argument --port: expected a port in 1..65535 (got '0')"),
])
def test_out_of_range_port_is_a_usage_error(capsys: pytest.CaptureFixture, argv: list[str], expected: str) -> None:
    line = usage_error(capsys, *argv)
    assert line == f"gnnstream {argv[0]}: error: {expected}"


def test_port_zero_keeps_its_meaning_and_the_ends_of_the_range_are_accepted() -> None:
    parser = build_parser()
    run = parser.parse_args(["run", "--metrics-port", "0", "--query-port", "65535"])
    assert (run.metrics_port, run.query_port) == (0, 65535)
    assert parser.parse_args(["broker", "--port", "1"]).port == 1
    assert parser.parse_args(["broker"]).port is None


# ---------------------------------------------------------------------- 2. numbers
@pytest.mark.parametrize("command, argv, expected", [
    ("run", ["--session-timeout-ms", "0"],
     "argument --session-timeout-ms: expected an integer in 1..3600000 (got '0')"),
    ("run", ["--max-event-bytes", "0"], "argument --max-event-bytes: expected an integer >= 1 (got '0')"),
    ("run", ["--hub-bound", "-1"], "argument --hub-bound: expected an integer >= 0 (got '-1')"),
    ("run", ["--max-staleness-s", "-1"], "argument --max-staleness-s: expected a finite number >= 0 (got '-1')"),
    ("run", ["--max-staleness-s", "nan"], "argument --max-staleness-s: expected a finite number >= 0 (got 'nan')"),
    ("run", ["--batch-wait-ms", "-100"], "argument --batch-wait-ms: expected an integer >= 0 (got '-100')"),
    ("run", ["--partitions", "0"], "argument --partitions: expected an integer >= 1 (got '0')"),
    ("run", ["--exit-when-idle", "-1"], "argument --exit-when-idle: expected a finite number >= 0 (got '-1')"),
    ("verify", ["--state", "s", "--atol", "nan"], "argument --atol: expected a finite number >= 0 (got 'nan')"),
    ("verify", ["--state", "s", "--atol", "-1"], "argument --atol: expected a finite number >= 0 (got '-1')"),
    ("apply", ["--state", "s", "e.jsonl", "--batch", "0"], "argument --batch: expected an integer >= 1 (got '0')"),
    ("apply", ["--state", "s", "e.jsonl", "--batch", "-5"], "argument --batch: expected an integer >= 1 (got '-5')"),
    ("apply", ["--state", "s", "e.jsonl", "--hub-bound", "-1"],
     "argument --hub-bound: expected an integer >= 0 (got '-1')"),
    ("graph load", ["--state", "s", "e.jsonl", "--batch", "0"], "argument --batch: expected an integer >= 1 (got '0')"),
    ("graph show", ["--state", "s", "n", "--limit", "-1"], "argument --limit: expected an integer >= 0 (got '-1')"),
    ("events from-snap", ["x.csv", "--out", "e.jsonl", "--limit", "-3"],
     "argument --limit: expected an integer >= 0 (0 = all) (got '-3')"),
    ("produce", ["e.jsonl", "--limit", "-1"], "argument --limit: expected an integer >= 0 (0 = all) (got '-1')"),
    ("produce", ["e.jsonl", "--rate", "inf"], "argument --rate: expected a finite number >= 0 (got 'inf')"),
    ("tail", ["--max", "-1"], "argument --max: expected an integer >= 0 (0 = no limit) (got '-1')"),
    ("tail", ["--idle", "-1"], "argument --idle: expected a finite number >= 0 (0 = never) (got '-1')"),
    ("serve", ["--state", "s", "--refresh", "0"], "argument --refresh: expected a finite number >= 0.01 (got '0')"),
])
def test_out_of_range_number_is_a_usage_error(capsys: pytest.CaptureFixture, command: str, argv: list[str],
                                              expected: str) -> None:
    assert usage_error(capsys, *command.split(), *argv) == f"gnnstream {command}: error: {expected}"


def test_numbers_in_range_are_accepted() -> None:
    parser = build_parser()
    assert parser.parse_args(["verify", "--state", "s", "--atol", "0"]).atol == 0.0
    assert parser.parse_args(["graph", "show", "--state", "s", "n", "--limit", "0"]).limit == 0
    run = parser.parse_args(["run", "--hub-bound", "0", "--max-staleness-s", "0", "--batch-wait-ms", "0",
                             "--session-timeout-ms", "6000"])
    assert (run.hub_bound, run.max_staleness_s, run.batch_wait_ms, run.session_timeout_ms) == (0, 0.0, 0, 6000)
    assert type(run.max_staleness_s) is float and type(run.hub_bound) is int


@pytest.mark.parametrize("name, value, expected", [
    ("GNNSTREAM_SESSION_TIMEOUT_MS", "0",
     "argument --session-timeout-ms: expected an integer in 1..3600000 (got '0' from GNNSTREAM_SESSION_TIMEOUT_MS)"),
    ("GNNSTREAM_METRICS_PORT", "99999",
     "argument --metrics-port: expected a port in 0..65535 (0 = off) (got '99999' from GNNSTREAM_METRICS_PORT)"),
    ("GNNSTREAM_MAX_STALENESS_S", "-1",
     "argument --max-staleness-s: expected a finite number >= 0 (got '-1' from GNNSTREAM_MAX_STALENESS_S)"),
])
def test_out_of_range_environment_value_names_the_variable(capsys: pytest.CaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                                           expected: str) -> None:
    monkeypatch.setenv(name, value)
    assert usage_error(capsys, "run") == f"gnnstream run: error: {expected}"
    field = name[len("GNNSTREAM_"):].lower()
    flag = "--" + field.replace("_", "-")
    assert getattr(build_parser().parse_args(["run", flag, "1000"]), field) == 1000  # the flag wins


def test_worker_settings_refuse_out_of_range_values_in_python_too() -> None:
    with pytest.raises(ValueError) as info:
        WorkerSettings(hub_bound=-1)
    assert str(info.value) == "hub_bound must be an integer >= 0 (got -1); set --hub-bound or GNNSTREAM_HUB_BOUND"
    with pytest.raises(ValueError) as info:
        WorkerSettings(metrics_port=70000)
    assert str(info.value).startswith("metrics_port must be a port in 0..65535 (0 = off) (got 70000)")
    with pytest.raises(ValueError, match="max_staleness_s must be a finite number >= 0"):
        WorkerSettings(max_staleness_s=float("nan"))
    assert WorkerSettings(hub_bound=0, metrics_port=0, batch_wait_ms=0, max_staleness_s=0.0).hub_bound == 0


# ---------------------------------------------------------------------- 3. model init --name
def test_model_init_checks_the_name_like_train(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    line = usage_error(capsys, "model", "init", tmp_path / "m", "--in-dim", "2", "--name", "bad name/x")
    assert line == ("gnnstream model init: error: argument --name: expected a name of letters, digits, '.', '_' "
                    "or '-' like otc-sage (got 'bad name/x')")
    assert not (tmp_path / "m").exists()
    version = usage_error(capsys, "model", "init", tmp_path / "m", "--in-dim", "2", "--version", "-1")
    assert version.endswith("argument --version: expected a non-negative whole number like 2 (got '-1')")
    train = usage_error(capsys, "train", "--events", "x.csv", "--out", tmp_path / "t", "--name", "bad name/x")
    assert train == line.replace("gnnstream model init:", "gnnstream train:")


# ---------------------------------------------------------------------- 4. messages
def test_output_in_a_missing_directory_names_it_not_the_temporary_file(capsys: pytest.CaptureFixture,
                                                                       tmp_path: Path) -> None:
    out = tmp_path / "nodir" / "e.jsonl"
    line = usage_error(capsys, "embeddings", "--state", tmp_path / "state", "--out", out)
    assert line == (f"gnnstream: error: [Errno 2] cannot write {str(out)!r}: no directory {str(out.parent)!r}; "
                    f"create it first or name another path")
    csv = tmp_path / "r.csv"
    csv.write_text("1,2,5,100\n2,3,-1,200\n")
    line = usage_error(capsys, "events", "from-snap", csv, "--out", out)
    assert ".tmp" not in line and f"no directory {str(out.parent)!r}" in line
    assert not (tmp_path / "state").exists() and not out.parent.exists()


@pytest.mark.parametrize("kind", ["directory", "named pipe"])
@pytest.mark.parametrize("command", [["apply"], ["graph", "load"]])
def test_events_path_that_is_no_regular_file_says_what_it_is(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                            kind: str, command: list[str]) -> None:
    events = tmp_path / "events"
    if kind == "directory":
        events.mkdir()
    else:
        os.mkfifo(events)
    line = usage_error(capsys, *command, "--state", tmp_path / "state", events)
    assert line == (f"gnnstream: error: events file {str(events)!r} is a {kind}; name a regular file of JSON lines, "
                    f"one event each")
    assert not (tmp_path / "state").exists()


def test_model_directory_without_files_names_the_commands_that_create_them(capsys: pytest.CaptureFixture,
                                                                           tmp_path: Path) -> None:
    events = tmp_path / "e.jsonl"
    events.write_text('{"op": "edge_upsert", "src": "a", "dst": "b", "ts": 1}\n')
    (tmp_path / "empty").mkdir()
    line = usage_error(capsys, "apply", "--state", tmp_path / "state", "--model", tmp_path / "empty", events)
    assert line == (f"gnnstream: error: model directory {str(tmp_path / 'empty')!r} has no config.json; a model "
                    f"directory needs config.json and weights.pt: create one with `gnnstream model init` or "
                    f"`gnnstream train` (save_model_dir in Python)")


def test_closed_stdout_pipe_ends_quietly(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away, as `gnnstream ... | head` once head has its lines
    try:
        result = subprocess.run([sys.executable, "-m", "gnnstream.workers.cli", "model", "init", str(tmp_path / "m"),
                                 "--in-dim", "2", "--hidden", "2", "--out-dim", "2", "--fanouts", "2,2"],
                                stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120,
                                env=dict(os.environ, GNNSTREAM_NO_PROGRESS="1"))
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")
    assert (tmp_path / "m" / "config.json").is_file()  # the work itself was done


# ---------------------------------------------------------------------- 7. help
def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.extend(_commands(sub, path + (name,)))
    return found or [path]


@pytest.mark.parametrize("command, option, text", [
    ("model init", "--arch {sage,gcn,gat}", "(default sage)"),
    ("model init", "--version VERSION", "(default 1)"),
    ("model init", "--name NAME", "(default model)"),
    ("train", "--hidden HIDDEN", "(default 64)"),
    ("train", "--out-dim OUT_DIM", "(default 32)"),
    ("train", "--fanouts FANOUTS", "(default 25,10)"),
    ("run", "--model MODEL", "default: the one the state uses (a new state needs it) (env GNNSTREAM_MODEL)"),
    ("serve", "--model MODEL", "(env GNNSTREAM_MODEL)"),
    ("events from-snap", "--limit LIMIT", "(default 0: all)"),
])
def test_help_explains_option_with_its_default(capsys: pytest.CaptureFixture, command: str, option: str,
                                               text: str) -> None:
    rc, out, _ = run_cli(capsys, *command.split(), "--help")
    assert rc == 0
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(option))
    entry = [lines[start]]
    entry += [line for line in lines[start + 1:start + 4] if line.startswith(" " * 10)]
    described = " ".join(" ".join(entry).split())
    assert text in described, described


def test_no_help_says_default_none_and_every_option_has_help(capsys: pytest.CaptureFixture) -> None:
    for path in _commands(build_parser()):
        rc, out, _ = run_cli(capsys, *path, "--help")
        assert rc == 0
        assert "default None" not in " ".join(out.split()), f"gnnstream {' '.join(path)} --help"
    parser = build_parser()
    for path in _commands(parser):
        sub = parser
        for name in path:
            sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        for action in sub._actions:
            assert action.help, f"gnnstream {' '.join(path)}: {action.option_strings or action.dest} has no help"
