"""model: pure-torch GNN layers, model directories and cold-start policies.

Imports neither Kafka nor RocksDB nor PyTorch Geometric; PyG is only the
reference the tests compare against.
"""

from gnnstream.model.coldstart import (
    MODE_COLD_START,
    MODE_FEATURE_ONLY,
    MODE_FULL,
    ColdStartPolicy,
    FeatureOnlyPolicy,
    PlainPolicy,
    policy_from_config,
)
from gnnstream.model.config import ARCHITECTURES, ModelConfig
from gnnstream.model.directory import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoadedModel,
    check_state_dict,
    init_model_dir,
    load_model_dir,
    save_model_dir,
)
from gnnstream.model.exceptions import (
    ChecksumMismatch,
    CorruptWeights,
    InvalidModelConfig,
    ModelDirExists,
    ModelDirNotFound,
    ModelError,
    ModelFileMissing,
    UnknownArchitecture,
    UnknownColdStartPolicy,
    WeightsMismatch,
)
from gnnstream.model.gat import GATLayer
from gnnstream.model.gcn import GCNLayer
from gnnstream.model.network import GNN, build_layer
from gnnstream.model.sage import SAGELayer

__all__ = [
    "ARCHITECTURES",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "MODE_FULL",
    "MODE_COLD_START",
    "MODE_FEATURE_ONLY",
    "SAGELayer",
    "GCNLayer",
    "GATLayer",
    "GNN",
    "build_layer",
    "ModelConfig",
    "LoadedModel",
    "load_model_dir",
    "save_model_dir",
    "init_model_dir",
    "check_state_dict",
    "ColdStartPolicy",
    "PlainPolicy",
    "FeatureOnlyPolicy",
    "policy_from_config",
    "ModelError",
    "InvalidModelConfig",
    "UnknownArchitecture",
    "UnknownColdStartPolicy",
    "ModelDirNotFound",
    "ModelFileMissing",
    "ModelDirExists",
    "ChecksumMismatch",
    "CorruptWeights",
    "WeightsMismatch",
]
