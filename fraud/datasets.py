"""The SNAP networks the example reads, shipped with the repository (gzip; see ``data/README.md``), and their
rhythm: how fast a new user's neighbourhood fills up, what the demo's staged cold-start policy is chosen from.

``python -m gnnstream.fraud.datasets [CSV]`` prints the rhythm of a SNAP file (default Bitcoin OTC) as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gnnstream.stream.snap import SnapRating, read_snap

__all__ = ["DATA_DIR", "BITCOIN_OTC", "BITCOIN_ALPHA", "rhythm"]

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
BITCOIN_OTC = DATA_DIR / "soc-sign-bitcoinotc.csv.gz"
BITCOIN_ALPHA = DATA_DIR / "soc-sign-bitcoinalpha.csv.gz"
_DAY = 86_400.0


def rhythm(rows: Sequence[SnapRating]) -> dict[str, Any]:
    """How the neighbourhoods of ``rows`` (in time order) fill up.

    For the 2nd and 3rd distinct counterparty (a user rated by or rating another): how many users ever meet
    one, the quartiles of their age in days when they do (age: time since the user's first rating), and the
    share of those users that meet it within 1 and 7 days; then the share of users that end with fewer than 3
    counterparties, and the ratings per calendar year (UTC).
    """
    first: dict[str, float] = {}
    met: dict[str, list[float]] = {}  # the age (days) at each new counterparty, in order
    seen: dict[str, set[str]] = {}
    for r in rows:
        for v, u in ((r.src, r.dst), (r.dst, r.src)):
            first.setdefault(v, r.ts)
            if u != v and u not in seen.setdefault(v, set()):
                seen[v].add(u)
                met.setdefault(v, []).append((r.ts - first[v]) / _DAY)
    out: dict[str, Any] = {"ratings": len(rows), "users": len(first)}
    for k in (2, 3):
        ages = np.array([m[k - 1] for m in met.values() if len(m) >= k])
        p25, p50, p75 = (round(float(q), 2) for q in np.percentile(ages, [25, 50, 75])) if len(ages) else (None,) * 3
        out[f"counterparty_{k}"] = {
            "users": len(ages), "age_days_p25": p25, "age_days_p50": p50, "age_days_p75": p75,
            "within_1d": round(float(np.mean(ages < 1)), 3) if len(ages) else None,
            "within_7d": round(float(np.mean(ages < 7)), 3) if len(ages) else None,
        }
    out["users_ending_below_3"] = round(sum(len(s) < 3 for s in seen.values()) / max(len(first), 1), 3)
    years = Counter(time.gmtime(r.ts).tm_year for r in rows)
    out["ratings_per_year"] = {str(y): years[y] for y in sorted(years)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gnnstream.fraud.datasets", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="?", type=Path, default=BITCOIN_OTC,
                        help=f"SNAP signed-network CSV, plain or gzipped (default {BITCOIN_OTC})")
    args = parser.parse_args(argv)
    try:
        rows = read_snap(args.csv)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    print(json.dumps(rhythm(rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
