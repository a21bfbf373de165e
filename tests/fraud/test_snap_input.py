"""SNAP signed-network CSV input (``fraud.datasets.read_snap``) as a user gives it: good files read as before,
and a mistake is one ``gnnstream: error: FILE, line N: ...`` line with exit status 2 from every command that
reads it (``events from-snap``, ``produce --format snap``, ``train --events``), never a traceback."""

from __future__ import annotations

import gzip
import hashlib
import json
import traceback
from pathlib import Path
from typing import Any

import pytest

from gnnstream.fraud.datasets import BITCOIN_ALPHA, BITCOIN_OTC

from gnnstream.fraud.train import train_fraud_model
from gnnstream.stream.snap import SnapRating, read_snap, snap_events
from tests.workers.reference import run_gnnstream
from gnnstream.workers.cli import main
from gnnstream.workers.offline.replay import iter_file_messages

EXPECTED = "expected SOURCE,TARGET,RATING,TIME per line"
NOT_SNAP = "expected a SNAP signed-network CSV (source,target,rating,time)"


def run_cli(capsys: pytest.CaptureFixture, *argv: Any) -> tuple[int, str, str]:
    """``gnnstream ARGV`` in-process: (exit status, stdout, stderr) as a user would see them."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
        rc = code if isinstance(code, int) else (0 if code is None else 1)
    except Exception:  # what the console script would print: a traceback, exit status 1
        out, err = capsys.readouterr()
        return 1, out, err + traceback.format_exc()
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error(rc: int, err: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gnnstream: error: "), err
    return lines[0]


# (file name, content, the line of the error, what the error says) -- None: no line, the file holds no rating
BAD = [
    ("short.csv", "6,2,4,1289241911\n6,5\n", 2, "2 fields '6,5'"),
    ("long.csv", "6,2,4,1289241911,7\n", 1, "5 fields '6,2,4,1289241911,7'"),
    ("nan_time.csv", "6,2,4,1289241911\n6,5,1,nan\n", 2, "time 'nan' is not a finite number"),
    ("inf_time.csv", "source,target,rating,time\n6,5,1,inf\n", 2, "time 'inf' is not a finite number"),
    ("inf_rating.csv", "6,5,-Infinity,1289241911\n", 1, "rating '-Infinity' is not a finite number"),
    ("nan_rating.csv", "6,5,NaN,1289241911\n", 1, "rating 'NaN' is not a finite number"),
    ("x_rating.csv", "6,2,4,1289241911\n\n6,5,x,1289241912\n", 3, "rating 'x' is not a number"),
    ("x_time.csv", "6,2,4,1289241911\n6,5,1,\n", 2, "time '' is not a number"),
    ("target.csv", "6,2,4,1289241911\n6,bob,1,1289241912\n", 2, "target 'bob' is not an integer node id"),
    ("two_headers.csv", "source,target,rating,time\nsrc,dst,r,t\n6,2,4,1289241911\n", 2,
     "source 'src' is not an integer node id"),
    ("late_text.csv", "6,2,4,1289241911\nsource,target,rating,time\n", 2, "source 'source' is not an integer"),
    ("binary.csv", "6,2,4,1289241911\n", 2, "not UTF-8 text (a binary file?)"),  # + bytes below
    ("otc.jsonl", '{"op":"edge_upsert","src":"6","dst":"2","ts":1,"weight":4}\n'
                  '{"op":"node_upsert","id":"6","ts":1,"features":[1.0]}\n', None, NOT_SNAP),
    ("README.md", "# gnnstream\n\nStreaming GNN inference, see docs/.\n", None, NOT_SNAP),
    ("empty.csv", "", None, NOT_SNAP),
    ("header_only.csv", "source,target,rating,time\n\n", None, NOT_SNAP),
]


def _write(tmp_path: Path, name: str, content: str) -> Path:
    path = tmp_path / name
    path.write_text(content)
    if name == "binary.csv":
        with path.open("ab") as fh:
            fh.write(b"\x89PNG\xff\xfe,1,2,3\n")
    return path


def _message(path: Path, line: int | None, says: str) -> str:
    return f"{path}, line {line}: {says}" if line else f"no ratings read from {path}: {says}"


@pytest.mark.parametrize(("name", "content", "line", "says"), BAD, ids=[b[0] for b in BAD])
def test_read_snap_names_file_and_line(tmp_path: Path, name: str, content: str, line: int | None,
                                       says: str) -> None:
    path = _write(tmp_path, name, content)
    with pytest.raises(ValueError) as info:
        read_snap(path)
    text = str(info.value)
    assert text.startswith(_message(path, line, says)), text
    assert "\n" not in text
    if line:
        assert EXPECTED in text


@pytest.mark.parametrize(("name", "content", "line", "says"), BAD, ids=[b[0] for b in BAD])
def test_events_from_snap_refuses_bad_input(capsys: pytest.CaptureFixture, tmp_path: Path, name: str,
                                            content: str, line: int | None, says: str) -> None:
    path = _write(tmp_path, name, content)
    out = tmp_path / "events.jsonl"
    rc, stdout, err = run_cli(capsys, "events", "from-snap", path, "--out", out)
    assert _one_error(rc, err).startswith(f"gnnstream: error: {_message(path, line, says)}"), err
    assert stdout == "" and not out.exists()


def test_events_from_snap_gzipped_bad_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    path = tmp_path / "bad.csv.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("6,2,4,1289241911\n6,5,1,1289241912\n6,7,1,1e400\n")
    rc, _, err = run_cli(capsys, "events", "from-snap", path, "--out", tmp_path / "x.jsonl")
    assert _one_error(rc, err).startswith(f"gnnstream: error: {path}, line 3: time '1e400' is not a finite")


def test_damaged_gzip_is_one_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    path = tmp_path / "cut.csv.gz"
    path.write_bytes(BITCOIN_OTC.read_bytes()[:4000])
    rc, _, err = run_cli(capsys, "events", "from-snap", path, "--out", tmp_path / "x.jsonl")
    assert _one_error(rc, err).startswith(f"gnnstream: error: {path}: damaged gzip file"), err


def test_events_from_snap_subprocess_short_row(tmp_path: Path) -> None:
    """The reviewer's command, as a user runs it: no IndexError traceback, exit 2."""
    path = tmp_path / "short.csv"
    path.write_text("6,2,4,1289241911\n6,5\n")
    proc = run_gnnstream("events", "from-snap", path, "--out", tmp_path / "x.jsonl", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"gnnstream: error: {path}, line 2: 2 fields '6,5'; expected "
                                   f"SOURCE,TARGET,RATING,TIME per line (integer node ids, finite numbers; one "
                                   f"header line at the top optional; plain or gzipped)")
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize(("name", "content", "line", "says"), [b for b in BAD if b[0] in
                                                               ("short.csv", "nan_time.csv", "otc.jsonl")],
                         ids=["short.csv", "nan_time.csv", "otc.jsonl"])
