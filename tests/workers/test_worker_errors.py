"""The worker under Kafka errors, without a broker: permanent ones acted on once, transient ones retried and
reported by /healthz after a bound, output that could not be sent refused at start."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from gnnstream.stream.events import MAX_ID_BYTES
from gnnstream.stream.exceptions import DeliveryError, StreamError
from gnnstream.stream.updates import encode_updates, largest_update_bytes
from gnnstream.workers.settings import WorkerSettings
from gnnstream.workers.runtime.publisher import Outgoing
from gnnstream.workers.runtime.worker import Worker
from tests.workers.reference import run_gnnstream


class FakeDelivery:
    """Raises the given errors from :meth:`deliver`, one per call, then succeeds."""

    def __init__(self, *errors: BaseException):
        self.errors = list(errors)
        self.calls = 0

    def deliver(self, columns: list, timeout_s: float, headers: object = None) -> None:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)


def _worker() -> Worker:
    worker = Worker(WorkerSettings(output_topic="emb"))
    worker.output_topic = "emb"
    worker._delivered = lambda out, seconds: None  # type: ignore[method-assign]
    return worker


def _out() -> Outgoing:
    return Outgoing([b"k"], [], np.zeros(1))


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["unknown_topic", "not_authorised", "record_too_large", "invalid_record"])
def test_a_permanent_publish_error_stops_the_worker_once(kind: str) -> None:
    worker = _worker()
    delivery = FakeDelivery(DeliveryError("refused", failed=1, kind=kind))
    sender = worker._new_publisher(None, delivery)  # type: ignore[arg-type]
    try:
        sender.submit(_out())
        _until(lambda: sender.failure is not None, "the publisher thread to give up")
    finally:
        sender.close(1.0)
    assert delivery.calls == 1
    assert isinstance(sender.failure, StreamError)
    assert f"topic 'emb' refuses the embedding updates ({kind})" in str(sender.failure)


def test_a_transient_publish_error_is_retried_until_it_passes() -> None:
    worker = _worker()
    delivery = FakeDelivery(DeliveryError("no answer", pending=3), DeliveryError("down", kind="broker_unavailable"))
    sender = worker._new_publisher(None, delivery)  # type: ignore[arg-type]
    out = _out()
    try:
        sender.submit(out)
        _until(lambda: delivery.calls == 3 and not sender.in_flight(), "the batch delivered")
    finally:
        sender.close(1.0)
    assert sender.failure is None and sender.delivered() == [out]
    assert "publish" not in worker.errors and "publish" not in worker.errors.failing


def test_healthz_turns_503_when_a_transient_error_lasts() -> None:
    worker = _worker()
    worker.health.status = "consuming"
    worker.health.last_poll = time.time()
    worker.errors.recoverable("dead_letter", DeliveryError("down", kind="broker_unavailable"), pause=False)
    assert worker.health_info()["ok"] is True  # a retry may cure it: not yet
    since, attempts = worker.errors.failing["dead_letter"]
    worker.errors.failing["dead_letter"] = (since - 31.0, attempts)
    info = worker.health_info()
    assert info["ok"] is False and info["reason"].startswith("dead_letter failing for 31 s, retrying")
    worker.errors.cleared("dead_letter")
    assert worker.health_info()["ok"] is True


def test_the_backoff_grows_between_attempts() -> None:
    worker = _worker()
    pauses = [worker.errors.recoverable("poll", DeliveryError("down"), pause=False) for _ in range(6)]
    assert pauses == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


@pytest.mark.parametrize("fmt", ["json", "binary"])
def test_the_largest_update_bound_holds(fmt: str) -> None:
    rng = np.random.default_rng(0)
    ids = ["\u00e9" * (MAX_ID_BYTES // 2), "\x01" * MAX_ID_BYTES, "x"]
    rows = np.stack([np.full(64, -1.2345679e-38, dtype=np.float32),
                     rng.uniform(-3.4e38, 3.4e38, 64).astype(np.float32),
                     (rng.standard_normal(64) * 1e-30).astype(np.float32)])
    values = encode_updates(ids, "model:123", [2**63 - 1] * 3, [1.7e9 + 0.123456789] * 3, 1.7e9 + 0.987654321,
                            ["cold_start", "feature_only", "full"], rows, fmt)
    bound = largest_update_bytes(64, "model:123", fmt)
    assert max(len(i.encode()) + len(v) for i, v in zip(ids, values)) <= bound


def test_a_model_too_wide_to_send_is_refused_at_start(tmp_path: Path) -> None:
    from gnnstream.model import init_model_dir
    model = tmp_path / "wide"
    init_model_dir(str(model), arch="sage", in_dim=4, hidden=8, out_dim=20_000, layers=1, fanouts=[2], seed=0)
    common = ["run", "--bootstrap", "127.0.0.1:1", "--model", model, "--metrics-port", 0, "--broker-wait-s", 1,
              "--max-message-bytes", 100_000]
    res = run_gnnstream(*common, "--state", tmp_path / "s1")
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "may take" in line and "--max-message-bytes" in line and "--output-format binary" in line, line
    # binary fits (20,000 x 4 bytes): the start goes on to wait for Kafka, which is not there
    res = run_gnnstream(*common, "--output-format", "binary", "--state", tmp_path / "s2")
    assert res.returncode == 2 and "cannot reach Kafka" in res.stderr, res.stderr
