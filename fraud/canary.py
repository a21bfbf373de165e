"""The canary report of a rollout: a fraction of nodes scored by every version, and how the versions' scores
differ (Kolmogorov-Smirnov distance, quantiles)."""

from __future__ import annotations

import itertools
import zlib
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["canary_mask", "ks_statistic", "compare_scores"]

_QUANTILES = (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))


def canary_mask(ids: Sequence[str], fraction: float) -> np.ndarray:
    """Which nodes are in a canary of ``fraction`` (0..1): ``crc32(id as UTF-8) / 2**32 < fraction``."""
    if fraction <= 0:
        return np.zeros(len(ids), dtype=bool)
    crc = zlib.crc32
    hashes = np.fromiter((crc(i.encode()) for i in ids), dtype=np.float64, count=len(ids))
    return hashes < fraction * 2.0 ** 32


def ks_statistic(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float | None:
    """The two-sample Kolmogorov–Smirnov statistic: the largest distance between the two empirical CDFs
    (0: same distribution of values, 1: disjoint ranges); ``None`` when either sample is empty."""
    a = np.sort(np.asarray(a, dtype=np.float64))
    b = np.sort(np.asarray(b, dtype=np.float64))
    if not len(a) or not len(b):
        return None
    points = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, points, side="right") / len(a)
    cdf_b = np.searchsorted(b, points, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def _distribution(scores: np.ndarray) -> dict[str, Any]:
    if not len(scores):
        return {"nodes": 0, "mean": None, **{name: None for name, _ in _QUANTILES}}
    quantiles = np.quantile(scores, [q for _, q in _QUANTILES]).tolist()
    return {"nodes": len(scores), "mean": float(scores.mean()),
            **{name: value for (name, _), value in zip(_QUANTILES, quantiles)}}


def compare_scores(latest: Mapping[str, Mapping[str, float]], serving: str | None = None) -> dict[str, Any]:
    """How the score distributions of several models differ.

    Args:
        latest: ``{model: {node: score}}``, each node's latest score per model.
        serving: the serving model (listed first; added with no nodes when missing from ``latest``).

    Returns:
        ``{"serving": serving, "models": {model: {"nodes", "mean", "p10", "p50", "p90"}}, "pairs": [{"models":
        [a, b], "nodes", "mean_abs_diff", "max_abs_diff", "ks"}]}``: models serving first then by name, a
        pair per two models (``a`` before ``b`` in that order); a pair's statistics are over the nodes both
        scored (``None`` when there are none). Statistics of no nodes are ``None``.
    """
    names = sorted(set(latest) - {serving})
    if serving is not None:
        names.insert(0, serving)
    models = {m: _distribution(np.fromiter(latest.get(m, {}).values(), dtype=np.float64)) for m in names}
    pairs = []
    for a, b in itertools.combinations(names, 2):
        sa, sb = latest.get(a, {}), latest.get(b, {})
        both = sa.keys() & sb.keys()
        xa = np.fromiter((sa[n] for n in both), dtype=np.float64, count=len(both))
        xb = np.fromiter((sb[n] for n in both), dtype=np.float64, count=len(both))
        diff = np.abs(xa - xb)
        pairs.append({"models": [a, b], "nodes": len(both),
                      "mean_abs_diff": float(diff.mean()) if len(both) else None,
                      "max_abs_diff": float(diff.max()) if len(both) else None,
                      "ks": ks_statistic(xa, xb)})
    return {"serving": serving, "models": models, "pairs": pairs}
