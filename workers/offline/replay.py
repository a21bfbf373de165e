"""Replay event files into Kafka and read embedding updates back.

``produce_file`` sends JSONL events (or a SNAP signed-network CSV turned into
events, in time order) keyed by ``src``/``id``; ``tail_embeddings`` prints
updates from the embeddings topic one line each (a message that is not an
update gets an ``invalid`` line and the tail goes on).
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from typing import Any, Iterator

from gnnstream.stream.events import encode_event, event_key
from gnnstream.stream.backends import DEFAULT_KAFKA_CLIENT, open_consumer, open_producer
from gnnstream.stream.clients import ConsumerClient
from gnnstream.stream.kafka import ensure_topics, topic_names
from gnnstream.stream.exceptions import InvalidUpdate, StreamError
from gnnstream.stream.updates import PACKED_MAGIC, EmbeddingUpdate, decode_packed, decode_update
from gnnstream.workers.offline.jobs import event_lines, progress_bar

__all__ = ["produce_file", "tail_embeddings", "iter_file_messages", "wait_for_topic"]

logger = logging.getLogger(__name__)

_PACE_S = 0.002  # a paced replay sleeps once it is this far ahead of its rate
_JOIN_WAIT_S = 20.0  # a tail that has no partitions after this long (or its idle time, if longer) checks the topic


def iter_file_messages(path: str, fmt: str = "jsonl") -> Iterator[tuple[bytes | None, bytes]]:
    """``(key, value)`` pairs of a file: JSONL lines are sent as they are (even invalid ones; a gzipped file,
    which would go out as bytes, is refused)."""
    if fmt == "snap":
        from gnnstream.stream.snap import read_snap, snap_events
        for ev in snap_events(read_snap(path)):
            yield event_key(ev), encode_event(ev)
        return
    for line in event_lines(path, "send a SNAP CSV with --format snap, or gunzip a JSONL file first"):
        line = line.rstrip(b"\n")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            key = obj.get("src", obj.get("id")) if isinstance(obj, dict) else None
            key = None if key is None else str(key).encode()
        except (ValueError, RecursionError):  # not JSON, or nested too deep: the worker dead-letters it
            key = None
        yield key, line


def produce_file(bootstrap: str, path: str, *, topic: str = "graph-events", fmt: str = "jsonl",
                 rate: float = 0.0, partitions: int = 4, limit: int = 0,
                 kafka_client: str = DEFAULT_KAFKA_CLIENT) -> dict[str, Any]:
    """Send every event of ``path`` with the named client (:data:`gnnstream.stream.backends.KAFKA_CLIENTS`); returns counts
    and the achieved rate."""
    messages = list(iter_file_messages(path, fmt))  # a missing or bad file fails before Kafka is touched
    if limit:
        messages = messages[:limit]
    ensure_topics(bootstrap, {topic: partitions})
    t0 = time.perf_counter()
    with open_producer(kafka_client, bootstrap) as producer, progress_bar(len(messages), "produce") as bar:
        for i, (key, value) in enumerate(messages):
            producer.send(topic, key, value)
            if rate > 0:
                ahead = (i + 1) / rate - (time.perf_counter() - t0)
                if ahead > _PACE_S:  # sleep in steps of a few events, not after each
                    time.sleep(ahead)
            if i % 1000 == 999:
                bar.update(1000)
        producer.flush(60.0)
        bar.update(len(messages) % 1000)
    seconds = time.perf_counter() - t0
    return {"produced": len(messages), "topic": topic, "seconds": round(seconds, 3),
            "events_per_s": round(len(messages) / seconds, 1) if seconds else None}


_PACKED = bytes((PACKED_MAGIC,))


def _line(u: EmbeddingUpdate) -> str:
    """The tail's line of an update (of a tombstone row of a packed frame: ``<id> deleted v<version>``)."""
    if u.deleted:
        return f"{u.id} deleted v{u.version}"
    head = ", ".join(f"{x:+.4f}" for x in list(u.embedding)[:4])
    return f"{u.id} v{u.version} {u.mode} {u.model} dim={len(u.embedding)} [{head}, …] event_ts={u.event_ts:.0f}"


