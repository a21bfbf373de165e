"""``gnnstream model export``: the layers as TorchScript and ONNX equal ours on sampled subgraphs of real data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch

from gnnstream.fraud.datasets import BITCOIN_ALPHA
from gnnstream.graph_state.store import GraphStore
from gnnstream.model import init_model_dir, load_model_dir
from gnnstream.model.export import SAMPLER_FILE, export_model
from gnnstream.stream.snap import FEATURE_DIM, read_snap, snap_events
from tests.workers.reference import call_gnnstream

FANOUTS = [6, 3]


def _subgraphs(tmp_path: Path, ratings: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Features and one sampled edge list per layer of the first ``ratings`` Bitcoin Alpha ratings."""
    with GraphStore(tmp_path / "state", seed=3, feature_dim=FEATURE_DIM) as store:
        store.apply(list(snap_events(read_snap(BITCOIN_ALPHA)[:ratings])))
        iids = list(store.node_iids())
        pos = {v: i for i, v in enumerate(iids)}
        feats, _ = store.feature_rows(iids)
        edges = [torch.tensor([[pos[u] for v in iids for u in store.sample_iids(v, k)],
                               [i for i, v in enumerate(iids) for _ in store.sample_iids(v, k)]])
                 for k in FANOUTS]
    return torch.from_numpy(feats), edges


@pytest.mark.parametrize(("arch", "heads"), [("sage", 1), ("gcn", 1), ("gat", 4)])
def test_exported_models_equal_our_layers(arch: str, heads: int, tmp_path: Path) -> None:
    model = tmp_path / "model"
    init_model_dir(model, arch, FEATURE_DIM, 16, 8, len(FANOUTS), FANOUTS, seed=5, heads=heads)
    ours = load_model_dir(model).model
    script = export_model(model, tmp_path / "ts" / "model.pt", "torchscript")
    onnx = export_model(model, tmp_path / "onnx" / "model.onnx", "onnx")
    assert script["fanouts"] == onnx["fanouts"] == FANOUTS and onnx["seed"] == 5
    assert [i["name"] for i in onnx["inputs"]] == ["x", "edge_index_0", "edge_index_1"]
    assert json.loads((tmp_path / "onnx" / SAMPLER_FILE).read_text())["file"] == "model.onnx"
    loaded = torch.jit.load(str(tmp_path / "ts" / "model.pt"))
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "model.onnx"))
    for ratings in (300, 2000):  # two subgraphs: node and edge counts are dynamic
        x, edges = _subgraphs(tmp_path / str(ratings), ratings)
        assert all(e.size(1) != edges[0].size(1) for e in edges[1:]) and x.size(0) > 50
        with torch.no_grad():
            want = ours(x, edges).numpy()
            got_script = loaded(x, edges).numpy()
        got_onnx = session.run(None, {"x": x.numpy(), "edge_index_0": edges[0].numpy(),
                                      "edge_index_1": edges[1].numpy()})[0]
        assert got_onnx.shape == want.shape == (x.size(0), 8)
        assert float(np.abs(got_script - want).max()) <= 1e-5
        assert float(np.abs(got_onnx - want).max()) <= 1e-5
        assert float(np.abs(want).max()) > 1e-2  # not a trivially zero output


def test_torchscript_file_loads_with_torch_alone(tmp_path: Path) -> None:
    model = tmp_path / "model"
    init_model_dir(model, "gat", FEATURE_DIM, 8, 4, 2, FANOUTS, seed=1, heads=2)
    proc = call_gnnstream("model", "export", model, "--format", "torchscript", "--out", tmp_path / "model.pt")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["sampler_file"] == str(tmp_path / SAMPLER_FILE)
    code = ("import sys, torch; m = torch.jit.load(sys.argv[1]); "
            "e = torch.tensor([[1, 2], [0, 0]]); print(m(torch.ones(3, 8), [e, e]).shape); "
            "print(sorted(k for k in sys.modules if k.startswith('gnnstream')))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.pt")], capture_output=True, text=True,
                         cwd=tmp_path, check=True).stdout.splitlines()
    assert out == ["torch.Size([3, 4])", "[]"]


def test_export_refuses_an_unknown_format(tmp_path: Path) -> None:
    proc = call_gnnstream("model", "export", tmp_path, "--format", "tflite", "--out", tmp_path / "m")
    assert proc.returncode == 2 and "invalid choice: 'tflite'" in proc.stderr
