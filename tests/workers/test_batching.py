"""The batch target of dynamic micro-batching (``workers/runtime/batching.py``), on a fake clock:

* a backlog doubles the target, up to ``max_batch_size``; light load halves it, down to ``batch_size``;
* with a bound, it grows only while the records' wait plus the predicted time of the batch fit in it;
* a round delivered later than 0.8 of the bound halves it, once;
* records already older than the bound are caught up at the largest batches;
* the target never leaves ``batch_size .. max_batch_size``.
"""

from __future__ import annotations

import pytest

from gnnstream.workers.runtime.batching import BatchSizer

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
