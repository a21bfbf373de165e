"""A seeded payment stream with planted fraud: accounts, merchants and devices as a typed event stream.

No public typed fraud graph ships with the repository, so the typed example
generates one. The same arguments give the same bytes on any machine (numpy
PCG64, no wall clock). What it writes:

- ``events.jsonl``: typed events in time order: the fields of today's events
  plus ``type`` on a ``node_upsert``, ``src_type``, ``rel``, ``dst_type``,
  ``features`` and ``txn_id`` on an ``edge_upsert`` (the events of a typed
  graph, which ``gnnstream train --schema`` trains on). A ``node_upsert`` of
  each account, merchant and device (with its features) comes before the
  first event that names it, then ``edge_upsert`` events of three relations:

  ========================  ===========================================  ==================
  relation                  what an event is                             edge features
  ========================  ===========================================  ==================
  account -pays-> merchant  a card payment, with a ``txn_id`` (scored)   4: log amount,
                                                                         hour (sin, cos),
                                                                         card present
  account -uses-> device    a login                                      none
  account -sends-> account  a transfer between two accounts              1: log amount
  ========================  ===========================================  ==================

- ``labels.csv``: ``txn_id,ts,label,pattern`` for every payment: label 1 for
  the payments a planted pattern made, with its name; 0 and ``legit`` for the
  rest.
- ``schema.json``: node types with their feature widths, the relations with
  their edge-feature widths, and the scored relation.

**Legitimate behaviour.** Each account opens on a day of the period (a
quarter exist from the start), owns one or two devices, has a few favourite
merchants drawn by a power law of merchant popularity, and pays at a steady
rate (``--sessions-per-day``), a new merchant now and then; it logs in from
one of its devices before a session of payments; amounts are log-normal
around its merchant's category mean, mostly at daytime hours, card present
for a share of categories; now and then it sends money to one of a few
friends.

**Planted fraud** (``--rings``, ``--bursts``, ``--chains`` of each):

- ``ring``: 5 to 12 fresh accounts that log in from a shared pool of one to
  three devices (the ring's only devices) and, over two days, make high
  payments (8x the category mean), card not present, at night, at two or
  three "cash-out" merchants of the ring.
- ``burst``: card testing at one merchant: within 30 minutes, 20 to 40
  existing accounts (taken over) log in from new devices and make small
  payments (under 2 units) there.
- ``chain``: a mule chain: money enters an existing account, moves through
  3 to 6 fresh accounts (each sends most of what it received to the next
  within hours) and the last pays a cash-out merchant in two to four high
  payments.

Fraudulent accounts' own features look like those of legitimate new
accounts: the patterns are in the graph and the transactions, not in a flag.

    python -m gnnstream.fraud.payments --out /tmp/payments --seed 0
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gnnstream.workers.settings import finite_number, whole_number

__all__ = ["PaymentStream", "SCHEMA", "generate", "write_stream", "main"]

T0 = 1_767_225_600  # 2026-01-01T00:00:00Z: the stream's first second
DAY = 86_400
CATEGORIES = ("grocery", "fuel", "restaurant", "electronics", "travel", "fashion", "gaming", "transfer_service")
CATEGORY_MEAN = (35.0, 50.0, 28.0, 240.0, 420.0, 80.0, 25.0, 150.0)  # mean payment amount of each
CARD_PRESENT = (0.9, 0.95, 0.8, 0.4, 0.1, 0.5, 0.05, 0.1)  # share of card-present payments of each
OS = ("android", "ios", "windows", "macos")

SCHEMA: dict[str, Any] = {
    "node_types": {"account": 6, "merchant": len(CATEGORIES) + 2, "device": len(OS) + 2},
    "relations": [
        {"src_type": "account", "rel": "pays", "dst_type": "merchant", "edge_features": 4},
        {"src_type": "account", "rel": "uses", "dst_type": "device", "edge_features": 0},
        {"src_type": "account", "rel": "sends", "dst_type": "account", "edge_features": 1},
    ],
    "scored": {"src_type": "account", "rel": "pays", "dst_type": "merchant"},
}


@dataclass
class PaymentStream:
    """The generated stream: ``events`` in time order and a label per payment (``txn_id -> (label, pattern)``)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    labels: dict[str, tuple[int, str]] = field(default_factory=dict)
    planted: dict[str, dict[str, int]] = field(default_factory=dict)  # per pattern: instances, payments, accounts

    def summary(self) -> dict[str, Any]:
        ops: dict[str, int] = {}
        for ev in self.events:
            kind = ev["op"] if ev["op"] == "node_upsert" else f"{ev['op']}:{ev['rel']}"
            ops[kind] = ops.get(kind, 0) + 1
        payments = len(self.labels)
        fraud = sum(label for label, _ in self.labels.values())
        return {"events": len(self.events), "by_kind": ops, "payments": payments, "fraud_payments": fraud,
                "fraud_rate": round(fraud / payments, 5) if payments else 0.0, "planted": self.planted,
                "first_ts": self.events[0]["ts"] if self.events else None,
                "last_ts": self.events[-1]["ts"] if self.events else None}


