"""ModelConfig validation."""

from __future__ import annotations

import pytest

from gnnstream.model import InvalidModelConfig, ModelConfig, UnknownArchitecture, UnknownColdStartPolicy

BASE = dict(arch="gat", in_dim=4, hidden_dim=8, out_dim=2, num_layers=2, fanouts=[3, 1], seed=1, heads=2)


def test_round_trip() -> None:
    config = ModelConfig.from_dict(BASE)
    assert config.fanouts == (3, 1)
    assert config.cold_start == {"policy": "plain"}
    assert config.weights_sha256 is None
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["fanouts"] == [3, 1]
    assert config.with_sha256("a" * 64).weights_sha256 == "a" * 64


@pytest.mark.parametrize("changes, error, message", [
    ({"arch": "gin"}, UnknownArchitecture, "unknown arch 'gin'"),
    ({"fanouts": [3]}, InvalidModelConfig, "fanouts has 1 entries but num_layers is 2"),
    ({"fanouts": [3, -1]}, InvalidModelConfig, "non-negative integers"),
    ({"fanouts": 3}, InvalidModelConfig, "list of integers"),
    ({"in_dim": 0}, InvalidModelConfig, "in_dim must be a positive integer (got 0)"),
    ({"num_layers": True}, InvalidModelConfig, "num_layers must be a positive integer"),
    ({"hidden_dim": 9}, InvalidModelConfig, "hidden_dim (9) must be divisible by heads (2)"),
    ({"arch": "sage"}, InvalidModelConfig, "heads only applies to arch 'gat'"),
    ({"seed": "x"}, InvalidModelConfig, "seed must be an integer"),
    ({"name": "a:b"}, InvalidModelConfig, "name must be a non-empty string"),
    ({"weights_sha256": "xyz"}, InvalidModelConfig, "64 lowercase hex"),
    ({"cold_start": {"policy": "nope"}}, UnknownColdStartPolicy, "unknown cold_start policy 'nope'"),
    ({"extra": 1}, InvalidModelConfig, "unknown key(s) ['extra']"),
])
def test_invalid(changes, error, message) -> None:
    with pytest.raises(error) as info:
        ModelConfig.from_dict({**BASE, **changes})
    assert message in str(info.value)


def test_missing_keys() -> None:
    data = dict(BASE)
    del data["seed"], data["fanouts"]
    with pytest.raises(InvalidModelConfig, match=r"missing required key\(s\) \['fanouts', 'seed'\]"):
        ModelConfig.from_dict(data)


def test_single_layer_gat_needs_no_divisibility() -> None:
    assert ModelConfig.from_dict({**BASE, "num_layers": 1, "fanouts": [2], "hidden_dim": 7}).num_layers == 1
