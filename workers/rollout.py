"""Model rollout: run a new model version beside the serving one, switch to it and back, retire the old one.

``gnnstream rollout``:

* ``start --from LIVE_STATE --state NEW_STATE --model NEW_MODEL_DIR``:
  checks that the new model fits the live graph (input dimension, sampling
  seed) before anything is written; copies the live state while its worker
  runs (:func:`graph_state.snapshot.snapshot`); computes every embedding of
  the new model on the copy (published when its worker starts). The copy
  resumes the stream where the live state was, so ``gnnstream run --state
  NEW_STATE --model NEW_MODEL_DIR`` catches up and then publishes the new
  version to its own topic beside the old one.
* ``promote MODEL`` / ``rollback``: appends a rollout marker to every
  partition of the events topic (:mod:`stream.rollout`); from it on,
  ``MODEL`` (or the version that served before) is the serving version, in
  every worker's output at the same point of the stream.
* ``retire MODEL``: a marker at which MODEL's workers stop.
* ``status``: each version's workers (lag, latency, what they published),
  the backfill's progress, the serving version and the scorer's canary
  report, from the rollout topic.

The rollout topic (``gnnstream-rollout``, one partition) is a log of JSON
records keyed ``worker/MODEL/WORKER`` (a worker's progress, every few
seconds), ``backfill/MODEL`` (``start``'s progress), ``marker/N`` (each marker
appended) and ``canary`` (the scorer's report): only the latest record of a
key counts, so the topic may be compacted. It only informs: the markers in
the events topic decide.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from gnnstream.graph_state.transaction import Transaction
from gnnstream.stream.backends import DEFAULT_KAFKA_CLIENT, open_consumer, open_producer, read_to_end
from gnnstream.stream.errors import retrying
from gnnstream.stream.rollout import CONTROL_TOPIC, Marker, encode_marker, marker_rank, version_topic

if TYPE_CHECKING:
    from gnnstream.graph_state.store import GraphStore
    from gnnstream.workers.worker import Worker

__all__ = ["RolloutError", "RolloutView", "stored_rollout", "record_rollout", "worker_report", "read_rollout",
           "start", "promote", "rollback", "retire", "status", "add_rollout_parser"]

logger = logging.getLogger(__name__)

_LIVE_REPORT_S = 60.0  # promote and rollback want a report of a consuming worker of the version this recent
SERVING_META = b"serving"  # meta: the serving version as of the last marker passed
ROLLOUT_META = b"rollout"  # meta: the number of that marker
_LATENCY_WINDOW_S = 60.0  # the latency a worker reports: batches published within this window


class RolloutError(ValueError):
    """A rollout command refused: nothing was changed."""


# ---------------------------------------------------------------------- in the state
def stored_rollout(store: GraphStore, model_tag: str) -> tuple[str, int]:
    """``(serving version, last marker passed)`` recorded in the state; a state that passed none serves its
    own model."""
    meta = store.column("meta")
    serving, number = meta.get(SERVING_META), meta.get(ROLLOUT_META)
    return (serving.decode() if serving else model_tag), (int(number) if number else 0)


def record_rollout(tx: Transaction, marker: Marker) -> None:
    """Add the state's record of having passed ``marker`` to ``tx`` (committed with the offsets past it)."""
    tx.set_meta(SERVING_META, marker.serving.encode())
    tx.set_meta(ROLLOUT_META, str(marker.rollout).encode())


# ---------------------------------------------------------------------- the rollout topic
def worker_report(worker: Worker, lag: int | None, final: bool = False) -> tuple[bytes, bytes]:
    """A worker's progress record: key and value (``final``: its last, as it stops)."""
    engine = worker.engine
    model = engine.model_tag if engine is not None else None
    now = time.time()
    recent = np.asarray([latency for at, latency in list(worker.latency_timeline) if at >= now - _LATENCY_WINDOW_S])
    p50, p99 = (np.percentile(recent, [50, 99]).round(3).tolist() if len(recent) else (None, None))
    h = worker.health
    stopping = (final or worker._stop.is_set()) and h.status == "consuming"
    value = {"kind": "worker", "model": model, "worker": worker.worker_id, "topic": worker.output_topic,
             "status": "stopped" if stopping else h.status, "serving": worker.serving, "rollout": worker.rollout,
             "lag": lag,
             "applied": h.applied, "published": h.published, "latency_p50_s": p50, "latency_p99_s": p99,
             "latency_batches": len(recent), "held": bool(worker._held), "at": now}
    return f"worker/{model}/{worker.worker_id}".encode(), orjson.dumps(value)


