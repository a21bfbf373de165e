"""The offline commands on real data, through ``workers.cli.main`` in-process.

``events from-snap`` on the first 6,000 Bitcoin OTC ratings, then either
``graph load`` + ``backfill`` + ``embeddings`` or ``apply`` in three runs over
a growing file: every embedding must equal the independent PyG reference of
:mod:`tests.workers.reference`, and ``verify`` must say ok.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.workers.reference import (
    DATA_DIR,
    GraphFold,
    assert_embeddings_close,
    bottom_k,
    expected_modes,
    fast_tempdir,
    fold_jsonl,
    neighbourhoods,
    reference_embeddings,
)
from gnnstream.workers.cli import build_parser, main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

OTC = DATA_DIR / "soc-sign-bitcoinotc.csv.gz"
RATINGS = 6_000
SEED = 3
ARCHS = {"sage": [], "gcn": [], "gat": ["--heads", "2"]}


def run_cli(capsys: pytest.CaptureFixture, *argv: Any) -> tuple[int, str, str]:
    """``gnnstream ARGV`` in-process: (exit status, stdout, stderr) as a user would see them."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse (--help, usage errors) or SystemExit("message")
        code = exc.code
        rc = code if isinstance(code, int) else (0 if code is None else 1)
        out, err = capsys.readouterr()
        return rc, out, err + ("" if isinstance(code, (int, type(None))) else f"{code}\n")
    except Exception:  # what the console script would print: a traceback, exit status 1
        out, err = capsys.readouterr()
        return 1, out, err + traceback.format_exc()
    out, err = capsys.readouterr()
    return rc, out, err


def _ok(result: tuple[int, str, str], what: str) -> str:
    rc, out, err = result
    assert rc == 0, f"{what} exited {rc}: {err[-2000:]}"
    return out


@pytest.fixture(scope="module", autouse=True)
def _env() -> Any:
    mp = pytest.MonkeyPatch()
    mp.setenv("GNNSTREAM_NO_PROGRESS", "1")
    mp.setenv("COLUMNS", "200")
    gc.collect()
    gc.freeze()  # GraphStore.close() runs gc.collect(); keep it cheap with torch + PyG loaded
    yield
    gc.unfreeze()
    mp.undo()


@pytest.fixture
def tmp_path() -> Any:
    """State directories on tmpfs when available (overrides pytest's tmp_path here)."""
    with fast_tempdir() as d:
        yield Path(d)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("offline")


@pytest.fixture(scope="module")
def events_file(work: Path) -> Path:
    out = work / "otc.jsonl"
    rc = main(["events", "from-snap", str(OTC), "--out", str(out), "--limit", str(RATINGS)])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def fold(events_file: Path):
    return fold_jsonl(events_file)


@pytest.fixture(scope="module")
def model_dirs(work: Path) -> dict[str, Path]:
    dirs = {}
    for arch, extra in ARCHS.items():
        path = work / f"model-{arch}"
        rc = main(["model", "init", str(path), "--arch", arch, "--in-dim", "8", "--hidden", "16", "--out-dim", "8",
                   "--fanouts", "10,5", "--seed", str(SEED), *extra])
        assert rc == 0
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="module")
def references(fold, model_dirs: dict[str, Path]) -> dict[str, dict[str, np.ndarray]]:
    return {arch: reference_embeddings(fold.nodes, fold.edges, fold.features, path) for arch, path in model_dirs.items()}


