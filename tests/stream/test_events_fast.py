"""The orjson path of ``decode_event_json`` agrees with the strict decoder on every input it takes."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gnnstream.stream.events import (
    MAX_AHEAD_S, EdgeDelete, EdgeUpsert, InvalidEvent, NodeDelete, NodeUpsert, _decode_common,
    _reject_constant, _unique_fields, decode_event, decode_event_json,
)


def strict(text: str):
    """The decoder without the orjson path: the event, or the reason it is refused."""
    try:
        return decode_event(json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_fields))
    except InvalidEvent as exc:
        return exc.reason
    except ValueError:
        return "not_json"


def fast(text: str):
    """What the orjson path returns for ``text`` as str and as bytes (both must agree)."""
    a = _decode_common(text, '"', "\\")
    b = _decode_common(text.encode("utf-8", "surrogatepass"), b'"', b"\\")
    assert a == b
    return a


@pytest.mark.parametrize("text, expected", [
    ('{"op":"edge_upsert","src":"a","dst":"b","ts":5,"weight":2}', EdgeUpsert("a", "b", 5.0, 2.0)),
    ('{"op":"edge_upsert","src":"a","dst":"b","ts":5}', EdgeUpsert("a", "b", 5.0, 1.0)),
    ('{"op":"edge_delete","src":"a","dst":"b","ts":5.5}', EdgeDelete("a", "b", 5.5)),
    ('{"op":"node_upsert","id":"n","ts":0,"features":[1,-2.5,3e2]}', NodeUpsert("n", 0.0, (1.0, -2.5, 300.0))),
    ('{"op":"node_delete","id":"n","ts":7}', NodeDelete("n", 7.0)),
])
def test_usual_events_take_the_fast_path(text: str, expected: object) -> None:
    assert fast(text) == expected
    assert decode_event_json(text) == decode_event_json(text.encode()) == expected == strict(text)


@pytest.mark.parametrize("text, reason", [
    ('{"op":"node_delete","id":"a","ts":1,"ts":2}', "duplicate_field"),
    ('{"op":"node_delete","id":"a","ts":1,"\\u0074s":2}', "duplicate_field"),  # an escaped repeat
    ('{"op":"edge_delete","src":"a","dst":"b","ts":1,"dst":"c"}', "duplicate_field"),
    ('{"op":"edge_delete","src":7,"dst":"b","ts":1,"ts":2}', "duplicate_field"),  # as many quotes as one valid
    ('{"op":"node_delete","id":"a","ts":true}', "bad_type"),
    ('{"op":"node_delete","id":"a","ts":NaN}', "not_finite"),
    ('{"op":"node_delete","id":"a","ts":1e999}', "not_finite"),
    ('{"op":"node_delete","id":"a","ts":-1}', "bad_ts"),
    ('{"op":"node_delete","id":"a","ts":1e300}', "bad_ts"),  # would move stream time past every edge's
    ('{"op":"node_delete","id":"a","ts":1700000000000}', "bad_ts"),  # milliseconds, not seconds
    ('{"op":"node_delete","id":"","ts":1}', "empty_id"),
    ('{"op":"node_delete","id":"' + "x" * 257 + '","ts":1}', "bad_id"),
    ('{"op":"node_upsert","id":"a","ts":1,"features":[1,false]}', "bad_type"),
    ('{"op":"node_upsert","id":"a","ts":1,"features":[]}', "bad_features"),
    ('{"op":"edge_upsert","src":"a","dst":"b","ts":1,"weight":"3"}', "bad_type"),
    ('{"op":"edge_upsert","src":"a","dst":"b","ts":1,"extra":1}', "unknown_field"),
    ('{"op":"edge_upsert","src":"a","ts":1}', "missing_field"),
    ('[1, 2]', "not_object"),
])
def test_doubtful_events_fall_through_to_the_strict_reason(text: str, reason: str) -> None:
    assert fast(text) is None
    with pytest.raises(InvalidEvent) as info:
        decode_event_json(text.encode())
    assert info.value.reason == reason == strict(text)


def test_a_timestamp_may_run_ahead_of_the_clock_by_up_to_a_day() -> None:
    soon, later = time.time() + MAX_AHEAD_S - 60, time.time() + MAX_AHEAD_S + 60
    assert decode_event_json(f'{{"op":"node_delete","id":"a","ts":{soon}}}') == NodeDelete("a", soon)
    with pytest.raises(InvalidEvent) as info:
        decode_event_json(f'{{"op":"node_delete","id":"a","ts":{later}}}')
    assert info.value.reason == "bad_ts" and "ahead of this machine's clock" in str(info.value)


def test_integer_ids_and_long_ids_are_decided_by_the_strict_path() -> None:
    text = '{"op":"node_delete","id":12,"ts":1}'
    assert fast(text) is None and decode_event_json(text) == NodeDelete("12", 1.0)
    long_id = "é" * 100  # 200 bytes: allowed, but past the length the fast path takes on trust
    text = json.dumps({"op": "node_delete", "id": long_id, "ts": 1}, ensure_ascii=False)
    assert fast(text) is None and decode_event_json(text.encode()) == NodeDelete(long_id, 1.0)


def test_invalid_utf8_is_named() -> None:
    with pytest.raises(InvalidEvent) as info:
        decode_event_json(b'{"op":"node_delete","id":"\xff","ts":1}')
    assert info.value.reason == "not_utf8"


odd = st.one_of(st.text(max_size=6), st.integers(-5, 2**70), st.floats(), st.booleans(), st.none(),
                st.lists(st.floats() | st.integers(-3, 3) | st.booleans(), max_size=3))
good = {"src": st.text(min_size=1, max_size=6), "dst": st.text(min_size=1, max_size=6),
        "id": st.text(min_size=1, max_size=6), "ts": st.floats(0, 2e9) | st.integers(0, 2**40),
        "weight": st.floats(-10, 10) | st.integers(-3, 3),
        "features": st.lists(st.floats(-1e6, 1e6) | st.integers(-3, 3), min_size=1, max_size=4)}
needs = {"edge_upsert": ["src", "dst", "ts", "weight"], "edge_delete": ["src", "dst", "ts"],
         "node_upsert": ["id", "ts", "features"], "node_delete": ["id", "ts"]}


@st.composite
def events(draw: st.DrawFn) -> tuple[str, dict, str | None]:
    """Mostly valid events: each field valid or (sometimes) odd, sometimes one more field, sometimes a repeat."""
    op = draw(st.sampled_from(sorted(needs)))
    fields = {name: draw(odd if draw(st.integers(0, 5)) == 0 else good[name]) for name in needs[op]}
    if draw(st.integers(0, 5)) == 0:
        fields[draw(st.sampled_from(sorted(good)))] = draw(odd)
    dup = draw(st.sampled_from([None, None, *fields]))
    return op, fields, dup


@settings(max_examples=500, deadline=None)
@given(events())
def test_fast_path_never_disagrees_with_the_strict_decoder(case: tuple) -> None:
    op, fields, dup = case
    text = json.dumps({"op": op, **fields})
    if dup is not None and dup in fields:  # a repeated field, written the way a careless producer would
        text = text[:-1] + f', "{dup}": {json.dumps(fields[dup])}}}'
    got = fast(text)
    want = strict(text)
    if got is not None:
        assert got == want
    if isinstance(want, str):
        with pytest.raises(InvalidEvent) as info:
            decode_event_json(text.encode())
        assert info.value.reason == want
    else:
        assert decode_event_json(text.encode()) == want
