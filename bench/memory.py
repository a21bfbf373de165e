#!/usr/bin/env python3
"""What memory and row-file frames cost on this machine the first time and after.

Two measurements, printed as one JSON object:

1. Anonymous memory: map ``--chunks`` chunks of ``--chunk-mib`` MiB one after
   another, write one byte a 4 KiB page, and time it per page; then unmap them
   all, map and touch the same amount again. On a virtual machine whose host
   hands out memory lazily, pages the guest has never used (or gave back)
   cost far more the first time than pages it reuses.
2. Row-file frames (the final-embedding log's ``RowFile``): write
   ``--frames`` frames of :data:`gnnstream.graph_state.codecs.PAGE_ROWS` rows of ``--dim``
   floats into a fresh file, release them all, and write them again, twice.
   The first pass grows the file into fresh page-cache pages with ``pwrite``;
   the second rewrites those cached pages through the file's mapping, which
   maps each page in on its first write; the third writes through pages
   already mapped. The incremental engine's row files grow like the first
   pass until the log's garbage collection holds them steady.

Run by hand (``python -m bench.memory``); ``bench/engine.py`` results on a
fresh machine depend on how much of its memory is still untouched.
"""

from __future__ import annotations

import argparse
import mmap
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import code_fingerprint, emit, log, machine_load

from gnnstream.graph_state.codecs import PAGE_ROWS

from gnnstream.graph_state.row_file import RowFile

_PAGE = 4096


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--chunks", type=int, default=8, help="anonymous chunks mapped per pass")
    p.add_argument("--chunk-mib", type=int, default=1024, help="size of each anonymous chunk (MiB)")
    p.add_argument("--frames", type=int, default=2048, help="row-file frames written per pass")
    p.add_argument("--dim", type=int, default=128, help="floats per row")
    p.add_argument("--workdir", default=None, help="directory for the row file (default: system temp)")
    return p.parse_args(argv)


def touch_pass(chunks: int, chunk_bytes: int) -> list[float]:
    """Map ``chunks`` anonymous chunks, touch every page; µs a page per chunk. All stay mapped until the end."""
    maps, per_page = [], []
    try:
        for _ in range(chunks):
            m = mmap.mmap(-1, chunk_bytes)
            maps.append(m)
            t = time.perf_counter()
            for off in range(0, chunk_bytes, _PAGE):
                m[off] = 1
            per_page.append((time.perf_counter() - t) / (chunk_bytes // _PAGE) * 1e6)
    finally:
        for m in maps:
            m.close()
    return per_page


def frame_passes(frames: int, dim: int, workdir: str | None) -> dict[str, float]:
    """µs a frame: writing ``frames`` fresh frames, then the same frames again, twice."""
    rows = np.random.default_rng(0).standard_normal((frames * PAGE_ROWS, dim)).astype(np.float32)
    out = {}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        file = RowFile(str(Path(tmp) / f"rows-{dim}.f32"), dim)
        file.start([])
        try:
            for name in ("fresh", "rewrite", "rewrite_again"):
                t = time.perf_counter()
                taken = file.write(rows)
                out[f"{name}_us_per_frame"] = round((time.perf_counter() - t) / frames * 1e6, 2)
                for frame in taken:
                    file.release(frame)
                file.committed()
        finally:
            file.close()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    chunk_bytes = args.chunk_mib << 20
    log(f"anonymous memory: {args.chunks} x {args.chunk_mib} MiB, twice")
    first = touch_pass(args.chunks, chunk_bytes)
    second = touch_pass(args.chunks, chunk_bytes)
    log(f"row-file frames: {args.frames} of {PAGE_ROWS} x {args.dim} floats, fresh then rewritten")
    frames = frame_passes(args.frames, args.dim, args.workdir)
    rounded = lambda xs: [round(x, 2) for x in xs]  # noqa: E731
    return {
        "benchmark": "memory",
        "config": {"chunks": args.chunks, "chunk_mib": args.chunk_mib, "frames": args.frames, "dim": args.dim,
                   "frame_bytes": PAGE_ROWS * args.dim * 4},
        "code": code_fingerprint(), "machine_load_at_start": machine_load(),
        "anonymous_us_per_page": {"first_pass": rounded(first), "second_pass": rounded(second),
                                  "first_pass_max": round(max(first), 2), "second_pass_min": round(min(second), 2)},
        "row_file": frames,
    }


if __name__ == "__main__":
    emit(main())