def read_rollout(bootstrap: str, *, topic: str = CONTROL_TOPIC, kafka_client: str = DEFAULT_KAFKA_CLIENT,
                 timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Every record of the rollout topic, oldest first (an empty list when it does not exist)."""
    from gnnstream.stream.exceptions import NoPartitionsError
    from gnnstream.stream.kafka import ensure_topics
    ensure_topics(bootstrap, {_named(topic): 1})
    try:
        records = read_to_end(kafka_client, bootstrap, topic, timeout_s=timeout_s)
    except NoPartitionsError:
        return []
    except TimeoutError as exc:
        raise RolloutError(str(exc)) from None
    out: list[dict[str, Any]] = []
    for r in records:
        try:
            record = orjson.loads(r.value or b"null")
        except orjson.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def _named(topic: str) -> str:
    """``topic``, or a RolloutError when it is empty (``--control-topic ''`` means "do not record")."""
    if not topic:
        raise RolloutError("--control-topic is empty, so there is no rollout topic to read or record in: name it "
                           "(default gnnstream-rollout); `rollout start --no-record` records nothing")
    return topic


def _record(bootstrap: str, kafka_client: str, topic: str, key: str, value: dict[str, Any]) -> None:
    from gnnstream.stream.kafka import ensure_topics
    ensure_topics(bootstrap, {_named(topic): 1})
    producer = open_producer(kafka_client, bootstrap)

    def send() -> None:
        producer.send(topic, key.encode(), orjson.dumps(value))
        producer.flush(30.0)

    try:
        retrying(send, f"recording {key} in topic {topic!r}")
    finally:
        producer.close()


@dataclass
class VersionView:
    """What the rollout topic says of one version."""

    model: str
    topic: str | None = None
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    backfill: dict[str, Any] | None = None
    retired: int | None = None  # the marker that retired it

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "topic": self.topic, "workers": self.workers, "backfill": self.backfill,
                "retired": self.retired}


@dataclass
class RolloutView:
    """The state of a rollout as its topic records it."""

    versions: dict[str, VersionView] = field(default_factory=dict)
    markers: list[dict[str, Any]] = field(default_factory=list)
    canary: dict[str, Any] | None = None

    @classmethod
    def of(cls, records: list[dict[str, Any]]) -> RolloutView:
        view = cls()
        for r in records:
            kind, model = r.get("kind"), r.get("model")
            if kind == "marker":
                same = [m for m in view.markers if m.get("rollout") == r.get("rollout")]
                if same and _rank(same[0]) >= _rank(r):  # two commands raced for a number: workers follow the last
                    continue
                view.markers = [m for m in view.markers if m not in same] + [r]
                if r.get("retire") and r["retire"] in view.versions:
                    view.versions[r["retire"]].retired = r.get("rollout")
            elif kind in ("worker", "backfill") and isinstance(model, str):
                version = view.versions.setdefault(model, VersionView(model))
                version.topic = r.get("topic") or version.topic
                if kind == "worker":
                    version.workers[str(r.get("worker"))] = r
                else:
                    version.backfill = r
            elif kind == "canary":
                view.canary = r
        return view

    @property
    def serving(self) -> str | None:
        """The serving version: the last marker's; what the workers report when they passed a later one (a
        command that appended its markers and failed before recording them) or none is recorded."""
        reports = [w for v in self.versions.values() for w in v.workers.values()]
        ahead = max(reports, key=lambda w: (w.get("rollout") or 0, w.get("at", 0)), default=None)
        if self.markers and (ahead is None or (ahead.get("rollout") or 0) <= self.markers[-1]["rollout"]):
            return self.markers[-1]["serving"]
        return ahead.get("serving") if ahead else None

    @property
    def next_rollout(self) -> int:
        numbers = [m.get("rollout", 0) for m in self.markers]
        numbers += [w.get("rollout") or 0 for v in self.versions.values() for w in v.workers.values()]
        return max(numbers, default=0) + 1

    def to_json(self) -> dict[str, Any]:
        return {"serving": self.serving, "versions": {m: v.to_json() for m, v in self.versions.items()},
                "markers": self.markers, "canary": self.canary}


# ---------------------------------------------------------------------- commands
def start(live_state: str, state: str, model_dir: str, *, bootstrap: str | None = None,
          kafka_client: str = DEFAULT_KAFKA_CLIENT, control_topic: str = CONTROL_TOPIC,
          progress: bool = True) -> dict[str, Any]:
    """Prepare ``state`` for the model in ``model_dir`` from a copy of ``live_state`` (see the module doc).

    Raises:
        RolloutError: the model does not fit the live graph, or ``state`` exists; nothing was written.
    """
    from gnnstream.graph_state.snapshot import read_meta, snapshot
    from gnnstream.model.directory import load_model_dir
    from gnnstream.workers.offline.jobs import progress_bar
    from gnnstream.workers.state import open_engine, open_store
    if bootstrap is not None:
        _named(control_topic)
    config = load_model_dir(model_dir).config
    facts = read_meta(live_state, [b"model", SERVING_META, ROLLOUT_META])
    live_model = json.loads(facts["model"])["model"] if facts["model"] else None
    if live_model is None:
        raise RolloutError(f"state {live_state!r} holds no embeddings yet: there is no live version to roll out "
                           f"from")
    if config.model_id == live_model:
        raise RolloutError(f"the model in {model_dir!r} is {config.model_id}, the version {live_state!r} already "
                           f"computes; give the new model another version (config.json \"version\")")
    if config.seed != facts["seed"]:
        raise RolloutError(f"model {config.model_id} samples with seed {config.seed} but the live graph in "
                           f"{live_state!r} was sampled with seed {facts['seed']}; a version rolled out beside it "
                           f"must use seed {facts['seed']}")
    if facts["feature_dim"] is not None and config.in_dim != facts["feature_dim"]:
        raise RolloutError(f"model {config.model_id} takes {config.in_dim} input features but the live graph in "
                           f"{live_state!r} holds {facts['feature_dim']}-dim features")
    version_topic(config.model_id)
    if os.path.lexists(state) and (not os.path.isdir(state) or os.listdir(state)):
        raise RolloutError(f"{state!r} exists; name a new directory for the state of {config.model_id}")
    topic = version_topic(config.model_id)
    report = _Reporter(bootstrap, kafka_client, control_topic, config.model_id, topic, state, live_model)
    t0 = time.perf_counter()
    report(phase="snapshot")
    partial = f"{os.path.abspath(state)}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted start left
    copied = snapshot(live_state, partial)
    try:
        with open_store(partial, create=False, model_dir=model_dir) as store:
            engine = open_engine(store, model_dir, switch_model=True)
            # the copy serves what the live state served when copied (its own model before any marker); the live
            # worker's undelivered updates are its own
            serving, number = stored_rollout(store, live_model)
            tx = Transaction()
            record_rollout(tx, Marker(number, serving))
            tx.clear_outbox()
            store.commit(tx)
            nodes = None
            report(phase="backfill", layer=0, layers=engine.num_layers, nodes=nodes)
            with progress_bar(engine.num_layers, f"backfill {config.model_id}", unit="layer") as bar:
                def advance(done: int) -> None:
                    bar.update(1)
                    report(phase="backfill", layer=done, layers=engine.num_layers, nodes=nodes)
                stats = engine.backfill(progress=advance if progress else None, publish=True)
            from gnnstream.workers.state import bind_model_dir
            bind_model_dir(store, model_dir)
        os.rename(partial, state)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    seconds = round(time.perf_counter() - t0, 3)
    nodes = stats.recomputed[0] if stats.recomputed else 0
    report(phase="done", layer=engine.num_layers, layers=engine.num_layers, nodes=nodes, seconds=seconds)
    return {"model": config.model_id, "from": live_model, "serving": serving, "state": state,
            "topic": topic, "offsets": copied["offsets"], "nodes": nodes, "seconds": seconds,
            "next": f"gnnstream run --state {state} --model {model_dir}"}


class _Reporter:
    """``start``'s progress records (nothing without a bootstrap)."""

    def __init__(self, bootstrap: str | None, kafka_client: str, topic: str, model: str, out_topic: str,
                 state: str, live: str):
        self.bootstrap, self.kafka_client, self.topic = bootstrap, kafka_client, topic
        self.base = {"kind": "backfill", "model": model, "topic": out_topic, "state": state, "from": live}

    def __call__(self, **fields: Any) -> None:
        if self.bootstrap:
            _record(self.bootstrap, self.kafka_client, self.topic, f"backfill/{self.base['model']}",
                    {**self.base, **fields, "at": time.time()})


