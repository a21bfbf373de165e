"""Fixtures shared by the worker tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small 2-layer GraphSAGE model (8 -> 16 -> 8, fanouts 10,5, seed 0) for Bitcoin OTC features."""
    from gnnstream.model import init_model_dir
    d = tmp_path_factory.mktemp("model") / "sage"
    init_model_dir(str(d), arch="sage", in_dim=8, hidden=16, out_dim=8, layers=2, fanouts=[10, 5], seed=0)
    return str(d)
