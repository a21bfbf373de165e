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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from stream.events import EdgeUpsert, Event, NodeUpsert

__all__ = ["SnapRating", "read_snap", "snap_events", "FEATURE_DIM", "DATA_DIR", "BITCOIN_OTC", "BITCOIN_ALPHA"]

FEATURE_DIM = 8

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
"""The SNAP networks shipped with the repository (gzip; see ``data/README.md``)."""
BITCOIN_OTC = DATA_DIR / "soc-sign-bitcoinotc.csv.gz"
BITCOIN_ALPHA = DATA_DIR / "soc-sign-bitcoinalpha.csv.gz"


@dataclass(frozen=True, slots=True)
class SnapRating:
    src: str
    dst: str
    rating: float
    ts: float


def _open_text(path: str | os.PathLike[str]) -> io.TextIOBase:
    """``path`` as text, gunzipped when it starts with the gzip magic bytes."""
    with open(path, "rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    if gzipped:
        return io.TextIOWrapper(gzip.open(path, "rb"), newline="")
    return open(path, newline="")


def read_snap(path: str | os.PathLike[str]) -> list[SnapRating]:
    """Ratings of a SNAP signed-network CSV, plain or gzipped (header optional), sorted by time (stable)."""
    rows = []
    with _open_text(path) as fh:
        for rec in csv.reader(fh):
            if not rec or not rec[0].strip().lstrip("-").isdigit():
                continue  # header or blank
            rows.append(SnapRating(rec[0].strip(), rec[1].strip(), float(rec[2]), float(rec[3])))
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