def _read_export(path: Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_events_from_snap(capsys: pytest.CaptureFixture, events_file: Path, fold) -> None:
    lines = events_file.read_text().splitlines()
    ops = [json.loads(line)["op"] for line in lines]
    assert ops.count("edge_upsert") == RATINGS
    assert set(ops) == {"edge_upsert", "node_upsert"}
    assert all(len(f) == 8 for f in fold.features.values())
    assert fold.features.keys() == fold.nodes  # every node gets features when it first appears
    summary = json.loads(_ok(run_cli(capsys, "events", "from-snap", OTC, "--out", events_file.with_suffix(".2"),
                                     "--limit", RATINGS), "events from-snap"))
    assert summary["ratings"] == RATINGS and summary["events"] == len(lines)
    assert events_file.with_suffix(".2").read_bytes() == events_file.read_bytes()  # deterministic


@pytest.mark.parametrize("arch", list(ARCHS))
def test_load_backfill_export_equals_reference(capsys: pytest.CaptureFixture, tmp_path: Path, events_file: Path,
                                               fold, model_dirs: dict[str, Path], references: dict, arch: str) -> None:
    state = tmp_path / "state"
    loaded = json.loads(_ok(run_cli(capsys, "graph", "load", "--state", state, events_file, "--seed", SEED,
                                    "--batch", 700), "graph load"))
    assert loaded["events"] == len(events_file.read_text().splitlines())
    assert loaded["invalid"] == 0
    assert loaded["nodes"] == len(fold.nodes)
    filled = json.loads(_ok(run_cli(capsys, "backfill", "--state", state, "--model", model_dirs[arch]), "backfill"))
    assert filled["nodes"] == len(fold.nodes)
    out = tmp_path / "emb.jsonl"
    _ok(run_cli(capsys, "embeddings", "--state", state, "--out", out), "embeddings")
    records = _read_export(out)
    assert len(records) == len({r["id"] for r in records}) == len(fold.nodes)
    assert_embeddings_close({r["id"]: r["embedding"] for r in records}, references[arch],
                            what=f"{arch}: graph load + backfill vs PyG reference")
    modes = expected_modes(fold, model_dirs[arch])
    assert all(r["mode"] == modes[r["id"]] for r in records)
    assert {r["model"] for r in records} == {"model:1"}
    verified = json.loads(_ok(run_cli(capsys, "verify", "--state", state), "verify"))
    assert verified["ok"] is True and verified["nodes"] == len(fold.nodes)


@pytest.mark.parametrize("arch, hub_bound", [("sage", 50_000), ("gcn", 3), ("gat", 5)])
def test_apply_in_three_runs_verifies_and_equals_reference(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                           events_file: Path, fold, model_dirs: dict[str, Path],
                                                           references: dict, arch: str, hub_bound: int) -> None:
    """``apply`` three times on a file that grows between runs (stop/start between) resumes exactly;
    with a small ``--hub-bound`` hub propagation is deferred between batches and caught up."""
    lines = events_file.read_bytes().splitlines(keepends=True)
    cut = [0, len(lines) // 3 + 17, 2 * len(lines) // 3 - 5, len(lines)]
    growing = tmp_path / "growing.jsonl"
    state = tmp_path / "state"
    applied = 0
    for run in range(3):
        with open(growing, "ab") as fh:
            fh.writelines(lines[cut[run]:cut[run + 1]])
        summary = json.loads(_ok(run_cli(capsys, "apply", "--state", state, "--model", model_dirs[arch], growing,
                                         "--batch", 400, "--hub-bound", hub_bound), f"apply run {run + 1}"))
        assert summary["events"] == cut[run + 1] - cut[run], summary
        assert summary["pending"] == 0
        applied += summary["events"]
    assert applied == len(lines)
    # a fourth run on the complete file has nothing left to do
    again = json.loads(_ok(run_cli(capsys, "apply", "--state", state, growing), "apply (nothing new)"))
    assert again["events"] == 0 and again["pending"] == 0

    rc, out, err = run_cli(capsys, "verify", "--state", state)
    verified = json.loads(out)
    assert rc == 0 and verified["ok"] is True, (rc, verified, err[-2000:])
    assert verified["nodes"] == len(fold.nodes) and verified["pending_dirty"] == 0

    export = tmp_path / "emb.jsonl"
    _ok(run_cli(capsys, "embeddings", "--state", state, "--out", export), "embeddings")
    records = _read_export(export)
    assert_embeddings_close({r["id"]: r["embedding"] for r in records}, references[arch],
                            what=f"{arch}: apply in three runs vs PyG reference")


@pytest.mark.parametrize("second", ["renamed", "same_tag"])
def test_apply_with_a_new_model_is_refused_until_backfill(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                          events_file: Path, work: Path, model_dirs: dict[str, Path],
                                                          references: dict, second: str) -> None:
    """A state built with the sage model, continued with the gat model: ``apply --model gat`` is refused
    (switching models is explicit), ``backfill --model gat`` switches, then ``apply`` continues and every
    embedding must be gat's.

    ``renamed``: the gat model is published as ``gat:2``. ``same_tag``: both models keep the
    defaults of ``model init`` (``model:1``) but have different architectures and weights; the
    stored sage embeddings must not survive the switch either.
    """
    gat = model_dirs["gat"]
    if second == "renamed":
        gat = work / "model-gat-renamed"
        if not gat.exists():
            assert main(["model", "init", str(gat), "--arch", "gat", "--heads", "2", "--in-dim", "8", "--hidden", "16",
                         "--out-dim", "8", "--fanouts", "10,5", "--seed", str(SEED), "--name", "gat",
                         "--version", "2"]) == 0
    lines = events_file.read_bytes().splitlines(keepends=True)
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"".join(lines[:4000]))
    state = tmp_path / "state"
    _ok(run_cli(capsys, "apply", "--state", state, "--model", model_dirs["sage"], path), "apply (sage)")
    path.write_bytes(b"".join(lines))
    rc, out, err = run_cli(capsys, "apply", "--state", state, "--model", gat, path)
    assert rc == 2 and "Traceback" not in err, (rc, err[-2000:])
    assert f"gnnstream backfill --state {state} --model {gat}" in err and "arch sage in the state, gat" in err, err
    rc, out, err = run_cli(capsys, "verify", "--state", state)  # still the sage model's state
    assert rc == 0 and json.loads(out)["ok"] is True, out + err
    _ok(run_cli(capsys, "backfill", "--state", state, "--model", gat), "backfill (gat)")
    _ok(run_cli(capsys, "apply", "--state", state, path), "apply (gat)")
    rc, out, err = run_cli(capsys, "verify", "--state", state)  # with the model the state now uses
    assert rc == 0 and json.loads(out)["ok"] is True, out + err
    export = tmp_path / "emb.jsonl"
    _ok(run_cli(capsys, "embeddings", "--state", state, "--out", export), "embeddings")
    # same init seed and dims: the renamed model has the gat model's weights
    assert_embeddings_close({r["id"]: r["embedding"] for r in _read_export(export)}, references["gat"],
                            what=f"state switched from sage to gat ({second}) vs PyG reference")


def _part(events_file: Path, path: Path, start: int, stop: int) -> Path:
    path.write_bytes(b"".join(events_file.read_bytes().splitlines(keepends=True)[start:stop]))
    return path


def _sage_reference(events_file: Path, lines: int, model_dir: Path) -> dict[str, np.ndarray]:
    fold = fold_jsonl(events_file, limit=lines)
    return reference_embeddings(fold.nodes, fold.edges, fold.features, model_dir)


def test_graph_load_with_a_model_makes_it_the_states_model(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                           events_file: Path, model_dirs: dict[str, Path]) -> None:
    """``graph load --model`` records the model: ``apply``, ``verify`` and ``embeddings`` without
    ``--model`` use it (the sage model's embeddings, not another's); a state loaded without a model still
    asks for one; ``graph load --model`` of another model into a state holding embeddings is refused."""
    state = tmp_path / "state"
    _ok(run_cli(capsys, "graph", "load", "--state", state, "--model", model_dirs["sage"],
                _part(events_file, tmp_path / "first.jsonl", 0, 600)), "graph load --model")
    more = json.loads(_ok(run_cli(capsys, "apply", "--state", state, _part(events_file, tmp_path / "more.jsonl",
                                                                           600, 900)), "apply without --model"))
    assert more["events"] == 300 and more["pending"] == 0, more
    verified = json.loads(_ok(run_cli(capsys, "verify", "--state", state), "verify"))
    assert verified["status"] == "ok" and verified["model"] == "model:1", verified
    export = tmp_path / "emb.jsonl"
    _ok(run_cli(capsys, "embeddings", "--state", state, "--out", export), "embeddings")
    assert_embeddings_close({r["id"]: r["embedding"] for r in _read_export(export)},
                            _sage_reference(events_file, 900, model_dirs["sage"]),
                            what="graph load --model sage, then apply without --model, vs PyG reference")

    rc, out, err = run_cli(capsys, "graph", "load", "--state", state, "--model", model_dirs["gat"],
                           _part(events_file, tmp_path / "rest.jsonl", 900, 1000))
    assert rc == 2 and "Traceback" not in err, (rc, err[-2000:])
    assert f"gnnstream backfill --state {state} --model {model_dirs['gat']}" in err, err
    verified = json.loads(_ok(run_cli(capsys, "verify", "--state", state), "verify after the refused load"))
    assert verified["status"] == "ok" and verified["nodes"] == len(fold_jsonl(events_file, limit=900).nodes)

    bare = tmp_path / "bare"
    _ok(run_cli(capsys, "graph", "load", "--state", bare, "--seed", SEED, tmp_path / "first.jsonl"), "graph load")
    rc, out, err = run_cli(capsys, "apply", "--state", bare, tmp_path / "more.jsonl")
    assert rc == 2 and "pass --model DIR" in err and "Traceback" not in err, (rc, err[-2000:])


@pytest.mark.broker
def test_run_without_model_uses_the_one_graph_load_recorded(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                            events_file: Path, model_dirs: dict[str, Path],
                                                            broker: Any, unique_name: Any) -> None:
    """``gnnstream run`` without ``--model`` on a state from ``graph load --model`` backfills with that
    model and applies the stream: the embeddings equal the sage reference of the whole graph."""
    state = tmp_path / "state"
    _ok(run_cli(capsys, "graph", "load", "--state", state, "--model", model_dirs["sage"],
                _part(events_file, tmp_path / "first.jsonl", 0, 600)), "graph load --model")
    topics = ["--events-topic", unique_name("events"), "--partitions", 2]
    produced = json.loads(_ok(run_cli(capsys, "produce", "--bootstrap", broker.bootstrap, *topics,
                                      _part(events_file, tmp_path / "more.jsonl", 600, 900)), "produce"))
    assert produced["produced"] == 300, produced
    summary = json.loads(_ok(run_cli(capsys, "run", "--bootstrap", broker.bootstrap, "--state", state, *topics,
                                     "--output-topic", unique_name("out"), "--dlq-topic", unique_name("dlq"),
                                     "--group", unique_name("group"), "--metrics-port", 0,
                                     "--exit-when-idle", 3), "run without --model"))
    assert summary["applied"] == 300 and summary["invalid"] == 0, summary
    export = tmp_path / "emb.jsonl"
    _ok(run_cli(capsys, "embeddings", "--state", state, "--out", export), "embeddings")
    assert_embeddings_close({r["id"]: r["embedding"] for r in _read_export(export)},
                            _sage_reference(events_file, 900, model_dirs["sage"]),
                            what="graph load --model sage, then run without --model, vs PyG reference")


def test_apply_skips_invalid_lines_and_resumes(capsys: pytest.CaptureFixture, tmp_path: Path, events_file: Path,
                                               model_dirs: dict[str, Path]) -> None:
    """Bad lines are counted and skipped, never stop the run, and never hide the good events after them."""
    good = events_file.read_bytes().splitlines(keepends=True)[:1500]
    bad = [b"not json\n", b'{"op":"edge_upsert","src":"1"}\n', b'{"op":"explode","id":"1","ts":1}\n', b"\n",
           b'{"op":"node_upsert","id":"1","ts":1,"features":[]}\n']
    mixed = []
    for i, line in enumerate(good):
        mixed.append(line)
        if i % 300 == 7:
            mixed.append(bad[(i // 300) % len(bad)])
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"".join(mixed[:800]))
    state = tmp_path / "state"
    first = json.loads(_ok(run_cli(capsys, "apply", "--state", state, "--model", model_dirs["sage"], path,
                                   "--batch", 64), "apply (first part)"))
    path.write_bytes(b"".join(mixed))
    second = json.loads(_ok(run_cli(capsys, "apply", "--state", state, path, "--batch", 64), "apply (rest)"))
    assert first["events"] + second["events"] == len(good)
    assert first["invalid"] + second["invalid"] == sum(1 for line in mixed if line in bad and line.strip())
    rc, out, err = run_cli(capsys, "verify", "--state", state)
    assert rc == 0 and json.loads(out)["ok"] is True, out + err
    missing = tmp_path / "no-such-dir" / "report.jsonl"  # refused in one line, naming the option
    assert run_cli(capsys, "apply", "--state", state, path, "--report", missing)[::2] == (
        2, f"gnnstream: error: --report {str(missing)!r}: no directory {str(missing.parent)!r} to write it in\n")
    fold = GraphFold()
    for line in good:
        fold.apply_obj(json.loads(line))
    export = tmp_path / "emb.jsonl"
    _ok(run_cli(capsys, "embeddings", "--state", state, "--out", export), "embeddings")
    assert_embeddings_close({r["id"]: r["embedding"] for r in _read_export(export)},
                            reference_embeddings(fold.nodes, fold.edges, fold.features, model_dirs["sage"]),
                            what="apply with invalid lines vs PyG reference")


def test_a_byte_order_mark_is_read_past_and_a_gzipped_file_refused(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                                    model_dirs: dict[str, Path]) -> None:
    line = b'{"op":"edge_upsert","src":"a","dst":"b","ts":1}\n'
    bom, packed = tmp_path / "bom.jsonl", tmp_path / "events.jsonl.gz"
    bom.write_bytes(b"\xef\xbb\xbf" + line + line.replace(b'"a"', b'"c"'))
    packed.write_bytes(gzip.compress(line))
    out = json.loads(_ok(run_cli(capsys, "apply", "--state", tmp_path / "s", "--model", model_dirs["sage"], bom),
                         "apply"))
    assert (out["events"], out["invalid"]) == (2, 0)
    assert run_cli(capsys, "apply", "--state", tmp_path / "s", packed)[::2] == (
        2, f"gnnstream: error: {str(packed)!r} is gzipped, not JSON lines: gunzip it first (a SNAP CSV: gnnstream "
           f"events from-snap)\n")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_features_at_the_largest_magnitude_give_finite_embeddings(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                                  model_dirs: dict[str, Path], arch: str) -> None:
    """Features of ±MAX_FEATURE on a dense little graph still give finite, exact embeddings; one beyond it
    (which overflowed float32 in the layers) is skipped as ``not_finite`` instead of stopping the stream."""
    from gnnstream.stream.events import MAX_FEATURE
    lines = [{"op": "node_upsert", "id": str(v), "ts": 1, "features": [MAX_FEATURE * (-1) ** (v + i)
                                                                       for i in range(8)]} for v in range(12)]
    lines += [{"op": "edge_upsert", "src": str(a), "dst": str(b), "ts": 2} for a in range(12) for b in range(12)
              if a != b]
    lines.append({"op": "node_upsert", "id": "q", "ts": 3, "features": [3e38] * 8})
    lines.append({"op": "edge_upsert", "src": "q", "dst": "1", "ts": 3})
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    state = tmp_path / "state"
    summary = json.loads(_ok(run_cli(capsys, "apply", "--state", state, "--model", model_dirs[arch], path),
                             "apply"))
    assert summary["invalid"] == 1 and summary["events"] == len(lines) - 1, summary
    (skipped,) = [json.loads(line) for line in (state / "invalid-big.jsonl").read_text().splitlines()]
    assert skipped["reason"] == "not_finite" and skipped["line"] == len(lines) - 1, skipped
    rc, out, err = run_cli(capsys, "verify", "--state", state)
    assert rc == 0 and json.loads(out)["ok"] is True, out + err
    export = tmp_path / "emb.jsonl"
    _ok(run_cli(capsys, "embeddings", "--state", state, "--out", export), "embeddings")
    rows = {r["id"]: r["embedding"] for r in _read_export(export)}
    assert len(rows) == 13 and all(np.isfinite(row).all() for row in rows.values())


def test_apply_refuses_another_file_at_the_same_path(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                     events_file: Path, model_dirs: dict[str, Path]) -> None:
    """apply resumes a file after the lines it applied; new content at the same path must not be cut short."""
    lines = events_file.read_bytes().splitlines(keepends=True)
    path = tmp_path / "today.jsonl"
    path.write_bytes(b"".join(lines[:500]))
    state = tmp_path / "state"
    first = json.loads(_ok(run_cli(capsys, "apply", "--state", state, "--model", model_dirs["sage"], path,
                                   "--batch", 128), "apply (first file)"))
    assert first["events"] == 500
    path.write_bytes(b"".join(lines[3000:3701]))  # another day's events under the same name
    rc, out, err = run_cli(capsys, "apply", "--state", state, path)
    assert rc == 2 and out == ""
    assert err.startswith(f"gnnstream: error: events file {str(path)!r} is not the one applied before: its line 500")
    assert len(err.strip().splitlines()) == 1
    path.write_bytes(b"".join(lines[:300]))  # shorter than what was applied
    rc, out, err = run_cli(capsys, "apply", "--state", state, path)
    assert rc == 2 and "its line 500, where the last run stopped, is missing" in err
    # the same file grown (and ending in a blank and an invalid line) resumes after line 500
    path.write_bytes(b"".join(lines[:900]) + b"\n" + b"not json\n")
    grown = json.loads(_ok(run_cli(capsys, "apply", "--state", state, path), "apply (grown file)"))
    assert (grown["events"], grown["invalid"]) == (400, 1)
    path.write_bytes(b"".join(lines[:900]) + b"\n" + b"not json\n" + b"".join(lines[900:1000]))
    again = json.loads(_ok(run_cli(capsys, "apply", "--state", state, path), "apply (grown after a bad line)"))
    assert (again["events"], again["invalid"]) == (100, 0)
    fold = GraphFold()
    for line in lines[:1000]:
        fold.apply_obj(json.loads(line))
    export = tmp_path / "emb.jsonl"
    _ok(run_cli(capsys, "embeddings", "--state", state, "--out", export), "embeddings")
    assert_embeddings_close({r["id"]: r["embedding"] for r in _read_export(export)},
                            reference_embeddings(fold.nodes, fold.edges, fold.features, model_dirs["sage"]),
                            what="apply of a growing file vs PyG reference")


def test_graph_show(capsys: pytest.CaptureFixture, tmp_path: Path, events_file: Path, fold) -> None:
    state = tmp_path / "state"
    _ok(run_cli(capsys, "graph", "load", "--state", state, events_file, "--seed", SEED), "graph load")
    nbrs = neighbourhoods(fold.nodes, fold.edges)
    hub = max(sorted(nbrs), key=lambda v: len(nbrs[v]))
    small = next(v for v in sorted(nbrs) if 1 <= len(nbrs[v]) <= 3)
    for node, fanout, limit in ((hub, 7, 10_000), (hub, 25, 5), (small, 10, 100)):
        shown = json.loads(_ok(run_cli(capsys, "graph", "show", "--state", state, node, "--fanout", fanout,
                                       "--limit", limit), "graph show"))
        assert shown["id"] == node
        assert shown["degree"] == len(nbrs[node])
        assert set(shown["neighbors"]) <= nbrs[node]
        assert len(shown["neighbors"]) == min(limit, len(nbrs[node]))
        assert shown["sample"] == bottom_k(SEED, node, nbrs[node], fanout)
        assert shown["fanout"] == fanout and shown["seed"] == SEED
        np.testing.assert_allclose(shown["features"], fold.features[node], atol=1e-6)
    rc, out, err = run_cli(capsys, "graph", "show", "--state", state, "no-such-node")
    assert rc == 2 and out == "" and err.startswith("gnnstream: error: node 'no-such-node' does not exist")


def _subcommands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every leaf command of the CLI with its parser."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.extend(_subcommands(sub, prefix + (name,)))
    return found or [(prefix, parser)]


def test_every_subcommand_has_help(capsys: pytest.CaptureFixture) -> None:
    commands = _subcommands(build_parser())
    names = {" ".join(path) for path, _ in commands}
    assert {"graph load", "graph show", "model init", "backfill", "embeddings", "apply", "verify",
            "events from-snap"} <= names
    for path, parser in commands:
        rc, out, err = run_cli(capsys, *path, "--help")
        assert rc == 0, f"gnnstream {' '.join(path)} --help exited {rc}: {err}"
        assert out.startswith("usage: gnnstream " + " ".join(path)), out[:200]
        assert parser.description and " ".join(parser.description.split()[:3]) in " ".join(out.split()), path
        for action in parser._actions:
            for option in action.option_strings:
                assert option in out, f"gnnstream {' '.join(path)} --help does not mention {option}"
            if not action.option_strings and action.dest != "help" and action.metavar:
                assert str(action.metavar) in out
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0 and all(path[0] in out for path, _ in commands)


# ---------------------------------------------------------------------- mismatches
@pytest.fixture(scope="module")
def wrong_models(work: Path) -> dict[str, Path]:
    out = {}
    for name, args in {"seed4": ["--in-dim", "8", "--seed", "4"], "dim4": ["--in-dim", "4", "--seed", str(SEED)],
                       "damaged": ["--in-dim", "8", "--seed", str(SEED)]}.items():
        path = work / f"wrong-{name}"
        assert main(["model", "init", str(path), "--hidden", "8", "--out-dim", "4", "--fanouts", "3,2", *args]) == 0
        out[name] = path
    with open(out["damaged"] / "weights.pt", "ab") as fh:
        fh.write(b"\0")
    out["missing"] = work / "no-such-model-dir"
    return out


# case -> (state prepared with `graph load --seed 3`, argv after the state, words the error must mention)
MISMATCHES: dict[str, tuple[bool, list[str], list[str]]] = {
    "backfill_wrong_seed": (True, ["backfill", "--model", "@seed4"], ["seed", "3", "4"]),
    "apply_wrong_seed": (True, ["apply", "--model", "@seed4", "@events"], ["seed", "3", "4"]),
    "apply_explicit_seed_unlike_model": (False, ["apply", "--model", "@seed4", "--seed", "3", "@events"],
                                         ["seed", "3", "4"]),
    "backfill_wrong_dim": (True, ["backfill", "--model", "@dim4"], ["feature", "4", "8"]),
    "apply_wrong_dim": (True, ["apply", "--model", "@dim4", "@events"], ["feature", "4", "8"]),
    "apply_missing_model_dir": (False, ["apply", "--model", "@missing", "@events"], ["no-such-model-dir"]),
    "backfill_missing_model_dir": (True, ["backfill", "--model", "@missing"], ["no-such-model-dir"]),
    "backfill_damaged_weights": (True, ["backfill", "--model", "@damaged"], ["weights.pt", "sha256"]),
    "apply_damaged_weights": (True, ["apply", "--model", "@damaged", "@events"], ["weights.pt", "sha256"]),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_bad_model_or_state_mismatch_is_a_clear_error(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                      events_file: Path, wrong_models: dict[str, Path],
                                                      case: str) -> None:
    """A model that does not fit the state, or is missing/damaged: non-zero exit, a message, no traceback."""
    state = tmp_path / "state"
    small = tmp_path / "small.jsonl"
    small.write_bytes(b"".join(events_file.read_bytes().splitlines(keepends=True)[:300]))
    load_first, argv, words = MISMATCHES[case]
    if load_first:
        _ok(run_cli(capsys, "graph", "load", "--state", state, small, "--seed", SEED), "graph load")
    resolved = [small if a == "@events" else wrong_models[a[1:]] if a.startswith("@") else a for a in argv]
    resolved[1:1] = ["--state", state]
    rc, out, err = run_cli(capsys, *resolved)
    assert rc != 0, f"gnnstream {case} succeeded: {out[-500:]}"
    assert "Traceback" not in err, f"gnnstream {case} crashed with a traceback instead of an error message:\n{err[-1500:]}"
    message = err.lower()
    for word in words:
        assert word in message, f"error for {case} does not mention {word!r}: {err.strip()}"