def _rank(record: dict[str, Any]) -> tuple[int, float, str, str]:
    return marker_rank(Marker(int(record.get("rollout", 0)), str(record.get("serving")), record.get("retire"),
                              float(record.get("at", 0.0))))


def _append_marker(bootstrap: str, kafka_client: str, events_topic: str, control_topic: str, marker: Marker,
                   previous: str | None) -> dict[str, Any]:
    """Append ``marker`` to every partition of the events topic, then record it in the rollout topic (a
    command that fails between the two is run again: the workers follow the later marker of the number)."""
    consumer = open_consumer(kafka_client, bootstrap, events_topic, "gnnstream-rollout-reader", assign_all=True)
    try:
        partitions = sorted(consumer.partitions_of(events_topic))
    finally:
        consumer.close()
    producer = open_producer(kafka_client, bootstrap)
    key, value, headers = encode_marker(marker)

    def send() -> None:  # sent again whole after a transient error: a repeated marker is passed once
        for p in partitions:
            producer.send(events_topic, key, value, headers, partition=p)
        producer.flush(30.0)

    try:
        retrying(send, f"appending rollout marker {marker.rollout} to topic {events_topic!r}")
    finally:
        producer.close()
    record = {"kind": "marker", **marker.to_json(), "previous": previous, "events_topic": events_topic,
              "partitions": len(partitions)}
    _record(bootstrap, kafka_client, control_topic, f"marker/{marker.rollout}", record)
    return record


