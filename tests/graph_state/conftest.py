"""Fixtures of the store tests."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def frozen_heap() -> Iterator[None]:
    """Every ``GraphStore.close()`` runs ``gc.collect()``: the objects alive when a module's tests start (torch,
    hypothesis) stay out of those collections (``pytestmark = pytest.mark.usefixtures("frozen_heap")``)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