class _Builder:
    """Collects events (sorted at the end, ties kept in the order made) and creates nodes on first use."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int, dict[str, Any]]] = []
        self.first: dict[tuple[str, str], float] = {}  # (type, id) -> ts of its node_upsert
        self.features: dict[tuple[str, str], list[float]] = {}
        self.labels: dict[str, tuple[int, str]] = {}
        self.txn = 0

    def node(self, type_: str, id_: str, features: list[float]) -> None:
        self.features[(type_, id_)] = features

    def _add(self, ts: float, ev: dict[str, Any]) -> None:
        self.rows.append((ts, len(self.rows), ev))

    def _touch(self, type_: str, id_: str, ts: float) -> None:
        seen = self.first.get((type_, id_))
        if seen is None or ts < seen:
            self.first[(type_, id_)] = ts

    def edge(self, ts: float, src_type: str, src: str, rel: str, dst_type: str, dst: str,
             features: list[float] | None = None, **extra: Any) -> None:
        ts = round(float(ts), 3)
        self._touch(src_type, src, ts)
        self._touch(dst_type, dst, ts)
        ev = {"op": "edge_upsert", "src_type": src_type, "src": src, "rel": rel, "dst_type": dst_type, "dst": dst,
              "ts": ts, "weight": 1.0}
        if features is not None:
            ev["features"] = [round(float(x), 5) for x in features]
        ev.update(extra)
        self._add(ts, ev)

    def payment(self, ts: float, account: str, merchant: str, amount: float, card_present: bool,
                label: int, pattern: str) -> None:
        self.txn += 1
        txn_id = f"t{self.txn}"
        hour = (ts % DAY) / 3600.0
        feats = [math.log1p(amount), math.sin(2 * math.pi * hour / 24), math.cos(2 * math.pi * hour / 24),
                 1.0 if card_present else 0.0]
        self.edge(ts, "account", account, "pays", "merchant", merchant, feats, txn_id=txn_id)
        self.labels[txn_id] = (label, pattern)

    def finish(self) -> PaymentStream:
        for (type_, id_), ts in self.first.items():  # each node just before the first event naming it
            self.rows.append((ts, -1, {"op": "node_upsert", "type": type_, "id": id_, "ts": ts,
                                       "features": [round(float(x), 5) for x in self.features[(type_, id_)]]}))
        self.rows.sort(key=lambda row: (row[0], row[1]))
        out = PaymentStream(events=[ev for _, _, ev in self.rows])
        out.labels = {txn: self.labels[txn] for txn in (ev["txn_id"] for ev in out.events if "txn_id" in ev)}
        return out


def _daytime(rng: np.random.Generator, day: float) -> float:
    """A second of day ``day`` at a daytime hour (mostly 8:00 to 22:00)."""
    hour = float(np.clip(rng.normal(14.5, 3.5), 0.0, 23.99))
    return T0 + day * DAY + hour * 3600.0


def generate(seed: int = 0, *, accounts: int = 5_000, merchants: int = 400, days: int = 30,
             sessions_per_day: float = 0.6, rings: int = 12, bursts: int = 6, chains: int = 20) -> PaymentStream:
    """Generate the stream (see the module's text for what it holds and plants)."""
    if accounts < 50 or merchants < 20 or days < 3:
        raise ValueError(f"expected at least 50 accounts, 20 merchants and 3 days (got {accounts}, {merchants}, "
                         f"{days})")
    rng = np.random.default_rng(seed)
    b = _Builder()
    ncat = len(CATEGORIES)
    # merchants: a category and a popularity drawn from a power law
    m_cat = rng.integers(ncat, size=merchants)
    popularity = (np.arange(merchants) + 1.0) ** -1.1
    popularity = popularity[rng.permutation(merchants)]
    popularity /= popularity.sum()
    m_names = [f"m{j}" for j in range(merchants)]
    for j, name in enumerate(m_names):
        onehot = [1.0 if c == m_cat[j] else 0.0 for c in range(ncat)]
        b.node("merchant", name, onehot + [math.log(CATEGORY_MEAN[m_cat[j]]) / 6.0,
                                           float(np.log(popularity[j] * merchants))])
    device_count = 0

    def new_device() -> str:
        nonlocal device_count
        name = f"d{device_count}"
        device_count += 1
        os_ = int(rng.integers(len(OS)))
        b.node("device", name, [1.0 if o == os_ else 0.0 for o in range(len(OS))]
               + [float(rng.random() < 0.02), float(rng.uniform(0, 1))])  # emulator flag, screen size
        return name

    def new_account(name: str) -> None:
        b.node("account", name, [float(rng.integers(1, 4)) / 3.0, float(rng.uniform(18, 80)) / 80.0,
                                 float(rng.integers(5)) / 4.0, float(rng.random() < 0.3),
                                 float(rng.normal()), float(rng.normal())])  # KYC, age, region, premium, 2 noise

    # legitimate accounts
    opened = np.where(rng.random(accounts) < 0.25, 0.0, rng.uniform(0, days - 1, size=accounts))
    a_names = [f"a{i}" for i in range(accounts)]
    own_devices: list[list[str]] = []
    for i, name in enumerate(a_names):
        new_account(name)
        own_devices.append([new_device() for _ in range(1 + int(rng.random() < 0.3))])
    favourites = [list(rng.choice(merchants, size=int(rng.integers(2, 7)), replace=False, p=popularity))
                  for _ in range(accounts)]
    friends = [list(rng.choice(accounts, size=int(rng.integers(1, 4)), replace=False)) for _ in range(accounts)]
    for i, name in enumerate(a_names):
        day = float(opened[i])
        while True:
            day += float(rng.exponential(1.0 / sessions_per_day))
            if day >= days:
                break
            ts = _daytime(rng, math.floor(day))
            b.edge(ts - float(rng.uniform(30, 600)), "account", name, "uses", "device",
                   own_devices[i][int(rng.integers(len(own_devices[i])))])
            for _ in range(1 + int(rng.random() < 0.3)):  # a session: one or two payments
                j = int(rng.choice(favourites[i])) if rng.random() < 0.85 else int(rng.choice(merchants, p=popularity))
                c = m_cat[j]
                amount = float(rng.lognormal(math.log(CATEGORY_MEAN[c]), 0.6))
                b.payment(ts, name, m_names[j], amount, bool(rng.random() < CARD_PRESENT[c]), 0, "legit")
                ts += float(rng.uniform(60, 1800))
            if rng.random() < 0.08:
                friend = int(rng.choice(friends[i]))
                if friend != i:
                    b.edge(ts + float(rng.uniform(60, 3600)), "account", name, "sends", "account",
                           a_names[friend], [math.log1p(float(rng.lognormal(math.log(60), 0.8)))])
    planted = {name: {"instances": 0, "payments": 0, "accounts": 0} for name in ("ring", "burst", "chain")}
    fresh = 0

    def fresh_account() -> str:
        nonlocal fresh
        name = f"a{accounts + fresh}"
        fresh += 1
        new_account(name)
        return name

    cash_out = [j for j in range(merchants) if CATEGORIES[m_cat[j]] in ("electronics", "gaming", "transfer_service")]
    cash_out = cash_out or list(range(merchants))
    # device-sharing rings
    for _ in range(rings):
        day = float(rng.uniform(1, days - 2))
        members = [fresh_account() for _ in range(int(rng.integers(5, 13)))]
        pool = [new_device() for _ in range(int(rng.integers(1, 4)))]
        targets = [int(x) for x in rng.choice(cash_out, size=min(len(cash_out), int(rng.integers(2, 4))),
                                              replace=False)]
        for member in members:
            for _ in range(int(rng.integers(2, 6))):
                ts = T0 + (day + float(rng.uniform(0, 2))) * DAY
                ts = ts - (ts - T0) % DAY + float(rng.uniform(0, 5)) * 3600  # at night, 0:00 to 5:00
                b.edge(ts - float(rng.uniform(30, 300)), "account", member, "uses", "device",
                       pool[int(rng.integers(len(pool)))])
                j = targets[int(rng.integers(len(targets)))]
                amount = float(rng.lognormal(math.log(8 * CATEGORY_MEAN[m_cat[j]]), 0.3))
                b.payment(ts, member, m_names[j], amount, False, 1, "ring")
                planted["ring"]["payments"] += 1
        planted["ring"]["instances"] += 1
        planted["ring"]["accounts"] += len(members)
    # card-testing bursts at one merchant
    for _ in range(bursts):
        j = int(rng.integers(merchants))
        start = T0 + float(rng.uniform(1, days - 1)) * DAY
        victims = rng.choice(accounts, size=min(accounts, int(rng.integers(20, 41))), replace=False)
        for v in victims.tolist():
            ts = start + float(rng.uniform(0, 1800))
            b.edge(ts - float(rng.uniform(5, 60)), "account", a_names[v], "uses", "device", new_device())
            b.payment(ts, a_names[v], m_names[j], float(rng.uniform(0.5, 2.0)), False, 1, "burst")
            planted["burst"]["payments"] += 1
        planted["burst"]["instances"] += 1
        planted["burst"]["accounts"] += len(victims)
    # mule chains
    for _ in range(chains):
        day = float(rng.uniform(1, days - 2))
        ts = T0 + day * DAY
        source = a_names[int(rng.integers(accounts))]
        mules = [fresh_account() for _ in range(int(rng.integers(3, 7)))]
        amount = float(rng.uniform(2_000, 9_000))
        prev = source
        for mule in mules:
            ts += float(rng.uniform(600, 4 * 3600))
            b.edge(ts, "account", prev, "sends", "account", mule, [math.log1p(amount)])
            b.edge(ts + float(rng.uniform(30, 300)), "account", mule, "uses", "device", new_device())
            amount *= float(rng.uniform(0.85, 0.97))  # the mule keeps a cut
            prev = mule
        j = int(rng.choice(cash_out))
        parts = int(rng.integers(2, 5))
        for _ in range(parts):
            ts += float(rng.uniform(300, 3600))
            b.payment(ts, prev, m_names[j], amount / parts, False, 1, "chain")
            planted["chain"]["payments"] += 1
        planted["chain"]["instances"] += 1
        planted["chain"]["accounts"] += len(mules)
    out = b.finish()
    out.planted = planted
    return out


def write_stream(stream: PaymentStream, out: Path) -> dict[str, str]:
    """Write ``events.jsonl``, ``labels.csv`` and ``schema.json`` into the directory ``out``; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in ("events.jsonl", "labels.csv", "schema.json")}
    with open(paths["events.jsonl"], "w") as fh:
        for ev in stream.events:
            fh.write(json.dumps(ev, separators=(",", ":")) + "\n")
    times = {ev["txn_id"]: ev["ts"] for ev in stream.events if "txn_id" in ev}
    with open(paths["labels.csv"], "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["txn_id", "ts", "label", "pattern"])
        for txn, (label, pattern) in stream.labels.items():
            w.writerow([txn, times[txn], label, pattern])
    paths["schema.json"].write_text(json.dumps(SCHEMA, indent=2) + "\n")
    return {name: str(path) for name, path in paths.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gnnstream.fraud.payments", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR", help="directory for events.jsonl, labels.csv, schema.json")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed")
    p.add_argument("--accounts", type=whole_number(50), default=5_000, help="legitimate accounts")
    p.add_argument("--merchants", type=whole_number(20), default=400, help="merchants")
    p.add_argument("--days", type=whole_number(3), default=30, help="days of payments")
    p.add_argument("--sessions-per-day", type=finite_number(0.001), default=0.6,
                   help="payment sessions (one or two payments each) per legitimate account and day")
    p.add_argument("--rings", type=whole_number(0), default=12, help="device-sharing rings planted")
    p.add_argument("--bursts", type=whole_number(0), default=6, help="card-testing bursts planted")
    p.add_argument("--chains", type=whole_number(0), default=20, help="mule chains planted")
    args = p.parse_args(argv)
    try:
        stream = generate(args.seed, accounts=args.accounts, merchants=args.merchants, days=args.days,
                          sessions_per_day=args.sessions_per_day, rings=args.rings, bursts=args.bursts,
                          chains=args.chains)
    except ValueError as exc:
        p.error(str(exc))
    files = write_stream(stream, Path(args.out))
    print(json.dumps({**stream.summary(), "files": files}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
