"""Dynamic micro-batching under a latency bound: how many records the worker's next poll asks for.

Larger batches are cheaper per event (the updates of one node within a
batch coalesce) but each one takes longer, and every event of a batch waits
for the whole batch. :class:`BatchSizer` keeps a target between
``batch_size`` and ``max_batch_size``:

* a poll that came back full (a backlog) doubles it; one that came back
  less than half full (light load) halves it;
* with a bound (``max_latency_s`` > 0) it is capped so that the batch's
  freshness stays within the bound: the records the next poll returns have
  waited ``age`` seconds already, and a batch of ``n`` takes about
  ``n * cost`` more, where ``cost`` is the last round's seconds per event
  (decode, apply, recompute and hand-over to the publisher); the cap is the
  largest ``n`` with ``age + n * cost <= max_latency_s``;
* a delivered round whose freshness exceeded ``SHRINK_AT`` of the bound
  halves it (at most once per poll): what the cap does not see (the time a round
  waits for the publisher, and delivery) shows there.

Freshness is measured from the records' Kafka timestamps (when they were
produced), not from the events' ``ts``: event time may lie anywhere in the
past (a replay of history), and no batch size makes such events fresher.
``age`` is the time since the newest record of the last poll (the records
behind it are younger) or, when that poll was not full, since the poll.

A light poll (fewer records than the target) waits for more while the
bound allows (:meth:`BatchSizer.fill`): a poll returns at its first record,
so without waiting a batch would hold only what arrived while the last one
was processed, and each batch has a cost of its own besides its events'.
It takes more records, without blocking, after pauses of half the time
left (at most 50 ms), until the target is reached, the wait has lasted as
long as the last batch took to process, or the oldest record's age plus the
predicted time of the batch (its size times ``cost``) would pass
``WAIT_SHARE`` of the bound, and never more records than fit in it then.
Waiting no longer than the last batch took keeps a lightly loaded worker's
batches small and fresh (it is idle at least as long as it waits) while a
busy one's grow with its batches' time, up to what the bound allows. The
rest of the bound is left to the hand-over to the publisher and the
delivery. Without a bound a poll takes what is there.

Events that already waited longer than the bound cannot meet it, whatever
the batch size (a backlog left by a restart, an outage or a burst above
capacity): while the records behind the last poll are that old, the cap and
the halving on freshness are suspended, the target grows towards
``max_batch_size`` (the fastest way through the backlog) and both apply
again once the worker is back within the bound.

The worker's thread calls :meth:`target` before each poll, :meth:`fill`
and :meth:`polled` after it and :meth:`processed` once the batch was
handed to the publisher; the publisher thread calls :meth:`delivered`. ``clock`` gives the time in
seconds since the epoch, the scale of Kafka timestamps.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from typing import Callable

from gnnstream.stream.clients import Record
from gnnstream.stream.exceptions import StreamError

__all__ = ["BatchSizer", "SHRINK_AT", "WAIT_SHARE"]

logger = logging.getLogger(__name__)

SHRINK_AT = 0.8  # a delivered round fresher than this share of the bound leaves the target as it is
WAIT_SHARE = 0.5  # a light poll waits for more records while their age plus the batch's time stays within this share
_MIN_PAUSE_S = 0.001  # a light poll stops waiting when less than twice this is left
_MAX_PAUSE_S = 0.05  # and looks for more records at least this often
_timestamp_ms = operator.attrgetter("timestamp_ms")


class BatchSizer:
    """The target of the worker's next poll (see the module's text).

    Args:
        batch_size: the first and the smallest target.
        max_batch_size: the largest target (below ``batch_size``, ``batch_size``).
        max_latency_s: the freshness bound in seconds (0 = no bound: the target follows the polls only).
        clock: seconds since the epoch (``time.time``; tests pass a fake one).
    """

    def __init__(self, batch_size: int, max_batch_size: int, max_latency_s: float = 0.0,
                 clock: Callable[[], float] = time.time):
        if batch_size < 1 or max_latency_s < 0:
            raise ValueError(f"expected batch_size >= 1 and max_latency_s >= 0 (got {batch_size}, {max_latency_s})")
        self.floor = batch_size
        self.ceiling = max(max_batch_size, batch_size)
        self.bound = float(max_latency_s)
        self.clock = clock
        self._target = batch_size  # grown or halved by polls and delivered rounds
        self._asked = batch_size  # what the last poll asked for
        self._behind: float | None = None  # the records the next poll returns came after this (epoch seconds)
        self._cost: float | None = None  # seconds per event of the last round
        self._took = 0.0  # seconds the last round took (0: none yet): a light poll waits no longer than this
        self._lock = threading.Lock()  # delivered() runs on the publisher thread
        self._late = False  # a round delivered since the last target() was later than SHRINK_AT of the bound

    def target(self) -> int:
        """The number of records the next poll asks for."""
        with self._lock:
            late, self._late = self._late, False
        target = self._target
        age = self.age()
        if age is not None and age < self.bound:  # the next records can still be on time
            if late:
                target = max(target // 2, self.floor)
            if self._cost:
                target = max(min(target, int((self.bound - age) / self._cost)), self.floor)
        self._target = self._asked = target
        return target

    def age(self) -> float | None:
        """How long the records the next poll returns have waited at least (None: not known, or no bound)."""
        if not self.bound or self._behind is None:
            return None
        return max(0.0, self.clock() - self._behind)

    def fill(self, records: list[Record], more: Callable[[int], list[Record]],
             pause: Callable[[float], bool]) -> list[Record]:
        """``records`` (what the poll for :meth:`target` returned) and the records polled after it while the bound
        allows (see the module's text); ``records`` is extended in place.

        Args:
            records: the poll's records; none: nothing is waited for.
            more: ``more(n)`` polls up to ``n`` records without waiting.
            pause: ``pause(s)`` waits ``s`` seconds; True ends the wait (the worker stops).

        Raises:
            StreamError: a poll failed for good (as the consumer's ``poll_batch``). A poll that fails otherwise
                (Kafka unavailable) ends the wait: the records polled before it are kept, the next poll
                reports it.
        """
        if not self.bound or not records:
            return records
        cost = self._cost or 0.0
        # a record produced "later" than now (its producer's clock ahead), or without a time, counts as produced now
        oldest = min(map(_timestamp_ms, records)) / 1000
        start = self.clock()
        limit = (min(oldest, start) if oldest > 0 else start) + WAIT_SHARE * self.bound
        while len(records) < self._asked:
            now = self.clock()
            slack = limit - now - len(records) * cost
            if self._took:  # no longer than the last round took (none yet: as the bound allows)
                slack = min(slack, start + self._took - now)
            if slack < 2 * _MIN_PAUSE_S or pause(min(slack / 2, _MAX_PAUSE_S)):
                break
            fits = int((limit - self.clock()) / cost) - len(records) if cost else self._asked
            room = min(self._asked - len(records), fits)
            if room <= 0:
                break
            try:
                records += more(room)
            except StreamError:
                raise
            except Exception as exc:
                logger.debug("polling for more records failed: %r", exc)
                break
        return records

    def polled(self, count: int, newest_record_s: float | None = None, first: int | None = None) -> None:
        """A poll returned ``count`` records, the newest of them produced at ``newest_record_s`` (0 or less: not
        known), ``first`` of them (default all) from its first poll, before :meth:`fill` waited for more: only a
        first poll that came back full tells of a backlog."""
        full = (count if first is None else first) >= self._asked
        if full:
            self._target = min(2 * self._asked, self.ceiling)
        elif count < self._asked // 2:
            self._target = max(self._asked // 2, self.floor)
        known = newest_record_s is not None and newest_record_s > 0
        self._behind = newest_record_s if full and known else self.clock()

    def processed(self, count: int, seconds: float) -> None:
        """The last poll's ``count`` records were decoded, applied, recomputed and handed over in ``seconds``."""
        if count > 0 and seconds > 0:
            self._cost = seconds / count
            self._took = seconds

    def delivered(self, freshness_s: float) -> None:
        """A round was delivered ``freshness_s`` after its oldest record was produced (any thread)."""
        if self.bound and freshness_s > SHRINK_AT * self.bound:
            with self._lock:
                self._late = True
