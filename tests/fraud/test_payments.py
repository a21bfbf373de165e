"""The seeded payment stream: same seed same bytes, the typed schema it declares, and the patterns it plants
found again in the events alone."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from gnnstream.fraud.payments import DAY, SCHEMA, generate, main

SMALL = dict(accounts=300, merchants=40, days=6, rings=3, bursts=2, chains=4)


@pytest.fixture(scope="module")
def stream():
    return generate(7, **SMALL)


def test_the_same_seed_gives_the_same_stream_and_another_seed_another(stream) -> None:
    again = generate(7, **SMALL)
    assert again.events == stream.events and again.labels == stream.labels
    assert generate(8, **SMALL).events != stream.events


def test_events_follow_the_schema_they_declare(stream) -> None:
    widths = SCHEMA["node_types"]
    relations = {(r["src_type"], r["rel"], r["dst_type"]): r["edge_features"] for r in SCHEMA["relations"]}
    created: dict[tuple[str, str], float] = {}
    last = -np.inf
    txns = []
    for ev in stream.events:
        assert ev["ts"] >= last, "events are in time order"
        last = ev["ts"]
        if ev["op"] == "node_upsert":
            assert len(ev["features"]) == widths[ev["type"]]
            assert (ev["type"], ev["id"]) not in created, "each node is created once"
            created[(ev["type"], ev["id"])] = ev["ts"]
            continue
        assert ev["op"] == "edge_upsert"
        rel = (ev["src_type"], ev["rel"], ev["dst_type"])
        assert len(ev.get("features", [])) == relations[rel]
        for end in (("src_type", "src"), ("dst_type", "dst")):
            assert (ev[end[0]], ev[end[1]]) in created, f"{ev} names a node before its node_upsert"
        if rel == tuple(SCHEMA["scored"].values()):
            txns.append(ev["txn_id"])
    assert len(txns) == len(set(txns)) == len(stream.labels) and set(txns) == set(stream.labels)
    summary = stream.summary()
    assert summary["payments"] == len(txns) and 0 < summary["fraud_payments"] < len(txns)
    assert summary["fraud_payments"] == sum(p["payments"] for p in summary["planted"].values())


def _by_pattern(stream, pattern: str) -> list[dict]:
    return [ev for ev in stream.events if "txn_id" in ev and stream.labels[ev["txn_id"]][1] == pattern]


def test_rings_share_devices_that_no_one_else_uses(stream) -> None:
    users = defaultdict(set)
    for ev in stream.events:
        if ev["op"] == "edge_upsert" and ev["rel"] == "uses":
            users[ev["dst"]].add(ev["src"])
    ring_accounts = {ev["src"] for ev in _by_pattern(stream, "ring")}
    assert len(ring_accounts) == stream.planted["ring"]["accounts"] >= 3 * 5
    for account in ring_accounts:
        devices = [d for d, us in users.items() if account in us]
        assert 1 <= len(devices) <= 3
        ring = set().union(*(users[d] for d in devices))
        assert ring <= ring_accounts and len(ring) >= 5, "a ring's devices serve only the ring, five or more"
    for ev in _by_pattern(stream, "ring"):
        hour = (ev["ts"] % DAY) / 3600
        assert hour < 5 and ev["features"][3] == 0.0  # at night, card not present


def test_bursts_are_small_payments_at_one_merchant_within_half_an_hour(stream) -> None:
    by_merchant = defaultdict(list)
    for ev in _by_pattern(stream, "burst"):
        by_merchant[ev["dst"]].append(ev)
        assert ev["features"][0] <= np.log1p(2.0) + 1e-6
    assert len(by_merchant) == stream.planted["burst"]["instances"] == 2  # two merchants: seeded, checked here
    for evs in by_merchant.values():
        ts = [ev["ts"] for ev in evs]
        assert 20 <= len(evs) <= 40 and max(ts) - min(ts) <= 1800


def test_chains_carry_money_through_three_to_six_new_accounts(stream) -> None:
    received = {}
    for ev in stream.events:
        if ev["op"] == "edge_upsert" and ev["rel"] == "sends":
            received.setdefault(ev["dst"], ev)  # the first transfer into each account
    payers = {ev["src"] for ev in _by_pattern(stream, "chain")}
    assert len(payers) == stream.planted["chain"]["instances"]
    for payer in payers:
        hops, at, ts = 0, payer, np.inf
        while at in received and received[at]["ts"] < ts and hops < 10:
            ts = received[at]["ts"]
            at = received[at]["src"]
            hops += 1
        assert 3 <= hops <= 7, f"{payer}: {hops} transfers back"  # the mules, and the source if it was paid into


def test_the_command_writes_the_files_its_summary_counts(tmp_path: Path, capsys) -> None:
    assert main(["--out", str(tmp_path), "--seed", "3", "--accounts", "120", "--merchants", "30", "--days", "4",
                 "--rings", "1", "--bursts", "1", "--chains", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(lines) == summary["events"]
    with open(tmp_path / "labels.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == summary["payments"] and sum(int(r["label"]) for r in rows) == summary["fraud_payments"]
    assert json.loads((tmp_path / "schema.json").read_text()) == SCHEMA
    for bad in (["--accounts", "10"], ["--sessions-per-day", "0"], ["--rings", "-1"]):
        with pytest.raises(SystemExit) as stop:
            main(["--out", str(tmp_path), *bad])
        assert stop.value.code == 2, bad
