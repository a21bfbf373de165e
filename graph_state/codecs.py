"""The byte layout of the embedding state's page-log pages (``embpages``, ``layerpages``)."""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

from gnnstream.graph_state.idsets import unique_ids

__all__ = ["PAGE_ROWS", "encode_pages", "decode_page"]

PAGE_ROWS = 128  # records per page of a page log, rows per frame of a row file (64 KB of rows at 128 dims)
_PAGE_HEAD = struct.Struct(">BBIHB")  # format, has rows, count, row width, number of modes
_PAGE_FORMAT = 2  # rows in a frame of the row file, the record names the frame
_FRAME = struct.Struct(">QQ")  # frame, sum of the rows' 32-bit words
_COLUMNS = (("iid", ">u8"), ("version", ">u8"), ("event_ts", ">f8"), ("mode", "u1"))


def encode_pages(iids: np.ndarray, version: np.ndarray, event_ts: np.ndarray, codes: np.ndarray,
                 names: Sequence[str], width: int, frames: Sequence[int] | None,
                 sums: Sequence[int] | None = None) -> tuple[list[np.ndarray], list[bytes]]:
    """``embpages`` values for these records, :data:`PAGE_ROWS` a page: ``(iids of each page, values)``.

    A value is a header, the modes it uses, then its records column by
    column. Header: format >B, has rows >B, count >I, row width >H, number
    of modes >B, each mode as length >B + ascii. Columns: iid >Q, version >Q,
    event_ts >d, mode (index into the page's modes) >B; when the page has
    rows (``frames`` given, one per page), the frame of the row file holding
    them >Q (float32[count, width] little-endian at the frame's start) and
    the sum of those rows' 32-bit words modulo 2^64 >Q (``sums``,
    :func:`gnnstream.graph_state.row_file.row_sums`).
    """
    used = unique_ids(codes)
    modes = b"".join(bytes((len(m),)) + m for m in (names[c].encode() for c in used.tolist()))
    columns = [np.asarray(iids).astype(">u8"), np.asarray(version).astype(">u8"), np.asarray(event_ts).astype(">f8"),
               np.searchsorted(used, codes).astype("u1")]
    pages, values = [], []

    def header(count: int) -> bytes:
        return _PAGE_HEAD.pack(_PAGE_FORMAT, frames is not None, count, width if frames is not None else 0, len(used))

    full, rest = divmod(len(iids), PAGE_ROWS)
    if full:  # the full pages share one layout: build them as the rows of one byte matrix
        head = header(PAGE_ROWS)
        parts = [np.broadcast_to(np.frombuffer(head + modes, np.uint8), (full, len(head) + len(modes)))]
        parts += [c[:full * PAGE_ROWS].reshape(full, PAGE_ROWS).view(np.uint8) for c in columns]
        if frames is not None:
            tail = np.empty((full, 2), dtype=">u8")
            tail[:, 0], tail[:, 1] = frames[:full], sums[:full]
            parts.append(tail.view(np.uint8))
        block = np.concatenate(parts, axis=1).tobytes()
        size = len(block) // full
        values = [block[at:at + size] for at in range(0, len(block), size)]
        pages = list(np.asarray(iids)[:full * PAGE_ROWS].reshape(full, PAGE_ROWS))
    if rest:  # the last page, shorter
        start = full * PAGE_ROWS
        tail = _FRAME.pack(frames[full], sums[full]) if frames is not None else b""
        pages.append(iids[start:])
        values.append(b"".join([header(rest), modes, *(memoryview(c[start:]) for c in columns), tail]))
    return pages, values


def decode_page(raw: bytes) -> tuple[dict[str, np.ndarray], list[str], bool]:
    """``(columns, modes, has rows)`` of an ``embpages`` value.

    The columns (``iid``, ``version``, ``event_ts``, ``mode``) are read-only
    views, plus for a page with rows its row ``width`` and either ``frame``
    (the frame of the row file) and ``sum``.
    """
    fmt, has_rows, count, width, n_modes = _PAGE_HEAD.unpack_from(raw)
    if fmt != _PAGE_FORMAT:
        raise ValueError(f"Expected embedding page format {_PAGE_FORMAT} (got {fmt})")
    at = _PAGE_HEAD.size
    modes = []
    for _ in range(n_modes):
        n = raw[at]
        modes.append(raw[at + 1:at + 1 + n].decode())
        at += 1 + n
    columns = {}
    for name, dtype in _COLUMNS:
        columns[name] = np.frombuffer(raw, dtype, count, at)
        at += count * np.dtype(dtype).itemsize
    if has_rows:
        columns["width"] = np.asarray(width)
        frame, total = _FRAME.unpack_from(raw, at)
        columns["frame"], columns["sum"] = np.asarray(frame), np.asarray(total, dtype=np.uint64)
    return columns, modes, bool(has_rows)
