"""Scoring heads saved in the model directory (``head.json``): a node head over a model's final embeddings
(what the scorer and the query API's what-ifs turn an embedding into a score with), or a typed model's
transaction head over the two ends' embeddings and the transaction's own features."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ScoreHead", "TransactionHead", "load_head", "load_transaction_head", "HEAD_FILE"]

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


@dataclass(frozen=True)
class TransactionHead:
    """``score = sigmoid(weights · (h_src ‖ h_dst ‖ x_e) + bias)``: probability that a transaction of
    ``relation`` (``src__rel__dst``) is fraudulent, from its two ends' final embeddings and its edge features."""

    relation: str
    weights: tuple[float, ...]
    bias: float
    model: str

    def score(self, h_src: np.ndarray, h_dst: np.ndarray, x_edge: np.ndarray) -> np.ndarray:
        z = np.concatenate([np.asarray(h_src, dtype=np.float64), np.asarray(h_dst, dtype=np.float64),
                            np.asarray(x_edge, dtype=np.float64)], axis=-1) @ np.asarray(self.weights) + self.bias
        return 1.0 / (1.0 + np.exp(-z))

    def save(self, directory: Path) -> None:
        (directory / HEAD_FILE).write_text(json.dumps({"relation": self.relation, "weights": list(self.weights),
                                                       "bias": self.bias, "model": self.model}))


def load_head(directory: str | Path) -> ScoreHead:
    """The node head of a model directory.

    Raises:
        FileNotFoundError: the directory has no ``head.json``.
        ValueError: its head scores transactions (a typed model's), not nodes.
    """
    path = Path(directory) / HEAD_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: train the model with `gnnstream train` to get a fraud head")
    data = json.loads(path.read_text())
    if "relation" in data:
        raise ValueError(f"{path} scores transactions of {data['relation']} (a typed model's head), not nodes")
    model = data.get("model")
    return ScoreHead(tuple(float(x) for x in data["weights"]), float(data["bias"]),
                     None if model is None else str(model))


def load_transaction_head(directory: str | Path) -> TransactionHead | None:
    """The transaction head of a typed model directory; None when its ``head.json`` scores nodes."""
    data = json.loads((Path(directory) / HEAD_FILE).read_text())
    if "relation" not in data:
        return None
    return TransactionHead(str(data["relation"]), tuple(float(x) for x in data["weights"]), float(data["bias"]),
                           str(data["model"]))
