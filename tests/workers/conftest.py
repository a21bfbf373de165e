"""Fixtures shared by the worker tests."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import DIM, FANOUTS, MODELS, SEED, Proc

N_EVENTS = 3_000  # the Bitcoin OTC prefix of ``events``


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small 2-layer GraphSAGE model (8 -> 16 -> 8, fanouts 10,5, seed 0) for Bitcoin OTC features."""
    from gnnstream.model import init_model_dir
    d = tmp_path_factory.mktemp("model") / "sage"
    init_model_dir(str(d), arch="sage", in_dim=8, hidden=16, out_dim=8, layers=2, fanouts=[10, 5], seed=0)
    return str(d)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The engine tests' model directories, one per architecture and cold-start policy (:data:`MODELS`)."""
    from gnnstream.model import init_model_dir
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, extra in MODELS.items():
        path = root / name
        init_model_dir(path, **{**dict(in_dim=DIM, hidden=8, out_dim=6, layers=2, fanouts=FANOUTS, seed=SEED), **extra})
        out[name] = path
    return out


@pytest.fixture(scope="module")
def events() -> list:
    """The first 3,000 Bitcoin OTC events (ratings and the node_upsert events derived from them)."""
    from gnnstream.fraud.datasets import BITCOIN_OTC
    from gnnstream.stream.snap import read_snap, snap_events
    evs = list(itertools.islice(snap_events(read_snap(BITCOIN_OTC)[:N_EVENTS]), N_EVENTS))
    assert len(evs) == N_EVENTS
    return evs


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes a test started (:class:`tests.support.Proc`), killed when it ends."""
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()
