"""Turn SNAP signed-network CSV files (Bitcoin OTC / Alpha) into graph events.

Rows ``source,target,rating,time`` become ``edge_upsert`` events in time order
(weight = rating). Node features are derived from what a node has *done* so
far — how many ratings it gave, their mean and share of negatives, how many it
received, how long it has been active — and emitted as ``node_upsert`` events
when a node first appears and whenever its activity count reaches a power of
two. Ratings a node *received* are never part of its features (they are the
fraud label's source).
"""

from __future__ import annotations

import csv
import gzip
import io
import math
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Iterator

from gnnstream.stream.events import EdgeUpsert, Event, NodeUpsert

__all__ = ["SnapRating", "read_snap", "snap_events", "FEATURE_DIM", "SNAP_FORMAT"]

FEATURE_DIM = 8



@dataclass(frozen=True, slots=True)
class SnapRating:
    src: str
    dst: str
    rating: float
    ts: float


SNAP_FORMAT = ("SOURCE,TARGET,RATING,TIME per line (integer node ids, finite numbers; one header line at the "
               "top optional; plain or gzipped)")
"""What :func:`read_snap` reads, as its errors state it."""

_INT = re.compile(r"-?[0-9]+")
_UNDECODED = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, as surrogateescape keeps them


def _open_text(path: str | os.PathLike[str]) -> io.TextIOBase:
    """``path`` as UTF-8 text (a BOM dropped), gunzipped when it starts with the gzip magic bytes.

    Undecodable bytes become lone surrogates (``surrogateescape``), so a binary file fails on the line that
    holds them, with its number, rather than somewhere in a decoded chunk.
    """
    with open(path, "rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    if gzipped:
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", errors="surrogateescape", newline="")
    return open(path, encoding="utf-8-sig", errors="surrogateescape", newline="")


def _shown(rec: list[str]) -> str:
    text = ",".join(rec)
    return repr(text if len(text) <= 60 else text[:57] + "...")


def _number(path: str, line: int, what: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{path}, line {line}: {what} {text.strip()[:40]!r} is not a number; expected "
                         f"{SNAP_FORMAT}") from None
    if not math.isfinite(value):
        raise ValueError(f"{path}, line {line}: {what} {text.strip()!r} is not a finite number; expected "
                         f"{SNAP_FORMAT}")
    return value


def _rating(name: str, line: int, rec: list[str]) -> SnapRating:
    """``rec`` (a non-blank record at ``line``) as a rating, or a ValueError naming the file and line."""
    if len(rec) != 4:
        raise ValueError(f"{name}, line {line}: {len(rec)} field{'s' * (len(rec) != 1)} {_shown(rec)}; "
                         f"expected {SNAP_FORMAT}")
    src, dst = rec[0].strip(), rec[1].strip()
    for what, node in (("source", src), ("target", dst)):
        if not _INT.fullmatch(node):
            raise ValueError(f"{name}, line {line}: {what} {node[:40]!r} is not an integer node id; "
                             f"expected {SNAP_FORMAT}")
    return SnapRating(src, dst, _number(name, line, "rating", rec[2]), _number(name, line, "time", rec[3]))


def read_snap(path: str | os.PathLike[str]) -> list[SnapRating]:
    """Ratings of a SNAP signed-network CSV, plain or gzipped (header optional), sorted by time (stable).

    Each line is ``SOURCE,TARGET,RATING,TIME``: integer node ids (kept as strings), a finite rating and a
    finite time. Blank lines are skipped; the first non-blank line is taken as a header when its first field
    is not an integer. Any other line is an error.

    Raises:
        ValueError: a file without any rating (``no ratings read from PATH: ...``); else the first line that is
            not a rating, naming ``path`` and its 1-based number; or a damaged gzip file.
        OSError: ``path`` cannot be opened or read.
    """
    name = os.fspath(path)
    rows: list[SnapRating] = []
    seen_line = False
    text_error: ValueError | None = None  # a text line before any rating: maybe no rating follows at all
    with _open_text(path) as fh:
        reader = csv.reader(fh)
        while True:
            line = reader.line_num + 1  # where the next record starts
            try:
                rec = next(reader)
            except StopIteration:
                break
            except csv.Error as exc:
                raise ValueError(f"{name}, line {line}: {exc}; expected {SNAP_FORMAT}") from None
            except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
                raise ValueError(f"{name}: damaged gzip file ({exc}); download or compress it again") from None
            if not any(f.strip() for f in rec):
                continue  # blank
            if _UNDECODED.search(",".join(rec)):
                raise ValueError(f"{name}, line {line}: not UTF-8 text (a binary file?); expected {SNAP_FORMAT}")
            first = not seen_line
            seen_line = True
            if first and not _INT.fullmatch(rec[0].strip()):
                continue  # header
            if text_error is not None:  # only whether the file holds any rating is still open
                try:
                    _rating(name, line, rec)
                except ValueError:
                    continue
                raise text_error
            try:
                rows.append(_rating(name, line, rec))
            except ValueError as exc:
                if rows or _INT.fullmatch(rec[0].strip()):
                    raise
                text_error = exc
    if not rows:
        raise ValueError(f"no ratings read from {name}: expected a SNAP signed-network CSV (source,target,rating,time)")
    rows.sort(key=lambda r: r.ts)
    return rows


@dataclass
class _Activity:
    first_ts: float
    given: int = 0
    given_sum: float = 0.0
    given_neg: int = 0
    received: int = 0
    emitted_at: set[int] = field(default_factory=set)

    def features(self, now: float) -> tuple[float, ...]:
        mean = self.given_sum / self.given if self.given else 0.0
        neg = self.given_neg / self.given if self.given else 0.0
        age_days = max(0.0, now - self.first_ts) / 86400.0
        return (
            1.0,
            math.log1p(self.given),
            mean / 10.0,
            neg,
            math.log1p(self.received),
            math.log1p(age_days),
            1.0 if self.given == 0 else 0.0,
            math.log1p(self.given + self.received) / 5.0,
        )


def snap_events(rows: list[SnapRating], with_features: bool = True) -> Iterator[Event]:
    """Events for ``rows`` (already in time order): edges plus derived node features."""
    activity: dict[str, _Activity] = {}
    for r in rows:
        for node in (r.src, r.dst):
            if node not in activity:
                activity[node] = _Activity(first_ts=r.ts)
        a_src, a_dst = activity[r.src], activity[r.dst]
        a_src.given += 1
        a_src.given_sum += r.rating
        a_src.given_neg += r.rating < 0
        a_dst.received += 1
        yield EdgeUpsert(r.src, r.dst, r.ts, r.rating)
        if not with_features:
            continue
        for node, act in ((r.src, a_src), (r.dst, a_dst)):
            count = act.given + act.received
            if count & (count - 1) == 0 and count not in act.emitted_at:
                act.emitted_at.add(count)
                yield NodeUpsert(node, r.ts, act.features(r.ts))
