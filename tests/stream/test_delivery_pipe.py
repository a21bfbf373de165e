"""The worker's pipe to the delivery process: arrays cross through a shared file, the rest over the socket."""

from __future__ import annotations

import os
import socket

import numpy as np

from gnnstream.stream.delivery import UpdateColumns, _Pipe


def _columns(n: int, seed: int) -> UpdateColumns:
    rng = np.random.default_rng(seed)
    iids = rng.choice(10 * n, n, replace=False)
    return UpdateColumns([f"n{i}" for i in iids.tolist()], rng.integers(0, 2**62, n), rng.uniform(0, 2e9, n), 5.5,
                         ["full"] * n, rng.normal(size=(n, 64)).astype(np.float32), rng.random(n) < 0.2, iids)


def test_arrays_cross_through_the_shared_file_which_grows_and_is_reused() -> None:
    ours, theirs = socket.socketpair()
    shared = os.memfd_create("test-pipe")
    worker, child = _Pipe(ours, shared), _Pipe(theirs, os.dup(shared))
    try:
        kept = []
        for n, seed in ((3, 0), (2000, 1), (2000, 2), (10, 3)):
            sent = _columns(n, seed)
            worker.send(("deliver", [sent], 1.5, [("h", b"v")]))
            kind, (got,), timeout_s, headers = child.recv()
            assert (kind, timeout_s, headers, got.names, got.modes, got.computed_at) == \
                   ("deliver", 1.5, [("h", b"v")], sent.names, sent.modes, 5.5)
            for name in ("versions", "event_ts", "rows", "deleted", "iids"):
                np.testing.assert_array_equal(getattr(got, name), getattr(sent, name))
                assert getattr(got, name).dtype == getattr(sent, name).dtype
            kept.append(got)
            child.send(("ok", n))  # answers carry no arrays
            assert worker.recv() == ("ok", n)
        assert os.fstat(shared).st_size >= 2000 * 64 * 4  # grown for the large rounds, not shrunk after
        # what was received views the shared file: the next round written over it shows through
        np.testing.assert_array_equal(kept[1].rows, _columns(2000, 2).rows)
    finally:
        worker.close()
        child.close()
