"""Model directories: round trip, seeded init, and clear errors for every broken directory."""

from __future__ import annotations

import json

import pytest
import torch
from torch_geometric.nn.models import GraphSAGE

from gnnstream.model import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ChecksumMismatch,
    CorruptWeights,
    FeatureOnlyPolicy,
    InvalidModelConfig,
    ModelConfig,
    ModelDirExists,
    ModelDirNotFound,
    ModelError,
    ModelFileMissing,
    UnknownArchitecture,
    UnknownColdStartPolicy,
    WeightsMismatch,
    init_model_dir,
    load_model_dir,
    save_model_dir,
)
from gnnstream.model.directory import file_sha256


@pytest.fixture()
def model_dir(tmp_path):
    path = tmp_path / "m"
    init_model_dir(path, "sage", 4, 8, 3, 2, [5, 2], seed=3, name="fraud", version=2)
    return path


def rewrite_config(path, **changes) -> None:
    data = json.loads((path / CONFIG_FILE).read_text())
    data.update(changes)
    (path / CONFIG_FILE).write_text(json.dumps(data))


def test_init_and_load_round_trip(model_dir) -> None:
    data = json.loads((model_dir / CONFIG_FILE).read_text())
    assert data == {
        "arch": "sage", "in_dim": 4, "hidden_dim": 8, "out_dim": 3, "num_layers": 2, "fanouts": [5, 2],
        "seed": 3, "heads": 1, "cold_start": {"policy": "plain"}, "name": "fraud", "version": 2,
        "weights_sha256": file_sha256(model_dir / WEIGHTS_FILE),
    }
    loaded = load_model_dir(model_dir)
    assert loaded.config.model_id == "fraud:2"
    assert loaded.config.fanouts == (5, 2)
    assert loaded.path == model_dir
    assert loaded.cold_start.name == "plain"
    state = torch.load(model_dir / WEIGHTS_FILE, weights_only=True)
    assert sorted(state) == ["convs.0.lin_l.bias", "convs.0.lin_l.weight", "convs.0.lin_r.weight",
                             "convs.1.lin_l.bias", "convs.1.lin_l.weight", "convs.1.lin_r.weight"]
    for key, value in loaded.model.state_dict().items():
        assert torch.equal(value, state[key])


def test_init_is_seeded_and_leaves_global_rng_alone(tmp_path) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = init_model_dir(tmp_path / "a", "gat", 4, 8, 3, 2, [2, 2], seed=5, heads=2)
    assert torch.equal(torch.rand(1), expected_next)
    torch.manual_seed(123)
    load_model_dir(tmp_path / "a")
    assert torch.equal(torch.rand(1), expected_next)
    b = init_model_dir(tmp_path / "b", "gat", 4, 8, 3, 2, [2, 2], seed=5, heads=2)
    c = init_model_dir(tmp_path / "c", "gat", 4, 8, 3, 2, [2, 2], seed=6, heads=2)
    wa, wb, wc = (load_model_dir(tmp_path / n).model.state_dict() for n in "abc")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    assert a.weights_sha256 == b.weights_sha256 != c.weights_sha256


def test_init_refuses_to_overwrite(model_dir) -> None:
    with pytest.raises(ModelDirExists, match="overwrite=True"):
        init_model_dir(model_dir, "sage", 4, 8, 3, 2, [5, 2], seed=3)
    init_model_dir(model_dir, "gcn", 4, 8, 3, 1, [5], seed=3, overwrite=True)
    assert load_model_dir(model_dir).config.arch == "gcn"


def test_cold_start_is_stored(tmp_path) -> None:
    init_model_dir(tmp_path, "gcn", 2, 2, 2, 1, [3], seed=0, cold_start={"policy": "feature_only",
                                                                        "min_neighbours": 2})
    assert load_model_dir(tmp_path).cold_start == FeatureOnlyPolicy(min_neighbours=2)


def test_missing_directory(tmp_path) -> None:
    with pytest.raises(ModelDirNotFound, match="does not exist") as info:
        load_model_dir(tmp_path / "nope")
    assert "nope" in str(info.value)


@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE])
def test_missing_file(model_dir, name: str) -> None:
    (model_dir / name).unlink()
    with pytest.raises(ModelFileMissing) as info:
        load_model_dir(model_dir)
    assert f"has no {name}" in str(info.value)
    assert "save_model_dir" in str(info.value)


