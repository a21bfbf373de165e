"""The batch target of dynamic micro-batching (``workers/runtime/batching.py``), on a fake clock:

* a backlog doubles the target, up to ``max_batch_size``; light load halves it, down to ``batch_size``;
* with a bound, it grows only while the records' wait plus the predicted time of the batch fit in it;
* a round delivered later than 0.8 of the bound halves it, once;
* records already older than the bound are caught up at the largest batches;
* the target never leaves ``batch_size .. max_batch_size``;
* a light poll waits for more records while their age plus the batch's predicted time stays within
  ``WAIT_SHARE`` of the bound, and never takes a record that would not fit in it.
"""

from __future__ import annotations

import pytest

from gnnstream.stream.clients import Record
from gnnstream.stream.exceptions import StreamError
from gnnstream.workers.runtime.batching import WAIT_SHARE, BatchSizer

NOW = 1_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def _polls(sizer: BatchSizer, available: list[int | None], age_s: float = 0.25,
           seconds_per_event: float | None = None) -> list[int]:
    """Poll ``sizer`` once per entry (``None``: a backlog, as many records as asked; else that many at most),
    the newest record ``age_s`` old; each batch takes ``seconds_per_event``; the targets asked for."""
    asked = []
    for n in available:
        target = sizer.target()
        asked.append(target)
        got = target if n is None else min(n, target)
        sizer.polled(got, NOW - age_s if got else None)
        if seconds_per_event is not None:
            sizer.processed(got, got * seconds_per_event)
    return asked


def test_without_a_bound_the_target_follows_the_polls() -> None:
    sizer = BatchSizer(100, 700, 0.0, clock=Clock())
    assert _polls(sizer, [None] * 5 + [300, 100, 40, 0, 0, 0], seconds_per_event=1.0) == \
        [100, 200, 400, 700, 700, 700, 350, 175, 100, 100, 100]
    sizer.delivered(1e9)  # no bound: a late round changes nothing
    assert sizer.target() == 100


def test_a_backlog_grows_the_target_as_far_as_the_bound_allows() -> None:
    # a record waited 0.25 s, an event takes 1/1024 s: 768 events fill the remaining 0.75 s of the bound
    sizer = BatchSizer(16, 10_000, 1.0, clock=Clock())
    assert _polls(sizer, [None] * 9, age_s=0.25, seconds_per_event=1 / 1024) == \
        [16, 32, 64, 128, 256, 512, 768, 768, 768]
    # cheaper events: it grows again, doubling from where it stands
    assert _polls(sizer, [None] * 3, age_s=0.25, seconds_per_event=1 / 4096) == [768, 1536, 3072]
    # the last poll's records waited longer, leaving less room: the cap comes down with the next poll
    assert _polls(sizer, [None, None], age_s=0.75, seconds_per_event=1 / 4096) == [3072, 1024]


def test_a_slow_batch_shrinks_the_next_one() -> None:
    sizer = BatchSizer(16, 10_000, 1.0, clock=Clock())
    _polls(sizer, [None] * 6, age_s=0.25, seconds_per_event=1 / 1024)
    assert sizer.target() == 768
    sizer.polled(768, NOW - 0.25)
    sizer.processed(768, 3.0)  # a batch of 768 took 3 s, 4 x the room left: the next one is a quarter
    assert sizer.target() == 192


def test_a_round_delivered_late_halves_the_target_once() -> None:
    clock = Clock()
    sizer = BatchSizer(100, 10_000, 1.0, clock=clock)
    assert _polls(sizer, [None] * 5, age_s=0.1) == [100, 200, 400, 800, 1600]  # no cost measured yet: no cap
    sizer.delivered(0.79)  # within 0.8 of the bound
    assert _polls(sizer, [None], age_s=0.1) == [3200]
    sizer.delivered(0.81)
    sizer.delivered(2.5)  # two late rounds since the last poll: halved once
    assert _polls(sizer, [500], age_s=0.1) == [3200]  # the target of the last poll is 6400; halved: 3200
    assert _polls(sizer, [500, 500], age_s=0.1) == [1600, 800]  # and the light polls halve it further


def test_a_backlog_older_than_the_bound_is_caught_up_at_the_largest_batches() -> None:
    sizer = BatchSizer(100, 800, 1.0, clock=Clock())
    # records 5 s old, a batch of 800 takes 4 s and rounds are delivered 6 s late: no batch size meets the
    # bound for them, so the target grows as without one
    asked = []
    for _ in range(6):
        sizer.delivered(6.0)
        asked += _polls(sizer, [None], age_s=5.0, seconds_per_event=4 / 800)
    assert asked == [100, 200, 400, 800, 800, 800]
    # once the records are younger than the bound, the cap applies again: 0.5 s left at 1/200 s per event
    assert _polls(sizer, [None, None], age_s=0.5, seconds_per_event=1 / 200) == [800, 100]


