"""The query API's HTTP limits, with raw sockets against ``gnnstream serve``.

* Half-sent requests (headers never finished, a trickle of header bytes, a
  body shorter than its Content-Length) get 408 and are closed; a
  connection that sends nothing is closed; a normal client is answered
  before, during and after.
* Connections beyond ``--max-connections`` get 503 and are closed at once,
  while the open ones (idle ones included) stay and the normal client is
  answered; once the idle ones go, new connections are served again.
* Pipelined, chunked, percent-encoded and ``Expect: 100-continue`` requests
  get the answers their plain forms get; a request the parser refuses gets
  400 and its connection closes.
* Integer ids past 64 bits are the node the stream names by them.
* Every line ``serve`` logs has the worker's format.

No assertion is on time: each close is waited for with a generous deadline,
far above the timeouts the servers run with.
"""

from __future__ import annotations

import http.client
import json
import re
import select
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from gnnstream.stream.events import decode_event_json, encode_event
from tests.workers.reference import fold_jsonl
from tests.support import start_on_ports, GNNSTREAM, Client, answers, wait_for

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


CLOSE_DEADLINE_S = 120.0  # how long a close is waited for; the servers' timeouts are 1 s
# the worker's log format (workers/cli.py): "2025-01-01 12:00:00,123 INFO gnnstream.workers.query.server: ..."
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: .+")


