"""HTTP/1.1 for the query API: one epoll loop over non-blocking sockets and the httptools parser, held to
:class:`HttpLimits`.

A request is answered in the parser callback that completes it: the
handler is synchronous (an answer reads the state and computes; it never
waits), so a request costs one ``recv``, the parse and one ``send`` on a
loop with nothing else to schedule. Requests pipelined on a connection
are answered in order; while an answer waits for the client to read it
(the socket's send buffer is full), the connection is not read.

Deadlines, from :class:`~gnnstream.workers.query.limits.HttpLimits`:

- from the connection (for its first request) or a later request's first
  byte to the end of the request's headers: ``header_timeout_s``;
- from the end of the headers to the end of the body: ``body_timeout_s``;
- an idle keep-alive connection: :data:`KEEP_ALIVE_S`.

Past either of the first two the client gets 408 with ``{"error": ...}``
and the connection closes; a new connection that sent nothing, or an idle
one, is closed without an answer. Both bound whole requests, not gaps
between bytes, so a client that trickles one byte at a time is closed as
well. The loop looks at every connection's deadline a few times a second
(:attr:`HttpServer.tick_s`).

A connection opened while ``max_connections`` are open gets 503 at once
and is closed before anything of it is read; the open ones are served on.
A body over the handler's ``max_body`` is read and dropped up to
:data:`DRAIN_BYTES` (so that the client reads the answer), and the handler
is called with ``body=None``; past :data:`DRAIN_BYTES` that answer goes at
once and the connection closes. A request the parser refuses gets 400 and
the connection closes; so does a request whose URL is over
:data:`MAX_URL_BYTES` (414) or whose headers are still incomplete
after :data:`MAX_HEADER_BYTES` read (431). A request announcing a body over
``max_body`` with ``Expect: 100-continue`` gets its 413 instead of the
``100 Continue``.

The loop also runs the callers' own work between requests: a callback
when a descriptor is readable (:meth:`HttpServer.add_reader`) and one
every few seconds (:meth:`HttpServer.every`).
"""

from __future__ import annotations

import logging
import select
import socket
from http import HTTPStatus
from time import monotonic
from typing import Callable, Protocol
from urllib.parse import unquote

import httptools
import orjson

from gnnstream.workers.query.limits import HttpLimits

__all__ = ["HttpServer", "Handler", "KEEP_ALIVE_S", "DRAIN_BYTES", "MAX_URL_BYTES", "MAX_HEADER_BYTES"]

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 30.0  # an idle keep-alive connection closes after this
LINGER_S = 2.0  # after its last answer, how long a closing connection's input is still read (and dropped)
DRAIN_BYTES = 16 << 20  # a body over the limit is read and dropped up to this, so the answer reaches the client
MAX_URL_BYTES = 8 << 10  # a longer request target gets 414 (node ids are far shorter)
MAX_HEADER_BYTES = 1 << 20  # bytes read while a request's headers are incomplete; more gets 431
_READ_BYTES = 1 << 16  # bytes asked of one recv
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_HEADS = {s.value: b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: "
          % (s.value, s.phrase.encode()) for s in HTTPStatus}
_METHODS = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS")}
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT


