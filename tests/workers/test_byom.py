"""Bring your own model: a model trained in PyTorch Geometric, imported, serves its own embeddings.

A real ``torch_geometric.nn.GraphSAGE`` and ``GAT`` are trained for a few epochs on the shipped Bitcoin Alpha
data and their ``state_dict`` saved as a user saves it (once per architecture and test process); ``gnnstream
model import`` turns it into a model directory; the events go through ``gnnstream apply`` and through Kafka
(``gnnstream run --exit-when-idle``, a worker process of its own);
every embedding equals the PyG module's own forward pass on the sampled edge list (built from the sampler's
rank formula in tests/workers/reference.py, with the cold-start policy applied).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from torch_geometric.nn import GAT, GraphSAGE

from gnnstream.fraud.datasets import BITCOIN_ALPHA
from gnnstream.fraud.train import distrust_labels
from gnnstream.stream.backends import KAFKA_CLIENTS, read_to_end
from gnnstream.stream.events import encode_event
from gnnstream.stream.kafka import ensure_topics
from gnnstream.stream.snap import FEATURE_DIM, read_snap, snap_events
from gnnstream.stream.updates import decode_update
from tests.workers.reference import (assert_embeddings_close, call_gnnstream, fold_jsonl, layer_edge_lists,
                                     neighbourhoods, run_gnnstream)

RATINGS = 3000
FANOUT = 10  # one fanout for both layers: the module's forward takes one edge list for every layer
SEED = 7
MIN_NEIGHBOURS = 2
PARTITIONS = 4


def _train_pyg(arch: str, x: torch.Tensor, edge_index: torch.Tensor, y: torch.Tensor, idx: torch.Tensor):
    torch.manual_seed(0)
    if arch == "sage":
        module = GraphSAGE(FEATURE_DIM, 32, 2, out_channels=16)
    else:
        module = GAT(FEATURE_DIM, 32, 2, out_channels=16, heads=4)
    head = torch.nn.Linear(16, 1)
    optim = torch.optim.Adam(list(module.parameters()) + list(head.parameters()), lr=0.01)
    losses = []
    for _ in range(20):
        optim.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(module(x, edge_index)[idx]).squeeze(-1), y)
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], "the module did not train"
    return module.eval()


class Data(NamedTuple):
    """The shipped ratings as events, their final graph, and what PyG is trained and run on."""
    events: Path
    order: list[str]
    nbrs: dict[str, set[str]]
    x: torch.Tensor
    edge_index: torch.Tensor
    y: torch.Tensor
    idx: torch.Tensor


class Imported(NamedTuple):
    """One architecture trained, imported and applied offline: what each test of it checks."""
    want: dict[str, np.ndarray]
    model: Path
    config: dict
    stored: dict[str, list[float]]
    modes: dict[str, str]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    rows = read_snap(BITCOIN_ALPHA)[:RATINGS]
    events = tmp_path_factory.mktemp("byom") / "events.jsonl"
    events.write_bytes(b"".join(encode_event(ev) + b"\n" for ev in snap_events(rows)))
    fold = fold_jsonl(events)
    order = sorted(fold.nodes)
    nbrs = neighbourhoods(order, fold.edges)
    x = torch.zeros(len(order), FEATURE_DIM)
    for i, v in enumerate(order):
        if v in fold.features:
            x[i] = torch.from_numpy(fold.features[v])
    (edge_index,) = layer_edge_lists(order, nbrs, SEED, [FANOUT], lambda degree: degree >= MIN_NEIGHBOURS)
    labels = distrust_labels(rows)
    pos = {v: i for i, v in enumerate(order)}
    return Data(events, order, nbrs, x, edge_index, torch.tensor(list(labels.values()), dtype=torch.float32),
                torch.tensor([pos[v] for v in labels]))


def _import(arch: str, data: Data, tmp_path: Path) -> Imported:
    module = _train_pyg(arch, data.x, data.edge_index, data.y, data.idx)
    with torch.no_grad():
        want = {v: e for v, e in zip(data.order, module(data.x, data.edge_index).numpy())}
    checkpoint = tmp_path / "user.pt"
    torch.save(module.state_dict(), checkpoint)  # as a user saves a model
    model = tmp_path / "model"
    proc = call_gnnstream("model", "import", checkpoint, model, "--arch", arch, "--fanouts", f"{FANOUT},{FANOUT}",
                          "--seed", SEED, "--cold-start", "feature_only", "--min-neighbours", MIN_NEIGHBOURS,
                          "--name", f"byom-{arch}")
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)
    # offline: apply the file, export the stored embeddings
    state = tmp_path / "state"
    proc = call_gnnstream("apply", "--state", state, "--model", model, data.events)
    assert proc.returncode == 0, proc.stderr
    proc = call_gnnstream("embeddings", "--state", state, "--out", tmp_path / "emb.jsonl")
    assert proc.returncode == 0, proc.stderr
    exported = list(map(json.loads, (tmp_path / "emb.jsonl").read_text().splitlines()))
    return Imported(want, model, config, {o["id"]: o["embedding"] for o in exported},
                    {o["id"]: o["mode"] for o in exported})


@pytest.fixture(scope="module")
def imported(data: Data, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Imported]:
    """Each architecture trained, imported and applied once per test process; the tests of one architecture
    share an ``xdist_group`` so that they run in one process."""
    done: dict[str, Imported] = {}

    def get(arch: str) -> Imported:
        if arch not in done:
            done[arch] = _import(arch, data, tmp_path_factory.mktemp(f"byom-{arch}"))
        return done[arch]

    return get


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.parametrize("kafka_client", KAFKA_CLIENTS)
@pytest.mark.parametrize("arch", [pytest.param(arch, marks=pytest.mark.xdist_group(f"byom-{arch}"))
                                  for arch in ("sage", "gat")])
def test_a_pyg_model_serves_its_own_embeddings(arch: str, kafka_client: str, data: Data,
                                               imported: Callable[[str], Imported], broker, tmp_path: Path) -> None:
    events, order, nbrs = data.events, data.order, data.nbrs
    want, model, config, stored, modes = imported(arch)
    assert (config["in_dim"], config["hidden_dim"], config["out_dim"], config["heads"]) == \
        (FEATURE_DIM, 32, 16, 4 if arch == "gat" else 1)
    assert_embeddings_close(stored, want, what=f"{arch} via apply")

    # streaming: produce the file, run the worker until idle, read what it published
    tag = uuid.uuid4().hex[:8]
    topics = {"events": f"ev-{tag}", "output": f"emb-{tag}", "dlq": f"dlq-{tag}"}
    ensure_topics(broker.bootstrap, {topics["events"]: PARTITIONS, topics["output"]: PARTITIONS, topics["dlq"]: 1})
    proc = call_gnnstream("produce", "--bootstrap", broker.bootstrap, "--kafka-client", kafka_client,
                          "--events-topic", topics["events"], "--partitions", PARTITIONS, events)
    assert proc.returncode == 0, proc.stderr
    proc = run_gnnstream("run", "--bootstrap", broker.bootstrap, "--kafka-client", kafka_client,
                         "--state", tmp_path / "state-kafka", "--model",
                         model, "--events-topic", topics["events"], "--output-topic", topics["output"],
                         "--dlq-topic", topics["dlq"], "--group", f"g-{tag}", "--partitions", PARTITIONS,
                         "--metrics-port", 0, "--exit-when-idle", 5)
    assert proc.returncode == 0, proc.stderr[-3000:]
    latest: dict[str, tuple[int, list[float]]] = {}
    for record in read_to_end(kafka_client, broker.bootstrap, topics["output"], timeout_s=120.0):
        update = decode_update(record.value)
        if update.id not in latest or update.version > latest[update.id][0]:
            latest[update.id] = (update.version, list(update.embedding))
    assert_embeddings_close({v: e for v, (_, e) in latest.items()}, want, what=f"{arch} via Kafka")
    assert {modes[v] for v in order if len(nbrs[v]) < MIN_NEIGHBOURS} == {"feature_only"}
