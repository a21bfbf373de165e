"""Where the layers run: the torch device a backfill asks for, and torch's threads per layer."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["check_device", "threads_for", "SMALL_LAYER"]

SMALL_LAYER = 1024  # a layer over fewer targets runs on one torch thread


@contextmanager
def threads_for(rows: int) -> Iterator[None]:
    """One torch thread for a small layer, else torch's setting.

    A parallel region over a few hundred rows gains little, and waits for
    its second thread whenever RocksDB's background work holds the other
    core: small recomputes (a quiet stream, a hub's few dependents) ran two
    to three times slower on two threads in ``bench/engine.py``'s hub test.
    The first layer of a 1,000-event batch (about 2,000 targets, 25 sampled
    rows each) gains from both cores.
    """
    threads = torch.get_num_threads()
    if rows >= SMALL_LAYER or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device that is present here.

    Raises:
        ValueError: an unknown device, or CUDA without a GPU torch can use.
    """
    try:
        found = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"Expected a torch device such as cpu or cuda (got {device!r})") from exc
    if found.type not in ("cpu", "cuda"):
        raise ValueError(f"Expected device cpu or cuda (got {device!r})")
    if found.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA GPU here (torch {torch.__version__}, CUDA build "
                         f"{torch.version.cuda}); run the backfill with --device cpu")
    if found.type == "cuda" and found.index is not None and found.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s), numbered from 0")
    return found
