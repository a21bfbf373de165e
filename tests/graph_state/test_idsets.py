"""The id-set helpers against numpy's reference set operations."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from gnnstream.graph_state.idsets import setdiff_ids, unique_ids

ids = st.lists(st.one_of(st.integers(0, 300), st.integers(0, (1 << 62) - 1)), max_size=200)


@given(ids)
def test_unique_ids_equals_numpy(values):
    x = np.asarray(values, dtype=np.int64)
    got = unique_ids(x)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.unique(x))


@given(ids, ids)
def test_setdiff_ids_equals_numpy(a, b):
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    np.testing.assert_array_equal(setdiff_ids(a, b), np.setdiff1d(a, b))


@pytest.mark.parametrize("size", [0, 1, 5000])
def test_both_paths(size):
    rng = np.random.default_rng(size)
    small = rng.integers(0, 1000, size)           # marking table
    wide = rng.integers(0, 1 << 60, size)        # sorting
    for x in (small, wide, np.concatenate([wide, wide])):
        np.testing.assert_array_equal(unique_ids(x), np.unique(x))
    assert unique_ids(small) is not small
