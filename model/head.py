"""A scoring head over a model's final embeddings, saved in the model directory (``head.json``): what the
scorer and the query API's what-ifs turn an embedding into a score with."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ScoreHead", "load_head", "HEAD_FILE"]

HEAD_FILE = "head.json"


@dataclass(frozen=True)
class ScoreHead:
    """``score = sigmoid(weights · embedding + bias)``: probability of being distrusted.

    ``model`` is the ``NAME:VERSION`` tag of the model whose embeddings the
    head was trained on (``None`` for a head saved before the tag was recorded:
    then updates of any model are scored).
    """

    weights: tuple[float, ...]
    bias: float
    model: str | None = None

    def score(self, embeddings: np.ndarray) -> np.ndarray:
        z = np.asarray(embeddings, dtype=np.float64) @ np.asarray(self.weights) + self.bias
        return 1.0 / (1.0 + np.exp(-z))

    def save(self, directory: Path) -> None:
        data: dict[str, Any] = {"weights": list(self.weights), "bias": self.bias}
        if self.model is not None:
            data["model"] = self.model
        (directory / HEAD_FILE).write_text(json.dumps(data))


def load_head(directory: str | Path) -> ScoreHead:
    path = Path(directory) / HEAD_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: train the model with `gnnstream train` to get a fraud head")
    data = json.loads(path.read_text())
    model = data.get("model")
    return ScoreHead(tuple(float(x) for x in data["weights"]), float(data["bias"]),
                     None if model is None else str(model))