@pytest.mark.parametrize("bound", [0.0, 0.001, 1.0])
def test_the_target_stays_within_batch_size_and_max_batch_size(bound: float) -> None:
    sizer = BatchSizer(100, 400, bound, clock=Clock())
    for age, cost in [(0.0, 1e-9), (0.5, 1e-9), (0.0, 10.0), (0.9, 1e-3), (5.0, 1e-9)]:
        for n in [None, None, None, None, 0, 3, None]:
            asked = _polls(sizer, [n], age_s=age, seconds_per_event=cost)
            assert 100 <= asked[0] <= 400
        sizer.delivered(10.0)
    assert BatchSizer(100, 50, 1.0, clock=Clock()).target() == 100  # max below batch_size: batch_size


def test_a_light_poll_measures_the_wait_from_the_poll() -> None:
    clock = Clock()
    sizer = BatchSizer(100, 10_000, 1.0, clock=clock)
    _polls(sizer, [None] * 3, age_s=0.0, seconds_per_event=1 / 4096)
    assert sizer.target() == 800
    sizer.polled(300, NOW - 30.0)  # not full: the records behind it came after the poll, not after this record
    sizer.processed(300, 3.0)  # 1/100 s per event
    clock.now += 0.5
    assert sizer.age() == 0.5
    assert sizer.target() == 100  # 0.5 s left: 50 events, at least batch_size (30 s old: 400, a catch-up)


class Stream:
    """Records produced at ``rate`` a second from ``start`` on (Kafka time = production time), read in order;
    the consumer side of :meth:`BatchSizer.fill` on ``clock``, which only ``pause`` moves."""

    def __init__(self, clock: Clock, rate: float, start: float):
        self.clock, self.rate, self.start = clock, rate, start
        self.read = 0  # records handed out
        self.taken: list[tuple[float, int, float]] = []  # per more(): when, the batch's records then, its oldest

    def produced(self, i: int) -> float:
        return self.start + i / self.rate

    def poll(self, n: int) -> list[Record]:
        """Up to ``n`` of the records produced by now, without waiting."""
        there = int((self.clock.now - self.start) * self.rate) + 1 - self.read
        got = [Record("ev", 0, i, b"k", b"v", round(self.produced(i) * 1000))
               for i in range(self.read, self.read + max(0, min(n, there)))]
        self.read += len(got)
        return got

    def more(self, records: list[Record]):
        def more(n: int) -> list[Record]:
            got = self.poll(n)
            self.taken.append((self.clock.now, len(records) + len(got), records[0].timestamp_ms / 1000))
            return got
        return more

    def pause(self, seconds: float) -> bool:
        self.clock.now += seconds
        return False


def _fill(sizer: BatchSizer, stream: Stream, per_event: float | None = None, per_batch: float = 0.0) -> list[Record]:
    """One poll as the worker makes it; the batch then takes ``per_batch`` plus ``per_event`` a record (default:
    the time its cost predicts; nothing when no cost is known)."""
    sizer.target()
    records = stream.poll(sizer._asked)
    first = len(records)
    records = sizer.fill(records, stream.more(records), stream.pause)
    sizer.polled(len(records), max(r.timestamp_ms for r in records) / 1000 if records else None, first)
    per_event = sizer._cost if per_event is None else per_event
    if records and per_event:
        took = per_batch + len(records) * per_event
        stream.clock.now += took
        sizer.processed(len(records), took)
    return records


def test_a_busy_stream_waits_for_bigger_batches_within_the_bound() -> None:
    clock = Clock()
    sizer = BatchSizer(1000, 10_000, 1.0, clock=clock)
    sizer.processed(10, 0.013)  # the last batch: 10 events in 13 ms
    stream = Stream(clock, rate=2000.0, start=NOW)  # a record every 0.5 ms; 9 ms a batch and 0.4 ms an event
    sizes = [len(_fill(sizer, stream, 4e-4, 9e-3)) for _ in range(14)]
    # each wait lasts about as long as the last batch took, so batches grow until the oldest record's wait plus
    # the batch's predicted time reach WAIT_SHARE of the bound: (0.5 s - n * cost) * 2000/s
    assert all(a < b for a, b in zip(sizes[:4], sizes[1:5])), sizes  # growing
    assert all(500 <= n <= 560 for n in sizes[-3:]), sizes  # then held near the bound's share
    assert sum(sizes) == stream.read  # nothing polled was left out
    for when, held, oldest in stream.taken:  # no record was taken that would not fit
        assert when + held * sizer._cost <= oldest + WAIT_SHARE * 1.0 + 1e-3