def test_train_refuses_bad_input(capsys: pytest.CaptureFixture, tmp_path: Path, name: str, content: str,
                                 line: int | None, says: str) -> None:
    path = _write(tmp_path, name, content)
    with pytest.raises(ValueError) as info:
        train_fraud_model(path, tmp_path / "m", epochs=1)
    assert str(info.value).startswith(_message(path, line, says)), str(info.value)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(("name", "content", "line", "says"), [b for b in BAD if b[0] in
                                                               ("short.csv", "inf_time.csv", "x_rating.csv",
                                                                "otc.jsonl")],
                         ids=["short.csv", "inf_time.csv", "x_rating.csv", "otc.jsonl"])
def test_produce_format_snap_reader_refuses_bad_input(tmp_path: Path, name: str, content: str, line: int | None,
                                                      says: str) -> None:
    """``produce --format snap`` reads the file with ``iter_file_messages``: the same errors, before sending."""
    path = _write(tmp_path, name, content)
    with pytest.raises(ValueError) as info:
        list(iter_file_messages(str(path), "snap"))
    assert str(info.value).startswith(_message(path, line, says))


@pytest.mark.broker
def test_produce_format_snap_cli(capsys: pytest.CaptureFixture, tmp_path: Path, broker: Any,
                                 unique_name: Any) -> None:
    path = _write(tmp_path, "short.csv", "6,2,4,1289241911\n6,5\n")
    rc, stdout, err = run_cli(capsys, "produce", path, "--format", "snap", "--bootstrap", broker.bootstrap,
                              "--events-topic", unique_name("snap"))
    assert _one_error(rc, err).startswith(f"gnnstream: error: {path}, line 2: 2 fields '6,5'"), err
    assert stdout == ""


def test_header_blank_lines_bom_and_gzip_still_read(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    plain = tmp_path / "plain.csv"
    plain.write_text("\n6,2,4,1289241912\n\n7, 6 ,-10,1289241911.5\r\n")
    headed = tmp_path / "headed.csv.gz"
    with gzip.open(headed, "wb") as fh:
        fh.write(b"\xef\xbb\xbfsource,target,rating,time\n6,2,4,1289241912\n7,6,-10,1289241911.5\n")
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf6,2,4,1289241912\n7,6,-10,1289241911.5\n")
    expected = [SnapRating("7", "6", -10.0, 1289241911.5), SnapRating("6", "2", 4.0, 1289241912.0)]
    for path in (plain, headed, bom):
        assert read_snap(path) == expected, path
    rc, stdout, err = run_cli(capsys, "events", "from-snap", headed, "--out", tmp_path / "e.jsonl")
    assert rc == 0, err
    assert json.loads(stdout)["ratings"] == 2
    assert len((tmp_path / "e.jsonl").read_text().splitlines()) == len(list(snap_events(expected)))


@pytest.mark.parametrize(("path", "count", "sha256"), [
    (BITCOIN_OTC, 35592, "540df0ac8230cbf4eb5d09369e9685083cdadd3f0b1e74b1eb0a27ce0ab94503"),
    (BITCOIN_ALPHA, 24186, "5322ce70b5d29c963c085514706b019a569889db2b5ea905ce0dc83a7842268e"),
], ids=["otc", "alpha"])
def test_shipped_networks_read_as_before(path: Path, count: int, sha256: str) -> None:
    """The shipped files (OTC without a header, Alpha with one) give the rows they gave before strict parsing."""
    rows = read_snap(path)
    digest = hashlib.sha256()
    for r in rows:
        digest.update(repr((r.src, r.dst, r.rating, r.ts)).encode() + b"\n")
    assert (len(rows), digest.hexdigest()) == (count, sha256)
