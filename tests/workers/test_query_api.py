"""The query API over HTTP: beside a streaming worker, and under hostile requests.

* With the broker: ``gnnstream run --query-port`` streams Bitcoin OTC; once
  the view reports the produced offsets and no dirty marks, every node's
  lookup equals the independent PyG reference on the folded events, and a
  what-if with the next held-out payment equals the reference on the graph
  with that payment added; after the payment really streams in, lookups
  equal the what-if. Stopping the worker stops the query process too.
* Without it: ``gnnstream serve`` on a stopped state answers 1,000
  malformed or hostile requests with a 4xx and a reason while slow clients
  hold connections open, keeps serving, and the state is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.broker import EmbeddedBroker, free_port
from gnnstream.stream.events import EdgeUpsert, encode_event
from gnnstream.stream.kafka import ensure_topics
from tests.workers.reference import GraphFold, assert_embeddings_close, fold_jsonl, reference_embeddings
from tests.support import (GNNSTREAM, JOIN_TIMEOUT_S, PARTITIONS, Client, Names, answers, event_messages, health,
                           produce, start_on_ports, stop_worker, wait_for, worker_cmd)
from gnnstream.graph_state.page_log import PageLog

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HELD_OUT = 2_500  # events streamed before the what-if; the rest stream after it


def _fold(evs: list) -> GraphFold:
    fold = GraphFold()
    for ev in evs:
        fold.apply_event(ev)
    return fold


def _view_at(client: Client, offsets: int) -> bool:
    """The view reflects ``offsets`` consumed events, all recomputed."""
    status, body = client.request("GET", "/v1/health")
    return status == 200 and sum(body["offsets"].values()) >= offsets and body["dirty"] == 0


@pytest.mark.broker
def test_lookups_and_what_if_beside_the_streaming_worker(broker: EmbeddedBroker, events: list, model_dir: str,
                                                         tmp_path: Path) -> None:
    n = Names(tmp_path)
    ensure_topics(broker.bootstrap, {n.events: PARTITIONS, n.output: PARTITIONS, n.dlq: 1})
    first, rest = events[:HELD_OUT], events[HELD_OUT:]
    # the next payment between two known users not linked yet, one of them with few neighbours: it enters
    # that one's samples, so the what-if must differ from the lookups
    known = _fold(first)
    degree: dict[str, set[str]] = {}
    for s, d in known.edges:
        degree.setdefault(s, set()).add(d)
        degree.setdefault(d, set()).add(s)
    payment = next(ev for ev in rest if isinstance(ev, EdgeUpsert) and ev.src in degree and ev.dst in degree
                   and ev.dst not in degree[ev.src] and min(len(degree[ev.src]), len(degree[ev.dst])) < 5)
    produce(broker.bootstrap, n.events, event_messages(first))
    log = tmp_path / "worker.log"
    proc, (port, query_port) = start_on_ports(
        lambda port, query_port: worker_cmd(broker.bootstrap, n, model_dir, port, "--query-port", str(query_port)),
        log, ports=2)
    try:
        wait_for(lambda: (h := health(port)) and h["applied"] >= len(first), JOIN_TIMEOUT_S,
                 f"{len(first)} applied events", proc, log)
        client = Client(query_port)
        wait_for(lambda: _view_at(client, len(first)), JOIN_TIMEOUT_S, "the query view to catch up", proc, log)
        fold = _fold(first)
        want = reference_embeddings(fold.nodes, fold.edges, fold.features, model_dir)
        got = {}
        for v in sorted(fold.nodes):
            status, body = client.request("GET", f"/v1/embeddings/{v}")
            assert status == 200, (v, body)
            assert body["id"] == v and body["version"] >= 1 and body["mode"] in ("full", "cold_start")
            got[v] = body["embedding"]
        assert_embeddings_close(got, want, what="lookups beside the worker")
        status, body = client.request("GET", f"/v1/nodes/{payment.src}/sample")
        assert status == 200 and [layer["fanout"] for layer in body["layers"]] == [10, 5]

        # what-if: the next payment, before it reaches Kafka
        ids = [payment.src, payment.dst]
        status, body = client.request("POST", "/v1/infer",
                                      raw=b'{"events":[' + encode_event(payment) + b'],"ids":' +
                                      json.dumps(ids).encode() + b"}")
        assert status == 200, body
        after = _fold(first + [payment])
        want_after = reference_embeddings(after.nodes, after.edges, after.features, model_dir)
        assert_embeddings_close(body["embeddings"], {v: want_after[v] for v in ids}, what="what-if")
        what_if = body["embeddings"]
        assert any(v not in got or np.abs(np.subtract(what_if[v], got[v])).max() > 1e-6 for v in ids), \
            "the payment changes nothing: pick another one"
        # the state did not change: the lookups are still the old ones
        for v in ids:
            if v in got:
                assert client.request("GET", f"/v1/embeddings/{v}")[1]["embedding"] == got[v]

        # the payment (alone) streams in: lookups become what the what-if said
        produce(broker.bootstrap, n.events, event_messages([payment]))
        wait_for(lambda: _view_at(client, len(first) + 1), JOIN_TIMEOUT_S, "the payment to be applied", proc, log)
        for v in ids:
            status, body = client.request("GET", f"/v1/embeddings/{v}")
            np.testing.assert_allclose(body["embedding"], what_if[v], rtol=0, atol=1e-4)
        client.close()

        # the query process dies: the worker streams on and says so once
        server = _server_pid(n.state)
        cmd = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
        scratch = Path(cmd[cmd.index(b"--scratch") + 1].decode())
        assert scratch.is_dir()
        os.kill(server, signal.SIGKILL)
        produce(broker.bootstrap, n.events, event_messages(rest[:400]))
        wait_for(lambda: (h := health(port)) and h["applied"] >= len(first) + 401, JOIN_TIMEOUT_S,
                 "the worker to go on without its query process", proc, log)
        stop_worker(proc, log)
        assert log.read_text().count("the query API process exited (code -9)") == 1, log.read_text()[-2000:]
        assert not scratch.exists()  # the killed server's files went with the worker
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the query process left with the worker
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", query_port), timeout=2).close()


def _server_pid(state: str) -> int:
    """The query server process serving ``state``."""
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gnnstream.workers.query.server" in cmd and state.encode() in cmd:
            return int(entry.name)
    raise AssertionError(f"no query server for {state}")


# ---------------------------------------------------------------------- hostile requests
def _page_log_hash(state: str) -> str:
    digest = hashlib.sha256()
    with GraphStore(state) as store:
        for iid, meta, row in PageLog(store).items():
            digest.update(f"{iid}:{meta.version}:{meta.mode}:".encode())
            if row is not None:
                digest.update(row.tobytes())
        for key, value in store.column("nbrs").items():
            digest.update(key + value)
    return digest.hexdigest()


def _hostile(rng: random.Random, nodes: list[str]) -> tuple[str, str, bytes | None, int]:
    """One bad request: ``(method, path, body, expected status)``."""
    node = rng.choice(nodes)
    edge = {"op": "edge_upsert", "src": node, "dst": "x", "ts": 1}
    kind = rng.randrange(12)
    if kind == 0:
        return "POST", "/v1/infer", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), 400
    if kind == 1:
        return "POST", "/v1/infer", b"[" * ((1 << 20) + 1), 413
    if kind == 2:
        return "GET", f"/v1/embeddings/never-{rng.randrange(10**9)}", None, 404
    if kind == 3:
        return "POST", "/v1/infer", json.dumps({"events": [edge], "ids": [f"never-{rng.random()}"]}).encode(), 404
    if kind == 4:
        feats = [1.0] * rng.choice([1, 7, 9, 100])
        return "POST", "/v1/infer", json.dumps({"events": [{"op": "node_upsert", "id": node, "ts": 1,
                                                            "features": feats}], "ids": [node]}).encode(), 400
    if kind == 5:
        many = [{"op": "edge_upsert", "src": node, "dst": f"m{i}", "ts": 1} for i in range(10_000)]
        return "POST", "/v1/infer", json.dumps({"events": many, "ids": [node]}).encode(), 413
    if kind == 6:
        body = rng.choice([[], "x", {"events": "no", "ids": [node]}, {"ids": []}, {"events": [], "ids": [None]},
                           {"events": [edge], "ids": [node], "more": 1}])
        return "POST", "/v1/infer", json.dumps(body).encode(), 400
    if kind == 7:
        bad = rng.choice([{"op": "edge_upsert", "src": node, "ts": 1}, {"op": "drop_table", "id": node, "ts": 1},
                          {"op": "edge_upsert", "src": node, "dst": "", "ts": 1},
                          {"op": "edge_upsert", "src": node, "dst": "y", "ts": -5}])
        return "POST", "/v1/infer", json.dumps({"events": [edge, bad], "ids": [node]}).encode(), 400
    if kind == 8:
        return "POST", "/v1/infer", b'{"events":[{"op":"edge_upsert","src":"a","dst":"b","ts":NaN}],"ids":["a"]}', 400
    if kind == 9:
        return rng.choice(["PUT", "DELETE", "POST"]), f"/v1/embeddings/{node}", None, 405
    if kind == 10:
        return "GET", rng.choice(["/", "/v2/embeddings/a", "/v1/nodes/a", "/admin", "/v1/infer/../x"]), None, 404
    return "GET", "/v1/embeddings/" + "z" * rng.randrange(300, 4000), None, 404


def test_hostile_requests_get_4xx_and_change_nothing(events: list, model_dir: str, tmp_path: Path) -> None:
    from gnnstream.workers.offline.jobs import apply_events
    jsonl = tmp_path / "events.jsonl"
    jsonl.write_bytes(b"\n".join(encode_event(ev) for ev in events[:1500]) + b"\n")
    state = str(tmp_path / "state")
    apply_events(state, model_dir, str(jsonl))
    nodes = sorted(fold_jsonl(jsonl).nodes)
    before = _page_log_hash(state)
    log = tmp_path / "serve.log"
    # the slow clients trickle for as long as the test runs: their bodies' deadline is beyond it
    proc, (port,) = start_on_ports(lambda port: [GNNSTREAM, "serve", "--state", state, "--query-port", port,
                                                 "--body-timeout", "3600"], log)
    slow: list[socket.socket] = []
    try:
        client = Client(port)
        wait_for(lambda: answers(client), 120, "the query API to answer", proc, log)
        good = {v: client.request("GET", f"/v1/embeddings/{v}")[1]["embedding"] for v in nodes[:50]}
        # slow clients: a request started and never finished, one byte at a time
        for i in range(20):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{\"ev")
            slow.append(s)
        rng = random.Random(7)
        statuses: dict[int, int] = {}
        for i in range(980):
            method, path, body, want = _hostile(rng, nodes)
            status, answer = client.request(method, path, raw=body)
            assert status == want, (method, path[:80], (body or b"")[:80], status, answer)
            assert isinstance(answer, dict) and answer.get("error") and "close" not in answer, answer
            statuses[status] = statuses.get(status, 0) + 1
            if i % 50 == 0:  # the slow clients trickle on; good requests are still answered meanwhile
                for s in slow:
                    s.sendall(b"x")
                v = nodes[i % 50]
                assert client.request("GET", f"/v1/embeddings/{v}")[1]["embedding"] == good[v]
        assert set(statuses) == {400, 404, 405, 413}, statuses
        trickled = 4 + sum(1 for i in range(980) if i % 50 == 0)  # body bytes each slow client has sent
        for s in slow:  # the slow requests end as bad JSON: 400 each
            s.sendall(b"}" + b" " * (5000 - trickled - 1))
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
        assert proc.poll() is None
        for v, row in good.items():
            assert client.request("GET", f"/v1/embeddings/{v}")[1]["embedding"] == row
        client.close()
    finally:
        for s in slow:
            s.close()
        proc.terminate()
        proc.wait(30)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert _page_log_hash(state) == before


def test_serve_refuses_with_one_line(tmp_path: Path) -> None:
    """A port in use, no port, no state: exit 2 and one line naming what to do; nothing is created (the last
    in a process of its own: the server has started before it finds no state)."""
    from tests.workers.reference import call_gnnstream, run_gnnstream
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        res = call_gnnstream("serve", "--state", str(tmp_path / "none"), "--query-port", port)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == (f"gnnstream: error: query API cannot listen on 127.0.0.1:{port}: Address already in "
                                  f"use; stop what uses that port or choose another --query-port")
    res = call_gnnstream("serve", "--state", str(tmp_path / "none"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "gnnstream: error: serve needs a port: pass --query-port PORT or set GNNSTREAM_QUERY_PORT"]
    res = run_gnnstream("serve", "--state", str(tmp_path / "none"), "--query-port", free_port())
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"gnnstream: error: no graph store at {str(tmp_path / 'none')!r} (start the worker on it first)"]
    assert not (tmp_path / "none").exists()


# a worker's side of the query process, run with the working directory first on sys.path (``python -c``)
_PARENT = """
import logging, sys, time
from gnnstream.workers.settings import configure_logging
from gnnstream.workers.query.limits import HttpLimits
from gnnstream.workers.query.server import QueryProcess
configure_logging(logging.INFO)
proc = QueryProcess(sys.argv[1], "model", "127.0.0.1", 0, HttpLimits(header_timeout_s=0.5))
print(proc.port, proc._scratch, proc._child.pid, flush=True)
time.sleep(600)
"""


def test_query_process_beside_a_model_folder_and_after_its_worker_is_killed(events: list, model_dir: str,
                                                                              tmp_path: Path) -> None:
    """Run where ``model/`` is the model directory (a name users pick) beside ``stream/`` and ``workers/``
    packages of someone else's, the query process imports ours (``gnnstream.*``) and answers, under the limits
    and at the logging level its worker gives it, in the worker's log format; when its worker is killed with
    SIGKILL it exits and removes its files."""
    import shutil
    import sys
    from gnnstream.workers.offline.jobs import apply_events
    jsonl = tmp_path / "events.jsonl"
    jsonl.write_bytes(b"\n".join(encode_event(ev) for ev in events[:300]) + b"\n")
    state = str(tmp_path / "state")
    apply_events(state, model_dir, str(jsonl))
    cwd = tmp_path / "cwd"
    shutil.copytree(model_dir, cwd / "model")
    for name in ("stream", "workers"):  # packages named like ours, first on sys.path
        (cwd / name).mkdir()
        (cwd / name / "__init__.py").write_text("raise ImportError('not ours')\n")
    log = tmp_path / "parent.log"
    with open(log, "wb") as fh:
        parent = subprocess.Popen([sys.executable, "-c", _PARENT, state], cwd=cwd, stdout=subprocess.PIPE, stderr=fh)
    try:
        port, scratch, child = parent.stdout.readline().decode().split()
        scratch = Path(scratch)
        assert scratch.is_dir()
        client = Client(int(port))

        def answered() -> bool:
            if not _running(int(child)):
                pytest.fail(f"the query process exited:\n{log.read_text()[-3000:]}")
            return answers(client)

        wait_for(answered, 120, "the query API to answer", parent, log)
        node = sorted(fold_jsonl(jsonl).nodes)[0]
        status, body = client.request("GET", f"/v1/embeddings/{node}")
        assert status == 200 and body["id"] == node and len(body["embedding"]) == 8, body
        with socket.create_connection(("127.0.0.1", int(port)), timeout=120) as half:  # the worker's limits
            half.sendall(b"GET /v1/health HTTP/1.1\r\n")
            reply = b""
            while chunk := half.recv(4096):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"within 0.5 s" in reply, reply
        client.close()
        logged = log.read_text().splitlines()
        # the worker's format (workers/cli.py), the server's INFO lines included
        assert any(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO gnnstream\.workers\.query\.server: query API on "
                                f"http://127\\.0\\.0\\.1:{port} answers from state .+", line) for line in logged), "\n".join(logged)
        parent.kill()
        parent.wait()
        wait_for(lambda: not scratch.exists(), 60, "the query process to remove its files")
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    finally:
        parent.kill()
        parent.wait()


def _running(pid: int) -> bool:
    """Whether process ``pid`` is alive (not gone, not a zombie its parent has not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"
