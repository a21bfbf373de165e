"""What the demos' live runs share: the replay process, the query API's JSON calls and the freshness
statistics."""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any

import numpy as np

from gnnstream.workers.offline.replay import produce_file

__all__ = ["percentile", "trend_per_min", "post_json", "replay_process"]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` to the millisecond (None for none)."""
    return round(float(np.percentile(values, q)), 3) if values else None


def trend_per_min(timeline: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of ``(time, value)`` pairs, per minute: near 0 when a pipeline keeps pace."""
    if len(timeline) < 3:
        return None
    t = np.array([x for x, _ in timeline])
    return round(60.0 * float(np.polyfit(t - t[0], [y for _, y in timeline], 1)[0]), 4)


def post_json(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST path`` with a JSON body to the query API on ``port``; the JSON answer."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def replay_process(ready: Any, go: Any, results: Any, bootstrap: str, data: str, **options: Any) -> None:
    """The replay process: sets ``ready`` once imported, waits for ``go``, sends the JSONL file ``data``
    (:func:`produce_file` with ``options``), puts its counts (or an error line) on ``results``."""
    os.environ["GNNSTREAM_NO_PROGRESS"] = "1"  # the parent prints the progress
    ready.set()
    go.wait()
    try:
        results.put(produce_file(bootstrap, data, fmt="jsonl", **options))
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")