@pytest.fixture(scope="module")
def state(events: list, model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """A stopped state of the first 300 events and its nodes."""
    from gnnstream.workers.offline.jobs import apply_events
    tmp = tmp_path_factory.mktemp("limits")
    jsonl = tmp / "events.jsonl"
    jsonl.write_bytes(b"\n".join(encode_event(ev) for ev in events[:300]) + b"\n")
    apply_events(str(tmp / "state"), model_dir, str(jsonl))
    return str(tmp / "state"), sorted(fold_jsonl(jsonl).nodes)


@contextmanager
def serving(state: str, log: Path, *flags: str) -> Iterator[tuple[int, Client]]:
    """``gnnstream -v serve`` on ``state`` with ``flags``: its port and a client that it has answered."""
    proc, (port,) = start_on_ports(lambda port: [GNNSTREAM, "-v", "serve", "--state", state, "--query-port", port,
                                                 *flags], log)
    client = Client(port)
    try:
        wait_for(lambda: answers(client), 120, "the query API to answer", proc, log)
        yield port, client
        assert proc.poll() is None, log.read_text()[-3000:]
    finally:
        client.close()
        proc.terminate()
        proc.wait(60)
    assert proc.returncode == 0, log.read_text()[-3000:]


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (fails past the deadline)."""
    sock.settimeout(CLOSE_DEADLINE_S)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        pytest.fail(f"the server did not close the connection within {CLOSE_DEADLINE_S} s; it sent {data[:200]!r}")
    except ConnectionResetError:
        pass  # closed while bytes of ours were still unread there (a trickling client): what came before counts
    return data


def _answer(data: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert "connection: close" in [line.lower() for line in lines[1:]], head
    return int(lines[0].split()[1]), json.loads(body)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _trickle(sock: socket.socket, head: bytes) -> None:
    """Send ``head``, then one more byte of an endless header line every 50 ms until the server closes."""
    try:
        sock.sendall(head)
        for _ in range(int(CLOSE_DEADLINE_S / 0.05)):
            sock.sendall(b"a")
            time.sleep(0.05)
    except OSError:
        return  # closed by the server


def test_half_sent_requests_get_408_and_are_closed(state: tuple[str, list[str]], tmp_path: Path) -> None:
    path, nodes = state
    log = tmp_path / "serve.log"
    with serving(path, log, "--header-timeout", "1", "--body-timeout", "1") as (port, client):
        good = client.request("GET", f"/v1/embeddings/{nodes[0]}")
        assert good[0] == 200
        silent = _connect(port)
        half_headers = _connect(port)
        half_headers.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
        short_body = _connect(port)
        short_body.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"events\":")
        # a half-sent second request on a connection that was answered
        answered = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        answered.request("GET", "/v1/health")
        assert answered.getresponse().read()
        second = answered.sock
        second.sendall(b"GET /v1/health HTTP/1.1\r\n")
        trickled_headers, trickled_body = _connect(port), _connect(port)
        threads = [threading.Thread(target=_trickle, args=(trickled_headers, b"GET /v1/health HTTP/1.1\r\nX-Pad: ")),
                   threading.Thread(target=_trickle, args=(trickled_body, b"POST /v1/infer HTTP/1.1\r\nHost: x\r\n"
                                                           b"Content-Length: 100000\r\n\r\n{\"ids\":[\""))]
        for t in threads:
            t.start()
        try:
            assert client.request("GET", f"/v1/embeddings/{nodes[0]}") == good  # answered meanwhile
            assert _until_closed(silent) == b""  # nothing asked, nothing answered
            for sock, what in [(half_headers, "headers"), (short_body, "body"), (trickled_headers, "headers"),
                               (trickled_body, "body"), (second, "headers")]:
                status, body = _answer(_until_closed(sock))
                assert status == 408 and f"the request's {what} did not arrive within 1 s" in body["error"], body
        finally:
            for t in threads:
                t.join()
            for sock in (silent, half_headers, short_body, second, trickled_headers, trickled_body):
                sock.close()
        # the server goes on: the normal client is answered, the closes are counted
        assert client.request("GET", f"/v1/embeddings/{nodes[0]}") == good
        health = client.request("GET", "/v1/health")[1]
        assert health["connections"]["timed_out"] == 6, health
        assert health["connections"]["refused"] == 0, health
    lines = log.read_text().splitlines()
    assert lines and all(LOG_LINE.fullmatch(line) for line in lines), lines[:20]
    assert any(f"INFO gnnstream.workers.query.server: query API on http://127.0.0.1:{port} answers from state {path}" in line
               for line in lines), lines[:20]
    assert sum("gnnstream.workers.query.http: closed the connection of" in line for line in lines) == 6, lines


def test_connections_beyond_the_bound_get_503_while_open_ones_are_served(state: tuple[str, list[str]],
                                                                         tmp_path: Path) -> None:
    path, nodes = state
    limit, extra = 6, 25
    with serving(path, tmp_path / "serve.log", "--max-connections", str(limit),
                 "--header-timeout", "600") as (port, client):
        good = client.request("GET", f"/v1/embeddings/{nodes[1]}")
        assert good[0] == 200
        idle = [_connect(port) for _ in range(limit - 1)]  # with the client's: the bound
        wait_for(lambda: client.request("GET", "/v1/health")[1]["connections"]["open"] == limit, 60,
                 "the idle connections to be accepted")
        over = [_connect(port) for _ in range(extra)]
        try:
            for sock in over:
                status, body = _answer(_until_closed(sock))
                assert status == 503 and f"has {limit} connections open" in body["error"], body
            # the open connections stay: the client is answered, the idle ones hold no answer and are not closed
            assert client.request("GET", f"/v1/embeddings/{nodes[1]}") == good
            readable, _, _ = select.select(idle, [], [], 0)
            assert readable == [], "an idle connection within the bound was answered or closed"
            health = client.request("GET", "/v1/health")[1]
            assert health["connections"] == {"open": limit, "refused": extra, "timed_out": 0}, health
        finally:
            for sock in idle + over:
                sock.close()
        # the idle ones gone, new connections are served
        wait_for(lambda: client.request("GET", "/v1/health")[1]["connections"]["open"] == 1, 60,
                 "the closed connections to be dropped")
        fresh = Client(port)
        try:
            assert fresh.request("GET", f"/v1/embeddings/{nodes[1]}") == good
        finally:
            fresh.close()


def _answers(data: bytes) -> list[tuple[bytes, bytes]]:
    """``(status line, body)`` of every answer in ``data``, in order (bodies by their Content-Length)."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next((int(line.split(b":")[1]) for line in lines[1:] if line.lower().startswith(b"content-length:")),
                      0)
        out.append((lines[0], rest[:length]))
        data = rest[length:]
    return out


