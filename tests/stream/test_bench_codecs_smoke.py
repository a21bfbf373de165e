"""``bench/codecs.py`` runs at a tiny size: encoding alone, then delivery rounds with the client alone beside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.codecs", *args], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)  # exactly one JSON object on stdout


def test_encoding_alone_quick_run(tmp_path: Path) -> None:
    result = _bench(tmp_path, "--nodes", "300", "--dim", "4", "--partitions", "2", "--repeat", "1")
    formats = result["formats"]
    assert list(formats) == ["json", "binary", "packed"]
    assert formats["json"]["messages"] == formats["binary"]["messages"] == 300
    assert formats["packed"]["messages"] == 2  # both partitions get some of the ids, each partition's rows one frame
    assert formats["json"]["bytes_per_update"] > formats["binary"]["bytes_per_update"] > 4 * 4
    assert all(f["cpu_us_per_update"] > 0 for f in formats.values())


@pytest.mark.broker
def test_delivery_rounds_and_the_client_alone_quick_run(tmp_path: Path) -> None:
    """The bench starts its own embedded broker; the client is confluent's, as in the delivery process."""
    result = _bench(tmp_path, "--nodes", "400", "--dim", "4", "--rounds", "3", "--round-updates", "50",
                    "--formats", "binary,packed")
    assert (result["rounds"], result["round_updates"]) == (3, 50)
    delivery = result["delivery"]
    assert list(delivery) == ["binary", "packed"]
    for name, got in delivery.items():
        assert got["wall_ms_per_round"] > 0 and got["client_alone_cpu_us_per_update"] > 0, (name, got)
        # the client alone sent what the delivery process sent: a message an update, or a frame a partition
        assert got["client_alone_messages_per_round"] == got["messages_per_round"], (name, got)
    assert delivery["binary"]["messages_per_round"] == 50
    assert 1 <= delivery["packed"]["messages_per_round"] <= 4  # the topic's partitions
