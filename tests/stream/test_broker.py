"""Embedded broker lifecycle: start, stop, pause, resume, errors, foreground command."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gnnstream.stream.broker as broker_module
from gnnstream.stream.broker import (EmbeddedBroker, _all_threads_stopped, _metadata_ok, _port_is_free, free_port,
                                     listening_on)
from gnnstream.stream.exceptions import BrokerBinaryNotFound, BrokerError, BrokerPortInUse

pytestmark = pytest.mark.broker
DEADLINE_S = 60.0  # safety net of the waits below, never what a test measures


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): look at its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_start_pause_resume_stop(tmp_path: Path) -> None:
    log = tmp_path / "broker.log"
    broker = EmbeddedBroker(log_path=log)
    with pytest.raises(BrokerError, match="not started"):
        broker.bootstrap  # noqa: B018
    with broker:
        port, pid = broker.port, broker.pid
        assert broker.bootstrap == f"127.0.0.1:{port}"
        assert broker.running and _alive(pid)
        assert _metadata_ok(port)
        broker.pause()
        assert "paused" in repr(broker)
        assert _all_threads_stopped(pid)  # pause() returns once SIGSTOP took hold of every thread
        assert not _metadata_ok(port, timeout_s=0.3)  # connected, but nobody answers
        broker.resume()
        assert _metadata_ok(port)
        assert not _all_threads_stopped(pid)
    assert not broker.running and broker.pid is None
    assert not _alive(pid)
    assert _port_is_free(port)
    assert log.exists()  # a log file given by the caller is kept
    assert broker.stop() is None  # stopping twice is harmless


def test_stop_while_paused_and_own_log_removed(caplog: pytest.LogCaptureFixture) -> None:
    broker = EmbeddedBroker().start()
    pid, log = broker.pid, broker.log_path
    assert log is not None and log.exists()
    broker.pause()
    with caplog.at_level(logging.WARNING, logger="gnnstream.stream.broker"):
        code = broker.stop()
    assert code == 0, "a paused broker must be woken and stop on SIGINT, not be killed"
    assert "ignored SIGINT and SIGTERM" not in caplog.text
    assert not _alive(pid)
    assert not log.exists()


def test_port_in_use_is_a_clear_error(broker: EmbeddedBroker) -> None:
    taken = EmbeddedBroker(broker.port)
    with pytest.raises(BrokerPortInUse, match=f"port {broker.port}.*already in use"):
        taken.start()
    assert taken.log_path is None  # the temporary directory made for its log went with the failed start


def test_explicit_port_and_bad_port() -> None:
    for _ in range(5):  # a picked port can be taken before the broker binds it: pick another
        port = free_port()
        try:
            with EmbeddedBroker(port) as b:
                assert b.bootstrap == f"127.0.0.1:{port}"
                assert listening_on([b.pid], port)
            break
        except BrokerPortInUse:
            continue
    else:
        pytest.fail("five picked ports were all taken")
    with pytest.raises(ValueError, match="port"):
        EmbeddedBroker(70000)


def test_a_port_taken_after_it_was_picked_is_picked_again(broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The race: a port free when picked is another broker's by the time Tansu binds it. That broker answers
    the start-up probe, and Tansu exits: the start must not stop there, but pick another port."""
    picks = iter([broker.port])
    monkeypatch.setattr(broker_module, "free_port", lambda: next(picks, None) or free_port())
    with caplog.at_level(logging.WARNING, logger="gnnstream.stream.broker"), EmbeddedBroker() as mine:
        assert mine.port != broker.port
        assert listening_on([mine.pid], mine.port) and not listening_on([mine.pid], broker.port)
        assert mine.running and _metadata_ok(mine.port)
    assert f"port {broker.port} was taken before the broker could bind it" in caplog.text


def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CALF_TANSU_BIN", str(tmp_path / "no-such-tansu"))
    with pytest.raises(BrokerBinaryNotFound, match="no-such-tansu"):
        EmbeddedBroker().start()


def test_pause_requires_running() -> None:
    with pytest.raises(BrokerError, match="not running"):
        EmbeddedBroker().pause()


def test_foreground_prints_bootstrap_and_stops_on_ctrl_c() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from gnnstream.stream.broker import run_broker_foreground; "
                               "sys.exit(run_broker_foreground())"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        host, _, port = line.rpartition(":")
        assert host == "127.0.0.1" and port.isdigit(), line
        port = int(port)
        assert _metadata_ok(port)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(DEADLINE_S) == 0
        deadline = time.monotonic() + DEADLINE_S
        while not _port_is_free(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _port_is_free(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_foreground_exits_non_zero_when_the_broker_dies() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from gnnstream.stream.broker import run_broker_foreground; "
                               "sys.exit(run_broker_foreground())"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip().startswith("127.0.0.1:")
        banner = proc.stderr.readline()
        broker_pid = int(banner.split(" pid ")[1].split(",")[0])
        log = Path(banner.split(" log ")[1].split(";")[0])
        os.kill(broker_pid, signal.SIGKILL)
        assert proc.wait(DEADLINE_S) == 1
        assert f"exited by itself with code -9; see {log}" in proc.stderr.read()
        assert "tansu broker" in log.read_text()  # kept for a look after the crash
        shutil.rmtree(log.parent)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses PR_SET_PDEATHSIG")
def test_broker_dies_with_a_killed_parent() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; from gnnstream.stream.broker import EmbeddedBroker; "
                               "b = EmbeddedBroker().start(); print(b.pid, b.log_path, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        child, log = proc.stdout.readline().split()
        child = int(child)
        shutil.rmtree(Path(log).parent)  # a killed parent leaves it behind
        assert _alive(child)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + DEADLINE_S
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
