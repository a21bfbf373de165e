"""HTTP/1.1 for the query API: an asyncio protocol over the httptools parser, held to :class:`HttpLimits`.

A request is answered in the parser callback that completes it: the
handler is synchronous (an answer reads the state and computes; it never
waits), so a request makes no task, future or timer, and its answer
leaves in one write. Requests pipelined on a connection are answered in
order; a client that does not read its answers stops being read once they
pass the transport's high-water mark.

Deadlines, from :class:`~gnnstream.workers.query.limits.HttpLimits`:

- from the connection (for its first request) or a later request's first
  byte to the end of the request's headers: ``header_timeout_s``;
- from the end of the headers to the end of the body: ``body_timeout_s``;
- an idle keep-alive connection: :data:`KEEP_ALIVE_S`.

Past either of the first two the client gets 408 with ``{"error": ...}``
and the connection closes; a new connection that sent nothing, or an idle
one, is closed without an answer. Both bound whole requests, not gaps
between bytes, so a client that trickles one byte at a time is closed as
well. One timer per server looks at every connection's deadline a few
times a second (:meth:`HttpServer.tick_s`).

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
"""

from __future__ import annotations

import asyncio
import logging
import socket
from http import HTTPStatus
from typing import Protocol
from urllib.parse import unquote

import httptools
import orjson

from gnnstream.workers.query.limits import HttpLimits

__all__ = ["HttpServer", "Handler", "KEEP_ALIVE_S", "DRAIN_BYTES", "MAX_URL_BYTES", "MAX_HEADER_BYTES"]

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 30.0  # an idle keep-alive connection closes after this
DRAIN_BYTES = 16 << 20  # a body over the limit is read and dropped up to this, so the answer reaches the client
MAX_URL_BYTES = 8 << 10  # a longer request target gets 414 (node ids are far shorter)
MAX_HEADER_BYTES = 1 << 20  # bytes read while a request's headers are incomplete; more gets 431
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_HEADS = {s.value: b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: "
          % (s.value, s.phrase.encode()) for s in HTTPStatus}


class Handler(Protocol):
    """What :class:`HttpServer` serves: the answer to each request, and where connections are counted."""

    max_body: int  # largest request body passed on; a larger one is passed as None
    open: int  # connections open now (refused ones until they are closed)
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
    """Serves ``handler`` on a listening socket under ``limits`` (:meth:`start`, then :meth:`close`)."""

    def __init__(self, handler: Handler, limits: HttpLimits = HttpLimits()):
        self.handler = handler
        self.limits = limits
        self.connections: set[_Connection] = set()
        self.busy = _error(503, f"the query API has {limits.max_connections} connections open; retry shortly")
        self.late = {"headers": _error(408, f"the request's headers did not arrive within "
                                            f"{limits.header_timeout_s:g} s"),
                     "body": _error(408, f"the request's body did not arrive within {limits.body_timeout_s:g} s "
                                         f"of its headers (fewer bytes than its Content-Length?)")}
        self._server: asyncio.AbstractServer | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def tick_s(self) -> float:
        """How often the deadlines are looked at: a quarter of the shortest timeout, at most 0.25 s."""
        return min(0.25, self.limits.header_timeout_s / 4, self.limits.body_timeout_s / 4)

    async def start(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=sock)
        self._timer = loop.call_later(self.tick_s, self._sweep)

    async def close(self) -> None:
        """Stop listening and close every connection (no request is ever half answered)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in [c for c in self.connections if c.deadline <= now]:
            conn.expired()
        self._timer = loop.call_later(self.tick_s, self._sweep)


class _Connection(asyncio.Protocol):
    """One client connection: its parser, the request being read and its deadline."""

    transport: asyncio.Transport

    def __init__(self, server: HttpServer):
        self.server = server
        self.handler = server.handler
        self.limits = server.limits
        self.parser = httptools.HttpRequestParser(self)
        self.phase = "connected"  # then per request "headers", "body", and "idle" once answered
        self.deadline = float("inf")
        self.closed = False
        self._url = b""
        self._body: list[bytes] = []
        self._size = self._length = 0
        self._continue = False

    # ---------------------------------------------------------------- the connection
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()
        handler = self.handler
        handler.open += 1
        self.server.connections.add(self)
        if handler.open > self.limits.max_connections:
            handler.refused += 1
            self._close(self.server.busy)
            return
        self.deadline = self.loop.time() + self.limits.header_timeout_s

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.handler.open -= 1
        self.server.connections.discard(self)

    def data_received(self, data: bytes) -> None:
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

    def pause_writing(self) -> None:  # the client does not read its answers: stop reading its requests
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        if not self.closed:
            self.transport.resume_reading()

    def expired(self) -> None:
        """Past the deadline: an answer to a half-sent request, then the connection closes."""
        if self.closed:
            return
        if self.phase == "idle":
            self._close(b"")
            return
        self.handler.timed_out += 1
        client = self.transport.get_extra_info("peername")
        logger.info("closed the connection of %s: %s", "%s:%d" % client[:2] if client else "a client",
                    {"connected": "no request", "headers": "headers too slow", "body": "body too slow"}[self.phase])
        self._close(self.server.late.get(self.phase, b""))

    def _close(self, last: bytes) -> None:
        self.closed = True
        self.deadline = float("inf")
        if last:
            self.transport.write(last)
        self.transport.close()

    # ---------------------------------------------------------------- the parser's callbacks
    def on_message_begin(self) -> None:
        if self.closed:
            return
        if self.phase != "connected":  # a new connection's first request counts from the connection
            self.deadline = self.loop.time() + self.limits.header_timeout_s
        self.phase = "headers"
        self._url: list[bytes] = []
        self._url_size = self._header_size = 0
        self._body = []
        self._size = self._length = 0
        self._continue = False

    def on_url(self, url: bytes) -> None:
        self._url_size += len(url)
        if self._url_size > MAX_URL_BYTES:
            if not self.closed:
                self._close(_error(414, f"the request target is over {MAX_URL_BYTES} bytes"))
            return
        self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._continue = True
        elif name == b"content-length" and value.strip().isdigit():
            self._length = int(value)

    def on_headers_complete(self) -> None:
        self.phase = "body"
        self.deadline = self.loop.time() + self.limits.body_timeout_s
        if self._continue and not self.closed:
            if self._length > self.handler.max_body:
                self._size = self._length  # the handler is told of a body over the limit
                self._answer(close=True)
                return
            self.transport.write(_CONTINUE)

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
        method = self.parser.get_method().decode("ascii", "replace")
        path = b"".join(self._url).partition(b"?")[0].decode("utf-8", "replace")
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
        self.transport.write(answer)
        self.phase = "idle"
        self.deadline = self.loop.time() + KEEP_ALIVE_S