class Handler(Protocol):
    """What :class:`HttpServer` serves: the answer to each request, and where connections are counted."""

    max_body: int  # largest request body passed on; a larger one is passed as None
    open: int  # connections open now (a refused or closing one until its last answer is sent)
    refused: int  # connections closed at once with 503: max_connections were open
    timed_out: int  # connections closed because a request's headers or body did not arrive in time

    def __call__(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        """``(status, JSON body)`` of a request; ``path`` is percent-decoded, without its query string."""


def response(status: int, payload: bytes, close: bool = False) -> bytes:
    """A whole HTTP/1.1 response with a JSON body (and ``connection: close`` when ``close``)."""
    head = _HEADS.get(status) or b"HTTP/1.1 %d \r\ncontent-type: application/json\r\ncontent-length: " % status
    return b"%s%d\r\n%s\r\n%s" % (head, len(payload), b"connection: close\r\n" if close else b"", payload)


def _error(status: int, message: str) -> bytes:
    return response(status, orjson.dumps({"error": message}), close=True)


class HttpServer:
    """Serves ``handler`` on a listening socket under ``limits``: :meth:`serve` until :meth:`stop`."""

    def __init__(self, handler: Handler, limits: HttpLimits = HttpLimits()):
        self.handler = handler
        self.limits = limits
        self.connections: dict[int, _Connection] = {}  # by file descriptor
        self.busy = _error(503, f"the query API has {limits.max_connections} connections open; retry shortly")
        self.late = {"headers": _error(408, f"the request's headers did not arrive within "
                                            f"{limits.header_timeout_s:g} s"),
                     "body": _error(408, f"the request's body did not arrive within {limits.body_timeout_s:g} s "
                                         f"of its headers (fewer bytes than its Content-Length?)")}
        self.poll = select.epoll()
        self._readers: dict[int, Callable[[], None]] = {}
        self._every: list[tuple[float, Callable[[], None]]] = []
        self._stopped = False

    @property
    def tick_s(self) -> float:
        """How often the deadlines are looked at: a quarter of the shortest timeout, at most 0.25 s."""
        return min(0.25, self.limits.header_timeout_s / 4, self.limits.body_timeout_s / 4)

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` (between requests) whenever ``fd`` is readable."""
        self._readers[fd] = callback
        self.poll.register(fd, _IN)

    def remove_reader(self, fd: int) -> None:
        del self._readers[fd]
        self.poll.unregister(fd)

    def every(self, seconds: float, callback: Callable[[], None]) -> None:
        """Call ``callback`` (between requests) every ``seconds``."""
        self._every.append((seconds, callback))

    def stop(self) -> None:
        """End :meth:`serve` (safe from a signal handler: the loop sees it within :attr:`tick_s`)."""
        self._stopped = True

    def serve(self, sock: socket.socket) -> None:
        """Serve on ``sock`` until :meth:`stop`; then close it and every connection."""
        sock.setblocking(False)
        listening = sock.fileno()
        poll, connections, readers = self.poll, self.connections, self._readers
        poll.register(listening, _IN)
        tick = self.tick_s
        now = monotonic()
        sweep_at = now + tick
        due = [now + seconds for seconds, _ in self._every]
        try:
            while not self._stopped:
                wake = min((sweep_at, *due))
                for fd, events in poll.poll(max(0.0, wake - monotonic())):
                    conn = connections.get(fd)
                    if conn is not None:
                        if events & _OUT:
                            conn.writable()
                        else:
                            conn.readable()
                    elif fd == listening:
                        self._accept(sock)
                    elif fd in readers:
                        _run(readers[fd])
                now = monotonic()
                if now >= sweep_at:
                    for conn in [c for c in connections.values() if c.deadline <= now]:
                        conn.expired()
                    sweep_at = now + tick
                for i, (seconds, callback) in enumerate(self._every):
                    if now >= due[i]:
                        _run(callback)
                        due[i] = monotonic() + seconds
        finally:
            poll.unregister(listening)
            sock.close()
            for conn in list(connections.values()):
                conn.lost()
            for fd in list(readers):
                self.remove_reader(fd)
            poll.close()

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                client, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, a connection reset before it was accepted: serve on
                logger.warning("could not accept a connection: %s", exc)
                return
            client.setblocking(False)
            _Connection(self, client)


def _run(callback: Callable[[], None]) -> None:
    """A caller's callback: an error is logged, and the loop serves on."""
    try:
        callback()
    except Exception:
        logger.exception("callback %r failed", callback)


class _Connection:
    """One client connection: its socket, its parser, the request being read, its deadline and its unsent
    answers."""

    def __init__(self, server: HttpServer, sock: socket.socket):
        self.server = server
        self.handler = handler = server.handler
        self.limits = server.limits
        self.sock = sock
        self.fd = sock.fileno()
        self.parser = httptools.HttpRequestParser(self)
        self.phase = "connected"  # then per request "headers", "body", and "idle" once answered
        self.deadline = float("inf")
        self.closed = False  # no more requests are read; the socket closes once the answers left
        self.lingering = False  # every answer sent, the input read and dropped until the socket closes
        self._out = b""  # answers the socket did not take yet
        self._url = b""
        self._body: list[bytes] = []
        self._size = self._length = self._header_size = 0
        self._continue = False
        handler.open += 1
        server.connections[self.fd] = self
        server.poll.register(self.fd, _IN)
        if handler.open > self.limits.max_connections:
            handler.refused += 1
            self._close(server.busy)
            return
        self.deadline = monotonic() + self.limits.header_timeout_s

    # ---------------------------------------------------------------- the socket
    def readable(self) -> None:
        try:
            data = self.sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.lost()
            return
        if self.closed:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._close(b"" if self.phase == "idle" else _error(400, "protocol upgrades are not served"))
        except httptools.HttpParserError as exc:
            if not self.closed:
                self._close(_error(400, f"malformed HTTP request: {exc}"))
            return
        if self.phase == "headers" and not self.closed:  # the parser holds a header line until it ends
            self._header_size += len(data)  # (all of a read a request's headers began in: an upper bound)
            if self._header_size > MAX_HEADER_BYTES:
                self._close(_error(431, f"the request's headers went on past {MAX_HEADER_BYTES} bytes"))

    def writable(self) -> None:
        """The socket takes bytes again: send what waits; once all left, read again (or close)."""
        try:
            sent = self.sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.lost()
            return
        self._out = self._out[sent:]
        if self._out:
            return
        if self.closed:
            self._linger()
        else:
            self.server.poll.modify(self.fd, _IN)

    def _send(self, data: bytes) -> None:
        if self._out:  # answers wait already: after them
            self._out += data
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # the client went: what it did not read is dropped
            return
        if sent < len(data):
            self._out = data[sent:]
            self.server.poll.modify(self.fd, _OUT)  # not read until the client took its answers

    def lost(self) -> None:
        """The connection is gone (or is closed now): forget it."""
        if self.fd < 0:
            return
        self.closed = True
        self.deadline = float("inf")
        if not self.lingering:
            self.handler.open -= 1
        del self.server.connections[self.fd]
        self.server.poll.unregister(self.fd)
        self.sock.close()
        self.fd = -1

    def expired(self) -> None:
        """Past the deadline: an answer to a half-sent request, then the connection closes (a lingering one
        closes now)."""
        if self.closed:
            self.lost()
            return
        if self.phase == "idle":
            self._close(b"")
            return
        self.handler.timed_out += 1
        try:
            client = self.sock.getpeername()
        except OSError:
            client = None
        logger.info("closed the connection of %s: %s", "%s:%d" % client[:2] if client else "a client",
                    {"connected": "no request", "headers": "headers too slow", "body": "body too slow"}[self.phase])
        self._close(self.server.late.get(self.phase, b""))

    def _close(self, last: bytes) -> None:
        """Read nothing more; send ``last`` after the answers waiting, then close."""
        self.closed = True
        self.deadline = float("inf")
        if last:
            self._send(last)
        if not self._out:
            self._linger()

    def _linger(self) -> None:
        """Every answer sent on a closing connection: end the writing side, and read (dropping it) what the
        client still sends until it closes or :data:`LINGER_S` passes. Closing with its bytes unread would reset
        the connection, and a client still sending a refused request would see the reset, not the answer."""
        if self.fd < 0:
            return
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.lost()
            return
        self.deadline = monotonic() + LINGER_S
        self.server.poll.modify(self.fd, _IN)
        self.lingering = True  # answered and closing: no longer counted as open
        self.handler.open -= 1

    # ---------------------------------------------------------------- the parser's callbacks
    def on_message_begin(self) -> None:
        if self.closed:
            return
        if self.phase != "connected":  # a new connection's first request counts from the connection
            self.deadline = monotonic() + self.limits.header_timeout_s
        self.phase = "headers"
        self._url = b""
        self._header_size = 0
        self._body = []
        self._size = self._length = 0
        self._continue = False

    def on_url(self, url: bytes) -> None:
        if len(self._url) + len(url) > MAX_URL_BYTES:
            if not self.closed:
                self._close(_error(414, f"the request target is over {MAX_URL_BYTES} bytes"))
            return
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._continue = True
        elif name == b"content-length" and value.strip().isdigit():
            self._length = int(value)

    def on_headers_complete(self) -> None:
        self.phase = "body"
        self.deadline = monotonic() + self.limits.body_timeout_s
        if self._continue and not self.closed:
            if self._length > self.handler.max_body:
                self._size = self._length  # the handler is told of a body over the limit
                self._answer(close=True)
                return
            self._send(_CONTINUE)

    def on_body(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size <= self.handler.max_body:
            self._body.append(chunk)
        elif self._size > DRAIN_BYTES and not self.closed:
            self._answer(close=True)  # too much to read and drop: the answer now, and the connection closes

    def on_message_complete(self) -> None:
        if not self.closed:
            self._answer(close=not self.parser.should_keep_alive())

    def _answer(self, close: bool) -> None:
        raw = self.parser.get_method()
        method = _METHODS.get(raw) or raw.decode("ascii", "replace")
        path = self._url.partition(b"?")[0].decode("utf-8", "replace")
        if "%" in path:
            path = unquote(path)
        body = b"".join(self._body) if self._size <= self.handler.max_body else None
        status, payload = self.handler(method, path, body)
        self._body = []
        answer = response(status, payload, close)
        if method == "HEAD":
            answer = answer[:len(answer) - len(payload)]
        if close:
            self._close(answer)
            return
        self._send(answer)
        self.phase = "idle"
        self.deadline = monotonic() + KEEP_ALIVE_S