def test_a_light_stream_waits_no_longer_than_its_batches_take() -> None:
    """At a fifth of the worker's capacity a wait as long as the last batch took brings few records: batches
    stay small, and fresh."""
    clock = Clock()
    sizer = BatchSizer(1000, 10_000, 1.0, clock=clock)
    stream = Stream(clock, rate=500.0, start=NOW)
    sizes = [len(_fill(sizer, stream, 4e-4, 9e-3)) for _ in range(30)]
    assert max(sizes[-10:]) <= 15 and sum(sizes) == stream.read, sizes


def test_batches_topped_up_by_waiting_are_not_a_backlog() -> None:
    """A busy stream whose waits fill the target does not double it: only a first poll that comes back full
    tells of a backlog."""
    clock = Clock()
    sizer = BatchSizer(200, 10_000, 1.0, clock=clock)
    stream = Stream(clock, rate=1500.0, start=NOW)  # the first poll gets what came during the batch, waits the rest
    sizes, topped = [], 0
    for _ in range(8):
        before = len(stream.taken)  # a poll after the first one: the first was short, waiting topped it up
        sizes.append(len(_fill(sizer, stream, 4e-4, 9e-3)))
        topped += len(stream.taken) > before
    assert sizes == [200] * 8 and sizer.target() == 200 and topped == 8, (sizes, topped)
    sizer.polled(200, clock.now, first=200)  # a first poll that is full: a backlog
    assert sizer.target() > 200


def test_a_poll_never_plans_past_the_bound() -> None:
    clock = Clock()
    sizer = BatchSizer(1000, 10_000, 1.0, clock=clock)
    sizer.processed(100, 0.1)  # 1 ms an event
    stream = Stream(clock, rate=10_000.0, start=NOW - 0.3)  # 3,000 records there already, more coming fast
    sizer.target()
    first = stream.poll(11)  # the poll got eleven of them, 0.3 s old: 0.2 s are left of WAIT_SHARE
    records = sizer.fill(list(first), stream.more(first), stream.pause)
    assert 140 <= len(records) <= 200  # about 0.05 s after the first pause, 150 fit
    for when, held, oldest in stream.taken:
        assert when + held * 1e-3 <= oldest + WAIT_SHARE * 1.0 + 1e-9
    # records older than the bound's share: nothing more is waited for
    late = BatchSizer(1000, 10_000, 1.0, clock=clock)
    late.target()
    stale = [Record("ev", 0, 0, b"k", b"v", round((clock.now - 0.6) * 1000))]
    assert late.fill(list(stale), lambda n: pytest.fail("polled"), lambda s: pytest.fail("paused")) == stale


def test_a_poll_stops_waiting_at_the_target_or_a_stop() -> None:
    clock = Clock()
    sizer = BatchSizer(100, 100, 1.0, clock=clock)
    stream = Stream(clock, rate=1000.0, start=NOW)
    assert len(_fill(sizer, stream)) == 100  # no cost known yet: the target ends the wait, at 0.1 s
    assert clock.now - NOW == pytest.approx(0.1)
    stopping = BatchSizer(100, 100, 1.0, clock=clock)
    stopping.target()
    first = stream.poll(100)
    waits: list[float] = []
    assert stopping.fill(list(first), stream.more(first), lambda s: waits.append(s) or True) == first
    assert len(waits) == 1


def test_without_a_bound_a_poll_takes_what_is_there() -> None:
    sizer = BatchSizer(1000, 10_000, 0.0, clock=Clock())
    sizer.target()
    first = [Record("ev", 0, 0, b"k", b"v", round(NOW * 1000))]
    assert sizer.fill(list(first), lambda n: pytest.fail("polled"), lambda s: pytest.fail("paused")) == first


def test_a_failing_poll_ends_the_wait_and_keeps_the_records() -> None:
    clock = Clock()
    sizer = BatchSizer(1000, 10_000, 1.0, clock=clock)
    sizer.target()
    first = [Record("ev", 0, 0, b"k", b"v", round(NOW * 1000))]

    def down(n: int) -> list[Record]:
        raise OSError("broker down")

    def pause(s: float) -> bool:
        clock.now += s
        return False

    assert sizer.fill(list(first), down, pause) == first  # the next poll reports the failure

    def fatal(n: int) -> list[Record]:
        raise StreamError("assignment hook failed")

    with pytest.raises(StreamError):
        sizer.fill(list(first), fatal, pause)