def test_checksum_mismatch(model_dir) -> None:
    state = torch.load(model_dir / WEIGHTS_FILE, weights_only=True)
    state["convs.0.lin_l.bias"] += 1.0
    torch.save(state, model_dir / WEIGHTS_FILE)
    with pytest.raises(ChecksumMismatch) as info:
        load_model_dir(model_dir)
    message = str(info.value)
    assert WEIGHTS_FILE in message and file_sha256(model_dir / WEIGHTS_FILE) in message
    assert "different saves" in message and "re-export" in message


def test_missing_sha_is_rejected(model_dir) -> None:
    rewrite_config(model_dir, weights_sha256=None)
    with pytest.raises(InvalidModelConfig, match="no weights_sha256"):
        load_model_dir(model_dir)


def test_wrong_dims(model_dir) -> None:
    rewrite_config(model_dir, in_dim=5)  # weights were made for in_dim=4
    with pytest.raises(WeightsMismatch) as info:
        load_model_dir(model_dir)
    message = str(info.value)
    assert "wrong dims for 'convs.0.lin_l.weight'" in message
    assert "expected shape [8, 5]" in message and "got [8, 4]" in message
    assert "fix the dims in config.json" in message


def test_wrong_layer_count(model_dir) -> None:
    rewrite_config(model_dir, num_layers=3, fanouts=[5, 2, 2])
    with pytest.raises(WeightsMismatch, match=r"missing keys \['convs.2.lin_l.weight'"):
        load_model_dir(model_dir)


def test_save_rejects_mismatched_state_dict(tmp_path) -> None:
    config = ModelConfig(arch="gcn", in_dim=4, hidden_dim=8, out_dim=3, num_layers=2, fanouts=(2, 2), seed=0)
    with pytest.raises(WeightsMismatch, match="unexpected keys"):
        save_model_dir(tmp_path, config, GraphSAGE(4, 8, 2, out_channels=3).state_dict())
    assert not (tmp_path / CONFIG_FILE).exists()


def test_unknown_arch(model_dir) -> None:
    rewrite_config(model_dir, arch="gin")
    with pytest.raises(UnknownArchitecture) as info:
        load_model_dir(model_dir)
    assert "'gin'" in str(info.value) and "['sage', 'gcn', 'gat']" in str(info.value)
    assert CONFIG_FILE in str(info.value)


def test_unknown_cold_start_policy(model_dir) -> None:
    rewrite_config(model_dir, cold_start={"policy": "neighbour_magic"})
    with pytest.raises(UnknownColdStartPolicy) as info:
        load_model_dir(model_dir)
    assert "'neighbour_magic'" in str(info.value) and "['feature_only', 'plain', 'staged']" in str(info.value)


def test_fanouts_length(model_dir) -> None:
    rewrite_config(model_dir, fanouts=[5])
    with pytest.raises(InvalidModelConfig, match="fanouts has 1 entries but num_layers is 2; give exactly one"):
        load_model_dir(model_dir)


def test_invalid_json_and_unknown_keys(model_dir) -> None:
    rewrite_config(model_dir, colour="blue")
    with pytest.raises(InvalidModelConfig, match=r"unknown key\(s\) \['colour'\]"):
        load_model_dir(model_dir)
    (model_dir / CONFIG_FILE).write_text("{not json")
    with pytest.raises(InvalidModelConfig, match="not valid JSON"):
        load_model_dir(model_dir)


def test_corrupt_weights(model_dir) -> None:
    (model_dir / WEIGHTS_FILE).write_bytes(b"garbage")
    rewrite_config(model_dir, weights_sha256=file_sha256(model_dir / WEIGHTS_FILE))
    with pytest.raises(CorruptWeights, match="cannot be read as a state dict"):
        load_model_dir(model_dir)


def test_all_errors_are_model_errors() -> None:
    for exc in (ChecksumMismatch, CorruptWeights, InvalidModelConfig, ModelDirNotFound, ModelFileMissing,
                UnknownArchitecture, UnknownColdStartPolicy, WeightsMismatch, ModelDirExists):
        assert issubclass(exc, ModelError)