def _view(bootstrap: str, kafka_client: str, control_topic: str) -> RolloutView:
    return RolloutView.of(read_rollout(bootstrap, topic=control_topic, kafka_client=kafka_client))


def _running(view: RolloutView, model: str, force: bool, now: float | None = None) -> None:
    """Refuse to make ``model`` serve while no worker of it consumes (unless ``force``)."""
    now = time.time() if now is None else now
    live = [w for w in view.versions[model].workers.values()
            if w.get("status") == "consuming" and now - w.get("at", 0) <= _LIVE_REPORT_S]
    if not live and not force:
        raise RolloutError(f"no worker of {model} has reported consuming in the last {_LIVE_REPORT_S:g} s: "
                           f"start it (`gnnstream run` on its state) and wait for it, or pass --force to switch now "
                           f"(nothing is scored until a worker of it reaches the marker)")


def _known(view: RolloutView, model: str) -> None:
    if model not in view.versions:
        known = ", ".join(sorted(view.versions)) or "none"
        raise RolloutError(f"no worker of {model} has reported in the rollout topic (versions known: {known}); "
                           f"start it with `gnnstream rollout start` and `gnnstream run` first")
    if view.versions[model].retired is not None:
        raise RolloutError(f"{model} was retired at rollout marker {view.versions[model].retired}; roll out a "
                           f"new version instead")


def promote(model: str, *, bootstrap: str, events_topic: str = "graph-events", control_topic: str = CONTROL_TOPIC,
            kafka_client: str = DEFAULT_KAFKA_CLIENT, force: bool = False) -> dict[str, Any]:
    """Make ``model`` the serving version from a marker appended now.

    Raises:
        RolloutError: ``model`` is unknown, retired or serving already, or (without ``force``) no worker of
            it consumes.
    """
    version_topic(model)
    view = _view(bootstrap, kafka_client, control_topic)
    _known(view, model)
    serving = view.serving
    if serving == model:
        raise RolloutError(f"{model} serves already")
    _running(view, model, force)
    marker = Marker(view.next_rollout, model, None, time.time())
    return _append_marker(bootstrap, kafka_client, events_topic, control_topic, marker, serving)