def test_http_framing_pipelined_chunked_encoded_and_malformed(state: tuple[str, list[str]], tmp_path: Path) -> None:
    path, nodes = state
    with serving(path, tmp_path / "serve.log") as (port, client):
        plain = {v: client.request("GET", f"/v1/embeddings/{v}") for v in nodes[:3]}
        assert all(status == 200 for status, _ in plain.values())
        asked = {"events": [{"op": "edge_upsert", "src": nodes[0], "dst": nodes[1], "ts": 1}], "ids": nodes[:2]}
        what_if = client.request("POST", "/v1/infer", asked)
        assert what_if[0] == 200
        body = json.dumps(asked).encode()
        # three lookups pipelined in one write, the last one's id percent-encoded, then a close
        requests = b"".join(b"GET /v1/embeddings/%s HTTP/1.1\r\nHost: x\r\n\r\n" % v.encode() for v in nodes[:2])
        encoded = "".join(f"%{c:02X}" for c in nodes[2].encode())
        requests += f"GET /v1/embeddings/{encoded} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        sock = _connect(port)
        sock.sendall(requests)
        got = _answers(_until_closed(sock))
        sock.close()
        assert [line for line, _ in got] == [b"HTTP/1.1 200 OK"] * 3
        assert [json.loads(answer) for _, answer in got] == [plain[v][1] for v in nodes[:3]]
        # a chunked body, and one sent after 100 Continue
        chunked = _connect(port)
        chunked.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                        + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, body[:10], len(body) - 10, body[10:]))
        [(line, answer)] = _answers(_until_closed(chunked))
        chunked.close()
        assert line == b"HTTP/1.1 200 OK" and json.loads(answer) == what_if[1]
        expecting = _connect(port)
        expecting.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n"
                          b"Connection: close\r\n\r\n" % len(body))
        assert expecting.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
        expecting.sendall(body)
        [(line, answer)] = _answers(_until_closed(expecting))
        expecting.close()
        assert line == b"HTTP/1.1 200 OK" and json.loads(answer) == what_if[1]
        # what the parser refuses: 400, and the connection closes
        bad = _connect(port)
        bad.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nContent-Length: -4\r\n\r\n")
        status, answer = _answer(_until_closed(bad))
        bad.close()
        assert status == 400 and answer["error"].startswith("malformed HTTP request"), answer
        # a target or headers past their bounds, sent in pieces: 414 and 431; a body announced over the limit with
        # Expect: 100-continue gets its 413 without the 100
        from gnnstream.workers.query.http import MAX_HEADER_BYTES, MAX_URL_BYTES
        from gnnstream.workers.query.server import MAX_BODY_BYTES
        for head, want in ((b"GET /v1/embeddings/" + b"x" * MAX_URL_BYTES, 414),
                           (b"GET /v1/health HTTP/1.1\r\n" + b"X-Pad: " + b"y" * (2 * MAX_HEADER_BYTES), 431),
                           (b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                            b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1), 413)):
            long = _connect(port)
            for at in range(0, len(head), 4096):
                long.sendall(head[at:at + 4096])
            status, answer = _answer(_until_closed(long))
            long.close()
            assert status == want and answer["error"], (want, answer)
        assert client.request("GET", f"/v1/embeddings/{nodes[0]}") == plain[nodes[0]]


def test_integer_ids_beyond_64_bits_name_the_streams_node(state: tuple[str, list[str]], tmp_path: Path) -> None:
    path, nodes = state
    big = 2 ** 70 + 3
    edge = {"op": "edge_upsert", "src": big, "dst": nodes[2], "ts": 1}
    assert decode_event_json(json.dumps(edge)).src == str(big)  # the stream's name of the node
    with serving(path, tmp_path / "serve.log") as (_, client):
        status, as_int = client.request("POST", "/v1/infer", {"events": [edge], "ids": [big, nodes[2]]})
        assert status == 200, as_int
        status, as_str = client.request("POST", "/v1/infer", {"events": [{**edge, "src": str(big)}],
                                                              "ids": [str(big), nodes[2]]})
        assert status == 200, as_str
        assert sorted(as_int["embeddings"]) == sorted([str(big), nodes[2]])
        assert as_int["embeddings"] == as_str["embeddings"]
        status, body = client.request("POST", "/v1/infer", raw=b'{"events":[],"ids":[' + b"9" * 300 + b"]}")
        assert status == 400 and body["reason"] == "bad_id" and "longer than 256 digits" in body["error"], body
        status, body = client.request("POST", "/v1/infer", raw=b'{"events":[],"ids":[' + b"9" * 5000 + b"]}")
        assert status == 400 and body["reason"] == "bad_id" and "longer than 256 digits" in body["error"], body
