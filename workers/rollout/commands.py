"""Model rollout: run a new model version beside the serving one, switch to it and back, retire the old one.

``gnnstream rollout``:

* ``start --from LIVE_STATE --state NEW_STATE --model NEW_MODEL_DIR``:
  checks that the new model fits the live graph (input dimension, sampling
  seed, a typed graph's schema) before anything is written; copies the live state while its worker
  runs (:func:`gnnstream.graph_state.snapshot.snapshot`); computes every embedding of
  the new model on the copy (published when its worker starts). The copy
  resumes the stream where the live state was, so ``gnnstream run --state
  NEW_STATE --model NEW_MODEL_DIR`` catches up and then publishes the new
  version to its own topic beside the old one.
* ``promote MODEL`` / ``rollback``: appends a rollout marker to every
  partition of the events topic (:mod:`gnnstream.stream.rollout`); from it on,
  ``MODEL`` (or the version that served before) is the serving version, in
  every worker's output at the same point of the stream.
* ``retire MODEL``: a marker at which MODEL's workers stop.
* ``status``: each version's workers (lag, latency, what they published),
  the backfill's progress, the serving version and the scorer's canary
  report, from the rollout topic.

What the commands and the workers record in the rollout topic, and the view
of a rollout it adds up to: :mod:`gnnstream.workers.rollout.topic`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Any

from gnnstream.graph_state.keys import META_CALLER
from gnnstream.graph_state.transaction import Transaction
from gnnstream.stream.backends import DEFAULT_KAFKA_CLIENT, open_consumer, open_producer
from gnnstream.stream.errors import retrying
from gnnstream.stream.rollout import CONTROL_TOPIC, Marker, encode_marker, version_topic
from gnnstream.workers.engine.typed import GRAPH_SCHEMA_META, schema_refusal
from gnnstream.workers.rollout.records import ROLLOUT_META, SERVING_META, record_rollout, stored_rollout
from gnnstream.workers.rollout.topic import RolloutError, RolloutView, named_topic, read_rollout, record_in_topic

__all__ = ["start", "promote", "rollback", "retire", "status", "format_status"]

logger = logging.getLogger(__name__)

_LIVE_REPORT_S = 60.0  # promote and rollback want a report of a consuming worker of the version this recent


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
        named_topic(control_topic)
    config = load_model_dir(model_dir).config
    held_schema = f"{META_CALLER}{GRAPH_SCHEMA_META}".encode()
    facts = read_meta(live_state, [b"model", SERVING_META, ROLLOUT_META, held_schema])
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
    held = facts[held_schema.decode()]  # the live graph's schema (None: untyped)
    refused = schema_refusal(live_state, held and json.loads(held), config.schema, config.model_id)
    if refused:
        raise RolloutError(refused)
    if config.schema is None and facts["feature_dim"] is not None and config.in_dim != facts["feature_dim"]:
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
            record_in_topic(self.bootstrap, self.kafka_client, self.topic, f"backfill/{self.base['model']}",
                            {**self.base, **fields, "at": time.time()})


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
    record_in_topic(bootstrap, kafka_client, control_topic, f"marker/{marker.rollout}", record)
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
