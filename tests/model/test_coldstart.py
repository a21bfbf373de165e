"""Cold-start policies."""

from __future__ import annotations

import numpy as np
import pytest

from gnnstream.model.coldstart import STAGE_EXPANDED, STAGE_FULL, STAGE_NONE, StagedPolicy
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


def test_staged() -> None:
    config = {"policy": "staged", "feature_only_s": 86400, "expand_s": 259200, "min_neighbours": 3}
    policy = policy_from_config(config)
    assert policy == StagedPolicy(86400, 259200, 3) and policy.to_config() == config
    assert policy.age_marks == (86400.0, 259200.0)
    degree = np.asarray([0, 5, 0, 2, 3, 0, 9])
    age = np.asarray([0, 86399.5, 86400, 259199, 100000, 259200, 1e9])
    assert policy.stages(degree, age).tolist() == [STAGE_NONE, STAGE_NONE, STAGE_EXPANDED, STAGE_EXPANDED,
                                                   STAGE_FULL, STAGE_FULL, STAGE_FULL]
    assert [policy.stage_mode(True, 0, s) for s in (STAGE_NONE, STAGE_EXPANDED, STAGE_FULL)] == \
        ["feature_only", "expanded", "full"]
    assert {policy.stage_mode(False, 0, s) for s in (STAGE_NONE, STAGE_EXPANDED, STAGE_FULL)} == {"cold_start"}
    # F = E: no expanded stage; m = 0: nobody is sparse enough to expand
    assert policy_from_config({**config, "expand_s": 86400}).stages(degree, age).tolist().count(STAGE_EXPANDED) == 0
    assert policy_from_config({**config, "min_neighbours": 0}).stages(degree, age).tolist().count(STAGE_EXPANDED) == 0


@pytest.mark.parametrize("config, error, message", [
    ({"policy": "staged", "feature_only_s": 5, "expand_s": 4, "min_neighbours": 1}, InvalidModelConfig,
     "expand_s (4) must be >= cold_start.feature_only_s (5)"),
    ({"policy": "staged", "feature_only_s": -1, "expand_s": 4, "min_neighbours": 1}, InvalidModelConfig,
     "feature_only_s must be a number of seconds >= 0 (got -1)"),
    ({"policy": "staged", "feature_only_s": 1, "expand_s": 4}, InvalidModelConfig, "needs ['min_neighbours']"),
    ({"policy": "staged", "feature_only_s": 1, "expand_s": True, "min_neighbours": 1}, InvalidModelConfig,
     "expand_s must be a number of seconds"),
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