def tail_embeddings(bootstrap: str, *, topic: str = "node-embeddings", from_beginning: bool = False,
                    max_messages: int = 0, idle_s: float = 0.0, out: Any = None,
                    kafka_client: str = DEFAULT_KAFKA_CLIENT) -> int:
    """Print updates as ``id v<version> <mode> dim=<d> [first values] event_ts=…``; returns the count.

    A packed frame prints one line per row (each counts), a tombstone row ``<id> deleted v<version>``.
    A deleted node prints ``<key> deleted``; a message that is not an update prints
    ``<key> invalid <topic>/<partition>@<offset> <reason>: <detail>``. Both count. ``idle_s`` stops the
    tail after that many seconds without a message, counted once the consumer has partitions assigned
    (joining the group can take longer than ``idle_s``), or, when none were assigned in ``max(idle_s, 20 s)``,
    from then on. The tail never creates ``topic``; if it does not exist by then, a tail with ``idle_s``
    stops with an error, and one without says so on stderr and waits for it.

    Raises:
        StreamError: with ``idle_s``, ``topic`` does not exist, or none of its partitions was ever assigned.
    """
    out = out or sys.stdout
    group = f"gnnstream-tail-{uuid.uuid4().hex[:8]}"
    consumer = open_consumer(kafka_client, bootstrap, topic, group, allow_auto_create_topics=False,
                             auto_offset_reset="earliest" if from_beginning else "latest")
    count = 0
    start = last = time.monotonic()
    join_wait = max(idle_s, _JOIN_WAIT_S)
    joined = checked = False
    try:
        while not max_messages or count < max_messages:
            records = consumer.poll_batch(500, 0.5)
            now = time.monotonic()
            assigned = bool(consumer.assignment())
            joined = joined or assigned
            if not joined and not checked and now - start > join_wait:
                checked = True
                _check_topic(consumer, bootstrap, topic, stop=bool(idle_s))
            counting = assigned or (not joined and now - start > join_wait)  # a join can take long
            if records or not counting:
                last = now
            elif idle_s and now - last > idle_s:
                if not joined:
                    raise StreamError(f"no partition of topic {topic!r} was assigned to the tail in "
                                      f"{now - start:.0f} s; check that the broker at {bootstrap} is healthy")
                break
            for r in records:
                node = (r.key or b"").decode(errors="replace")
                if r.value is None:
                    lines = [f"{node} deleted"]
                else:
                    try:
                        if r.value[:1] == _PACKED:
                            lines = list(map(_line, decode_packed(r.value)))
                        else:
                            lines = [_line(decode_update(r.value))]
                    except InvalidUpdate as exc:
                        lines = [f"{node or '-'} invalid {r.topic}/{r.partition}@{r.offset} {exc}"]
                for line in lines:
                    print(line, file=out)
                    count += 1
                    if max_messages and count >= max_messages:
                        break
                if max_messages and count >= max_messages:
                    break
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    return count


def wait_for_topic(bootstrap: str, topic: str, timeout_s: float = 0.0) -> None:
    """Return once ``topic`` exists, asking the broker every second; without ``timeout_s`` (0), say on stderr
    that it does not exist yet and wait for ever.

    Raises:
        StreamError: with ``timeout_s``, the topic still does not exist after that many seconds.
    """
    start = time.monotonic()
    warned = False
    while topic not in topic_names(bootstrap):
        if timeout_s and time.monotonic() - start >= timeout_s:
            raise StreamError(_missing(bootstrap, topic))
        if not timeout_s and not warned:
            print(f"gnnstream: warning: {_missing(bootstrap, topic)}; waiting for it", file=sys.stderr)
            warned = True
        time.sleep(1.0)


def _missing(bootstrap: str, topic: str) -> str:
    return f"topic {topic!r} does not exist at {bootstrap}; check its name (--output-topic, or --model-id NAME:VERSION)"


def _check_topic(consumer: ConsumerClient, bootstrap: str, topic: str, stop: bool) -> None:
    """Say that ``topic`` does not exist: an error when ``stop``, else a line on stderr."""
    try:
        consumer.partitions_of(topic, timeout_s=2.0)
    except StreamError:
        if stop:
            raise StreamError(_missing(bootstrap, topic)) from None
        print(f"gnnstream: warning: {_missing(bootstrap, topic)}; waiting for it", file=sys.stderr)
