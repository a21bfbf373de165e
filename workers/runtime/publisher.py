"""Publishing: the outbox read into batches, and the publisher thread that delivers them in order.

The engine writes an outbox record with every recompute (the interned ids of
the nodes whose stored state changed, :mod:`gnnstream.graph_state.outbox`). :class:`OutboxReader` reads the records not
taken yet into one :class:`Outgoing` batch, each node once in its state
stored now; :class:`Publisher` hands batches to a thread of its own, which
has the delivery process (:mod:`gnnstream.stream.delivery`) encode, send and flush them
in order, and deletes a batch's outbox records once its flush succeeded
(at-least-once: consumers keep the highest version per node). The worker's
thread calls :meth:`Publisher.publish` after each batch; the publisher
thread reports through the callbacks it was given and never touches the
store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from gnnstream.graph_state.store import GraphStore
from gnnstream.graph_state.outbox import Outbox
from gnnstream.stream.delivery import Delivery, DeliveryProcess, UpdateColumns
from gnnstream.stream.errors import classify
from gnnstream.stream.exceptions import StreamError
from gnnstream.stream.rollout import stamp_headers

__all__ = ["Outgoing", "OutboxReader", "Publisher"]

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 1  # batches handed to the publisher thread and not delivered; more records wait in the outbox
PUBLISH_LIMIT = 250_000  # distinct nodes per batch (a batch holds whole outbox records)
_FLUSH_TIMEOUT_S = 5.0  # one flush of the publisher thread; a failed one is retried


@dataclass(eq=False)
class Outgoing:
    """The updates of some outbox records, ready to send.

    ``keys`` are the outbox records they come from (deleted once the flush
    confirmed delivery); ``columns`` the nodes' stored state, read when the
    batch was prepared, encoded and sent by the delivery process.
    ``event_ts`` is the event time of each published node, for the
    freshness histogram; ``suppressed`` the updates of those records left
    out by ``min_change`` (confirmed with the rest, never sent). Not changed
    once handed to the publisher thread.
    """

    keys: list[bytes]
    columns: list[UpdateColumns]
    event_ts: np.ndarray
    oldest_record_s: float | None = None  # Kafka time of the oldest record of the batch that made it
    suppressed: int = 0
    count: int = 0  # messages (the nodes of ``columns``)
    headers: list[tuple[str, bytes]] | None = None  # on every message: the serving version and marker number

    def __len__(self) -> int:
        return self.count


class OutboxReader:
    """The outbox records not published yet, read into batches; deleted once their batch was delivered.

    :meth:`prepare` reads the outbox records not taken yet and resolves each
    node to its state stored now (one :meth:`Engine.outbox_columns` call per
    record); :class:`Publisher` delivers the batch; :meth:`confirm` deletes
    its records.

    Output volume control (``min_change`` > 0): the publisher keeps, per
    node, the row it last handed over for sending (a dense array indexed by
    the node's interned id, ``ids x dim x 4`` bytes, and its mode code). An
    update is published when the node has no such row in this process, its
    mode changed, it is withdrawn (tombstone; the node is then forgotten) or
    ``||new - last||_2 > min_change * ||last||_2`` (a non-finite row is never
    held back: the encoder refuses it as without the option); the others
    are left out of the batch, counted in :attr:`Outgoing.suppressed`, and
    their outbox records are deleted with the batch's once it was
    delivered. The kept rows are only ones handed to the publisher thread,
    which delivers batches in order and retries a failed one before any
    later one, so what a consumer ends up holding is always within
    ``min_change`` of the stored embedding. The comparison is
    one vectorised pass per outbox record. With ``min_change`` 0 nothing is
    kept and the output is the same as without the option.

    Args:
        resolve: ``(iids, computed_at) -> UpdateColumns``, the stored state of
            the nodes an outbox record names (:meth:`Engine.outbox_columns`;
            with ``min_change`` it must fill ``iids`` and ``mode_codes``).
        min_change: relative L2 change below which (inclusive) an update is not
            published (0 = publish every update).
    """

    def __init__(self, store: GraphStore, resolve: Callable[[np.ndarray, float], UpdateColumns],
                 min_change: float = 0.0):
        if not 0 <= min_change < np.inf:
            raise ValueError(f"min_change must be a finite number >= 0 (got {min_change!r})")
        self.outbox = Outbox(store)
        self.resolve = resolve
        self.min_change = float(min_change)
        self._taken: bytes | None = None  # the last outbox key prepare() took and confirm() has not deleted
        self._stamp: list[tuple[str, bytes]] | None = None  # headers of what prepare() takes (stream.rollout)
        self._seen = np.zeros(0, dtype=bool)  # by iid, scratch of prepare()
        self.forget_sent()

    def pending(self) -> int:
        """Outbox records stored (taken or not)."""
        return self.outbox.pending()

    def prepare(self, limit: int = 50_000) -> Outgoing:
        """The outbox records after the last one taken, up to about ``limit`` distinct nodes, as one batch.

        Records are taken whole, in order, until they name ``limit``
        distinct nodes. A node named by several of them goes out once, with
        the computation time of the last one, in its state stored now (which
        is that record's or a newer one): when delivery falls behind, the
        records waiting for it coalesce.
        """
        taken = self._taken
        out = Outgoing([], [], np.zeros(0, dtype=np.float64), headers=self._stamp)
        records: list[tuple[float, np.ndarray]] = []
        distinct = 0
        for key, computed_at, iids in self.outbox.records(after=taken):
            seen = self._seen_map(iids)
            distinct += len(iids) - int(np.count_nonzero(seen[iids]))
            seen[iids] = True
            out.keys.append(key)
            records.append((computed_at, iids))
            if distinct >= limit:
                break
        if not records:
            return out
        self._taken = out.keys[-1]
        seen = self._seen
        for _, iids in records:
            seen[iids] = False
        latest = []  # each record's nodes that no later record of the batch names
        for computed_at, iids in reversed(records):
            latest.append((computed_at, iids[~seen[iids]]))
            seen[iids] = True
        for _, iids in records:
            seen[iids] = False
        times = []
        for computed_at, iids in reversed(latest):
            if not len(iids):
                continue
            cols = self.resolve(iids, computed_at)
            if len(cols) and self.min_change > 0:
                cols, skipped = self._changed(cols)
                out.suppressed += skipped
            if len(cols):
                out.columns.append(cols)
                out.count += len(cols)
                times.append(cols.event_ts)
        if times:
            out.event_ts = np.concatenate(times)
        return out

    def _seen_map(self, iids: np.ndarray) -> np.ndarray:
        """A false-filled flag per interned id, covering ``iids`` (prepare() leaves it all false)."""
        need = int(iids.max()) + 1 if len(iids) else 0
        if need > len(self._seen):
            grown = np.zeros(max(need, len(self._seen) * 3 // 2, 1024), dtype=bool)
            grown[:len(self._seen)] = self._seen
            self._seen = grown
        return self._seen

    def _changed(self, cols: UpdateColumns) -> tuple[UpdateColumns, int]:
        """``cols`` less the updates ``min_change`` leaves out, and how many those are; remembers the rest."""
        iids, codes = cols.iids, cols.mode_codes
        if iids is None or codes is None:
            raise ValueError("min_change needs outbox columns with iids and mode_codes (Engine.outbox_columns)")
        rows, deleted = cols.rows, cols.deleted
        self._reserve(int(iids.max()) + 1, rows.shape[1])
        last_mode = self._sent_mode[iids]
        last = self._sent_rows[iids]
        diff = rows - last
        moved = np.einsum("ij,ij->i", diff, diff, dtype=np.float64)  # squared L2 distances
        scale = np.einsum("ij,ij->i", last, last, dtype=np.float64)
        within = moved <= (self.min_change ** 2) * scale  # NaN compares False: a non-finite row goes out
        send = deleted | (last_mode < 0) | (last_mode != codes) | ~within
        live = send & ~deleted
        self._sent_rows[iids[live]] = rows[live]
        self._sent_mode[iids[live]] = codes[live]
        self._sent_mode[iids[deleted]] = -1  # withdrawn: the next update of the node goes out whatever it is
        skipped = len(send) - int(np.count_nonzero(send))
        if not skipped:
            return cols, 0
        keep = np.flatnonzero(send)
        taken = np.asarray(cols.names, dtype=object)[keep].tolist()
        modes = np.asarray(cols.modes, dtype=object)[keep].tolist()
        return replace(cols, names=taken, versions=cols.versions[keep], event_ts=cols.event_ts[keep], modes=modes,
                       rows=rows[keep], deleted=deleted[keep], iids=iids[keep], mode_codes=codes[keep]), skipped

    def _reserve(self, size: int, dim: int) -> None:
        """Make room in the sent-rows map for ids below ``size`` (grown by half at least)."""
        have = len(self._sent_mode)
        if size <= have and self._sent_rows.shape[1] == dim:
            return
        size = max(size, have + have // 2, 1024)
        rows = np.zeros((size, dim), dtype=np.float32)
        mode = np.full(size, -1, dtype=np.int16)
        if self._sent_rows.shape[1] == dim:
            rows[:have] = self._sent_rows
            mode[:have] = self._sent_mode
        self._sent_rows, self._sent_mode = rows, mode

    def stamp(self, serving: str, rollout: int) -> None:
        """What the batches prepared from now on were computed under: the serving version and the number of
        the last marker passed (headers, :func:`gnnstream.stream.rollout.stamp_headers`)."""
        self._stamp = stamp_headers(serving, rollout)

    def forget_sent(self) -> None:
        """Forget every row kept for ``min_change``: each node's next update is published."""
        self._sent_rows = np.zeros((0, 0), dtype=np.float32)  # by iid: the row last handed over for sending
        self._sent_mode = np.zeros(0, dtype=np.int16)  # by iid: its mode code, -1 = none

    def confirm(self, out: Outgoing) -> None:
        """Delete the outbox records of a delivered ``out``."""
        self.outbox.confirm(out.keys)


class Publisher:
    """Delivers the outbox: batches sent and flushed by a thread of its own, one at a time, in order.

    The worker's thread calls :meth:`publish` between its batches: it
    deletes the outbox records of delivered batches and hands new ones to
    the thread. At most ``MAX_IN_FLIGHT`` batches wait for delivery; while
    that many do, new outbox records stay stored and the worker goes on with
    the next events, and the records waiting then go out together, each node
    once (:meth:`OutboxReader.prepare`). A batch whose flush fails is sent again
    (and again) before any later one, so each node's versions go out in
    order; while that goes on, :meth:`publish` waits for it (for ever unless
    stopping). The thread reports through the callbacks it is given and never
    touches the store.

    Args:
        outbox: the records to publish.
        delivery: encodes, sends and flushes columns (:class:`gnnstream.stream.delivery.Delivery`, or
            :class:`~gnnstream.stream.delivery.DeliveryProcess`: another process, beside the worker's next batch).
        topic: the output topic (named in errors).
        stop: the worker's stop request: a stopping worker does not wait for a failing delivery.
        on_delivered: ``(batch, seconds)``, called by the thread after each delivered batch.
        on_retry: ``(error) -> seconds``, called by the thread when a flush failed in a way a retry may cure;
            the batch is sent again after the pause it returns.
        on_ok: called by the thread when a flush succeeded.
    """

    def __init__(self, outbox: OutboxReader, delivery: Delivery | DeliveryProcess, topic: str, stop: threading.Event, *,
                 on_delivered: Callable[[Outgoing, float], None], on_retry: Callable[[BaseException], float],
                 on_ok: Callable[[], None]):
        self.outbox, self.delivery, self.topic = outbox, delivery, topic
        self._stop = stop
        self._on_delivered, self._on_retry, self._on_ok = on_delivered, on_retry, on_ok
        self._cond = threading.Condition()
        self._queue: deque[Outgoing] = deque()  # submitted, not delivered; the first is being sent
        self._done: list[Outgoing] = []  # delivered, not yet confirmed
        self._closing = False
        self._closed = threading.Event()  # set by close(): a pause between retries ends at once
        self._oldest_record_s: float | None = None  # the oldest Kafka record not handed over yet
        self.failure: BaseException | None = None  # a batch could not be delivered, and no retry cures that
        self.failing = False  # the last flush failed and will be retried
        self.thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the worker's thread
    def publish(self, wait_s: float = 0.0) -> None:
        """Delete the outbox records of delivered batches and hand new ones to the thread.

        ``wait_s`` > 0 (the last poll brought nothing: there is nothing to
        overlap delivery with): then wait up to that long for what is in
        flight.

        Raises:
            ValueError: a batch cannot be encoded.
            StreamError: the output topic refuses the updates.
        """
        while True:
            if self.failure is not None:
                raise self.failure
            self.confirm()
            if self.in_flight() < MAX_IN_FLIGHT:
                out = self.outbox.prepare(PUBLISH_LIMIT)
                if not out.keys:
                    break
                out.oldest_record_s, self._oldest_record_s = self._oldest_record_s, None
                self.submit(out)
            elif self.failing and not self._stop.is_set():
                self.wait(0.5)
            else:
                break
        if wait_s > 0 and self.in_flight():
            self.wait(wait_s)
            self.confirm()

    def publish_all(self) -> bool:
        """Deliver the whole outbox; False if the worker was stopped first."""
        while not self._stop.is_set():
            self.publish()
            if not self.in_flight() and not self.outbox.pending():
                return True
            self.wait(0.2)
        return False

    def finish(self, timeout_s: float, hurry: threading.Event) -> int:
        """On leaving the loop: hand over what is left and wait (at most ``timeout_s``, not at all once ``hurry``
        is set) for its delivery; the outbox records left undelivered."""
        deadline = time.monotonic() + timeout_s
        self.publish()
        while self.in_flight() and time.monotonic() < deadline and not hurry.is_set():
            self.wait(0.2)
            self.confirm()
            if not self._stop.is_set() or self.in_flight() < MAX_IN_FLIGHT:
                self.publish()
        self.confirm()
        return self.outbox.pending()

    def confirm(self) -> None:
        """Delete the outbox records of the batches delivered since the last call."""
        for out in self.delivered():
            self.outbox.confirm(out)

    def made_from(self, oldest_record_s: float | None) -> None:
        """The records of a batch recomputed since the last hand-over were read from Kafka at
        ``oldest_record_s`` at the earliest (the next batch's pipeline latency is measured from the oldest)."""
        if oldest_record_s is not None and (self._oldest_record_s is None
                                            or oldest_record_s < self._oldest_record_s):
            self._oldest_record_s = oldest_record_s

    def pending(self) -> int:
        """Outbox records stored, delivered or not."""
        return self.outbox.pending()

    # ------------------------------------------------------------------ between the threads
    def submit(self, out: Outgoing) -> None:
        """Hand ``out`` to the thread (sent after every batch submitted before)."""
        with self._cond:
            self._queue.append(out)
            self._cond.notify_all()

    def in_flight(self) -> int:
        """Batches submitted and not delivered yet."""
        return len(self._queue)

    def delivered(self) -> list[Outgoing]:
        """The batches delivered since the last call, oldest first."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def wait(self, timeout_s: float) -> None:
        """Wait until a batch was delivered or nothing is in flight (at most ``timeout_s``)."""
        with self._cond:
            if self._queue and not self._done and self.failure is None:
                self._cond.wait(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Stop after the batch being sent (waiting at most ``timeout_s`` for it); the rest stays unsent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._closed.set()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            logger.warning("the publisher thread is still flushing after %g s; leaving it (its outbox records "
                           "stay stored for the next start)", timeout_s)

    # ------------------------------------------------------------------ the publisher thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                out = self._queue[0]
            t0 = time.perf_counter()
            try:
                self.delivery.deliver(out.columns, _FLUSH_TIMEOUT_S, out.headers)
            except ValueError as exc:  # the batch cannot be encoded: no retry cures that
                self._fail(exc)
                return
            except Exception as exc:
                found = classify(exc)
                if found.permanent:  # the topic refuses the updates: sending them again cannot help
                    self._fail(StreamError(
                        f"topic {self.topic!r} refuses the embedding updates ({found.kind}): {exc}; check that it "
                        f"exists, that the worker may write to it and that its max.message.bytes is at least "
                        f"--max-message-bytes, then restart (the updates stay in the outbox)"))
                    return
                self.failing = True  # broker down: send the same batch again after a pause
                self._closed.wait(self._on_retry(exc))
                continue
            self.failing = False
            self._on_ok()
            self._on_delivered(out, time.perf_counter() - t0)
            with self._cond:
                self._queue.popleft()
                self._done.append(out)
                self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self.failure = exc
            self._cond.notify_all()