def rollback(*, bootstrap: str, events_topic: str = "graph-events", control_topic: str = CONTROL_TOPIC,
             kafka_client: str = DEFAULT_KAFKA_CLIENT, force: bool = False) -> dict[str, Any]:
    """Make the version that served before the last switch the serving one again.

    Raises:
        RolloutError: no switch was made yet, or that version was retired.
    """
    view = _view(bootstrap, kafka_client, control_topic)
    switches = [m for m in view.markers if m.get("previous") and m["previous"] != m["serving"]]
    if not switches:
        raise RolloutError("nothing to roll back: no version was promoted yet")
    previous = switches[-1]["previous"]
    if view.serving != switches[-1]["serving"]:
        raise RolloutError(f"the last switch (to {switches[-1]['serving']}) is no longer in force; promote the "
                           f"version you want explicitly")
    _known(view, previous)
    _running(view, previous, force)
    marker = Marker(view.next_rollout, previous, None, time.time())
    return _append_marker(bootstrap, kafka_client, events_topic, control_topic, marker, view.serving)


def retire(model: str, *, bootstrap: str, events_topic: str = "graph-events", control_topic: str = CONTROL_TOPIC,
           kafka_client: str = DEFAULT_KAFKA_CLIENT) -> dict[str, Any]:
    """Stop computing ``model``: its workers stop at a marker appended now.

    Raises:
        RolloutError: ``model`` is the serving version, unknown or retired already.
    """
    version_topic(model)
    view = _view(bootstrap, kafka_client, control_topic)
    _known(view, model)
    serving = view.serving
    if serving == model:
        raise RolloutError(f"{model} is the serving version: promote another version first (or roll back)")
    if serving is None:
        raise RolloutError("no serving version is known; nothing can be retired")
    marker = Marker(view.next_rollout, serving, model, time.time())
    return _append_marker(bootstrap, kafka_client, events_topic, control_topic, marker, serving)


def status(*, bootstrap: str, control_topic: str = CONTROL_TOPIC,
           kafka_client: str = DEFAULT_KAFKA_CLIENT) -> RolloutView:
    return _view(bootstrap, kafka_client, control_topic)


