"""Cold-start policies."""

from __future__ import annotations

import pytest

from gnnstream.model import (
    MODE_COLD_START,
    MODE_FEATURE_ONLY,
    MODE_FULL,
    FeatureOnlyPolicy,
    InvalidModelConfig,
    PlainPolicy,
    UnknownColdStartPolicy,
    policy_from_config,
)


def test_plain() -> None:
    policy = policy_from_config({"policy": "plain"})
    assert policy == PlainPolicy() == policy_from_config(None)
    assert policy.uses_neighbours(0) and policy.uses_neighbours(10)
    assert policy.mode(True, 0) == MODE_FULL == "full"
    assert policy.mode(False, 5) == MODE_COLD_START == "cold_start"
    assert policy.to_config() == {"policy": "plain"}


def test_feature_only() -> None:
    policy = policy_from_config({"policy": "feature_only", "min_neighbours": 3})
    assert policy == FeatureOnlyPolicy(min_neighbours=3)
    assert [policy.uses_neighbours(d) for d in range(5)] == [False, False, False, True, True]
    assert policy.mode(True, 2) == MODE_FEATURE_ONLY == "feature_only"
    assert policy.mode(False, 2) == MODE_FEATURE_ONLY
    assert policy.mode(True, 3) == MODE_FULL
    assert policy.mode(False, 3) == MODE_COLD_START
    assert policy_from_config(policy.to_config()) == policy
    assert policy_from_config({"policy": "feature_only"}) == FeatureOnlyPolicy(min_neighbours=1)


@pytest.mark.parametrize("config, error, message", [
    ({"policy": "expand"}, UnknownColdStartPolicy, "unknown cold_start policy 'expand'; set cold_start.policy"),
    ({}, InvalidModelConfig, "must be an object with a \"policy\" key"),
    ("plain", InvalidModelConfig, "must be an object"),
    ({"policy": "plain", "min_neighbours": 2}, InvalidModelConfig, "unknown option(s) ['min_neighbours']"),
    ({"policy": "feature_only", "min_neighbours": 0}, InvalidModelConfig, "integer >= 1 (got 0)"),
    ({"policy": "feature_only", "k": 1}, InvalidModelConfig, "unknown option(s) ['k']"),
])
def test_invalid(config, error, message) -> None:
    with pytest.raises(error) as info:
        policy_from_config(config)
    assert message in str(info.value)