def format_status(view: RolloutView, now: float | None = None) -> str:
    """``status`` as a readable table."""
    now = time.time() if now is None else now
    serving = view.serving
    lines = []
    if view.markers:
        m = view.markers[-1]
        lines.append(f"serving: {serving} (rollout marker {m['rollout']}, "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m['at']))})")
    else:
        lines.append(f"serving: {serving or 'unknown'} (no rollout marker yet)")
    head = ("VERSION", "ROLE", "WORKER", "STATUS", "LAG", "P50 S", "P99 S", "APPLIED", "PUBLISHED", "REPORTED")
    rows = [head]
    for model, v in sorted(view.versions.items()):
        role = "retired" if v.retired is not None else "serving" if model == serving else "standby"
        for wid, w in sorted(v.workers.items()) or [("-", {})]:
            rows.append((model, role, wid, str(w.get("status", "-")), _num(w.get("lag")),
                         _num(w.get("latency_p50_s")), _num(w.get("latency_p99_s")), _num(w.get("applied")),
                         _num(w.get("published")), f"{now - w['at']:.0f} s ago" if "at" in w else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for model, v in sorted(view.versions.items()):
        lines.append(f"{model}: topic {v.topic}")
        b = v.backfill
        if b is not None:
            done = f"{b.get('layer', 0)}/{b.get('layers', '?')} layers"
            extra = f", {b['nodes']:,} nodes" if b.get("nodes") else ""
            took = f" in {b['seconds']:.1f} s" if b.get("seconds") is not None else ""
            lines.append(f"  prepared from {b.get('from')}: {b.get('phase')}, {done}{extra}{took}")
    c = view.canary
    if c:
        models = "; ".join(f"{m} {v['nodes']:,} nodes, mean {_num(v.get('mean'))}, p50 {_num(v.get('p50'))}"
                           for m, v in c.get("models", {}).items())
        lines.append(f"canary of scorer {c.get('group')} (fraction {c.get('fraction')}, "
                     f"{now - c.get('at', now):.0f} s ago): {models}")
        for pair in c.get("pairs", []):
            lines.append(f"  {' vs '.join(pair['models'])}: {pair['nodes']:,} nodes scored by both, mean |diff| "
                         f"{_num(pair.get('mean_abs_diff'))}, max {_num(pair.get('max_abs_diff'))}, "
                         f"KS {_num(pair.get('ks'))}")
    return "\n".join(lines)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


# ---------------------------------------------------------------------- the command line
def add_rollout_parser(sub: Any) -> None:
    """``gnnstream rollout …`` (its subcommands)."""
    from gnnstream.workers.settings import add_worker_arguments
    p = sub.add_parser("rollout", help="run a new model version beside the serving one; promote, roll back, "
                                       "retire (docs/operations.md)",
                       description="Roll a new model version out beside the serving one: `start` prepares its "
                                   "state from a copy of the live one, `gnnstream run` on that state publishes it "
                                   "to its own topic, `promote` makes it the version consumers act on from a point "
                                   "of the stream, `rollback` switches back, `retire` stops an old version. "
                                   "`status` shows where each stands. See docs/operations.md, Model rollout.")
    steps = p.add_subparsers(dest="step", metavar="STEP", required=True)

    def kafka(q: argparse.ArgumentParser, events: bool = True) -> None:
        add_worker_arguments(q, only=("bootstrap", "kafka_client", "control_topic",
                                      *(("events_topic",) if events else ())))

    q = steps.add_parser("start", help="copy the live state and compute a new model version on the copy")
    q.add_argument("--from", dest="live", required=True, metavar="LIVE_STATE",
                   help="state directory of the serving version's worker (it may be running)")
    q.add_argument("--state", required=True, metavar="NEW_STATE", help="new state directory for the new version")
    q.add_argument("--model", required=True, metavar="MODEL_DIR", help="the new version's model directory")
    q.add_argument("--no-record", action="store_true", help="do not record progress in the rollout topic "
                                                            "(no Kafka needed)")
    kafka(q, events=False)
    q.set_defaults(func=_start)
    q = steps.add_parser("status", help="each version's workers, the backfill, the serving version, the canary")
    q.add_argument("--json", action="store_true", help="print the whole view as JSON")
    kafka(q, events=False)
    q.set_defaults(func=_status)
    force = ("switch even when no worker of the version reports consuming (nothing is scored until one reaches "
             "the marker)")
    q = steps.add_parser("promote", help="make MODEL the serving version from now on in the stream")
    q.add_argument("model", metavar="MODEL", help="NAME:VERSION")
    q.add_argument("--force", action="store_true", help=force)
    kafka(q)
    q.set_defaults(func=_promote)
    q = steps.add_parser("rollback", help="make the version that served before the last promote serve again")
    q.add_argument("--force", action="store_true", help=force)
    kafka(q)
    q.set_defaults(func=_rollback)
    q = steps.add_parser("retire", help="stop computing MODEL (its workers stop at a marker); not the serving one")
    q.add_argument("model", metavar="MODEL", help="NAME:VERSION")
    kafka(q)
    q.set_defaults(func=_retire)


def _print(result: Any) -> None:
    print(json.dumps(result, indent=2, sort_keys=True))


def _start(args: argparse.Namespace) -> int:
    _print(start(args.live, args.state, args.model, bootstrap=None if args.no_record else args.bootstrap,
                 kafka_client=args.kafka_client, control_topic=args.control_topic))
    return 0


def _status(args: argparse.Namespace) -> int:
    view = status(bootstrap=args.bootstrap, control_topic=args.control_topic, kafka_client=args.kafka_client)
    print(json.dumps(view.to_json(), indent=2, sort_keys=True) if args.json else format_status(view))
    return 0


def _marker_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"bootstrap": args.bootstrap, "events_topic": args.events_topic, "control_topic": args.control_topic,
            "kafka_client": args.kafka_client}


def _promote(args: argparse.Namespace) -> int:
    _print(promote(args.model, force=args.force, **_marker_args(args)))
    return 0


def _rollback(args: argparse.Namespace) -> int:
    _print(rollback(force=args.force, **_marker_args(args)))
    return 0


def _retire(args: argparse.Namespace) -> int:
    _print(retire(args.model, **_marker_args(args)))
    return 0
