"""What the clients of the query API may hold: read timeouts and a bound on connections.

uvicorn bounds idle keep-alive connections but not a request in flight:
a client that sends half its headers, or a body shorter than its
``Content-Length``, would hold its connection (and, at shutdown, the
server) for ever. :func:`limited_protocol` is uvicorn's httptools
protocol with one timer per connection:

- from the connection (for its first request) or a later request's first
  byte to the end of the request's headers: ``header_timeout_s``;
- from the end of the headers to the end of the body: ``body_timeout_s``.

Past either, the client gets ``408`` with ``{"error": ...}`` and the
connection closes; a new connection that sent nothing is closed without an
answer. Both are whole-request bounds, not gaps between bytes, so a client
that trickles one byte at a time is closed as well.

A connection opened while ``max_connections`` are open gets ``503`` at once
and is closed, before anything of it is read; the open ones are served on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

import orjson

from gnnstream.workers.settings import finite_number, whole_number

__all__ = ["HttpLimits", "limited_protocol", "add_arguments", "from_args"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpLimits:
    """What the clients of the query server may hold.

    Attributes:
        header_timeout_s: a request's line and headers must arrive within this many seconds of its first byte
            (a new connection's first request: of the connection); else the client gets 408 and the
            connection closes. A new connection that sends nothing in that time is closed.
        body_timeout_s: a request's body must arrive within this many seconds of the end of its headers; else
            408 and the connection closes.
        max_connections: connections open at once; one more gets 503 and is closed at once.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 256

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"HttpLimits.{name} must be a finite number of seconds > 0 (got {value!r})")
        if self.max_connections < 1:
            raise ValueError(f"HttpLimits.max_connections must be >= 1 (got {self.max_connections!r})")

    def argv(self) -> list[str]:
        """These limits as the flags of :func:`add_arguments`."""
        return ["--header-timeout", repr(self.header_timeout_s), "--body-timeout", repr(self.body_timeout_s),
                "--max-connections", str(self.max_connections)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of :class:`HttpLimits` (``--header-timeout``, ``--body-timeout``, ``--max-connections``)."""
    default = HttpLimits()
    parser.add_argument("--header-timeout", type=finite_number(0.01), default=default.header_timeout_s,
                        metavar="SECONDS", help="a request's headers must arrive within this many seconds, else "
                                                f"408 and the connection closes (default {default.header_timeout_s:g})")
    parser.add_argument("--body-timeout", type=finite_number(0.01), default=default.body_timeout_s,
                        metavar="SECONDS", help="a request's body must arrive within this many seconds of its "
                                                f"headers, else 408 and the connection closes (default "
                                                f"{default.body_timeout_s:g})")
    parser.add_argument("--max-connections", type=whole_number(1), default=default.max_connections, metavar="N",
                        help="connections open at once; one more gets 503 and is closed (default "
                             f"{default.max_connections})")


def from_args(args: argparse.Namespace) -> HttpLimits:
    """The limits that :func:`add_arguments`'s flags parsed into ``args``."""
    return HttpLimits(args.header_timeout, args.body_timeout, args.max_connections)


def _answer(status: int, message: str) -> bytes:
    """A whole HTTP response that closes the connection, written outside any request's cycle."""
    body = orjson.dumps({"error": message})
    phrase = {408: b"Request Timeout", 503: b"Service Unavailable"}[status]
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, phrase, len(body)) + body)


def limited_protocol(counts: Any, limits: HttpLimits) -> type:
    """uvicorn's httptools protocol under ``limits``, for ``uvicorn.Config(http=...)``.

    Args:
        counts: where connections are counted: its integer attributes ``open``, ``refused`` (closed with 503)
            and ``timed_out`` (closed by a timer) are kept up to date.
        limits: the timeouts and the connection bound.
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    busy = _answer(503, f"the query API has {limits.max_connections} connections open; retry shortly")
    late_headers = _answer(408, f"the request's headers did not arrive within {limits.header_timeout_s:g} s")
    late_body = _answer(408, f"the request's body did not arrive within {limits.body_timeout_s:g} s of its "
                             f"headers (fewer bytes than its Content-Length?)")

    class LimitedProtocol(HttpToolsProtocol):  # type: ignore[misc]
        _timer: asyncio.TimerHandle | None = None
        # "connected", then per request "headers", "body", "answering"; "idle" once answered before its body ended
        _phase = "connected"

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            counts.open += 1
            if counts.open > limits.max_connections:
                counts.refused += 1
                transport.write(busy)
                transport.close()
                return
            self._arm(limits.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            counts.open -= 1
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._phase != "connected":  # a new connection's first request counts from the connection
                self._arm(limits.header_timeout_s)
            self._phase = "headers"

        def on_headers_complete(self) -> None:
            self._phase = "body"
            self._arm(limits.body_timeout_s)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            self._phase = "answering"
            if self.cycle is not None and self.cycle.response_complete:
                # answered before its body ended (uvicorn's keep-alive timer ran out with the body's bytes)
                self._phase = "idle"
                self._arm(self.timeout_keep_alive)
            super().on_message_complete()

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            counts.timed_out += 1
            cycle = self.cycle
            if self._phase == "headers" and (cycle is None or cycle.response_complete):
                self.transport.write(late_headers)
            elif self._phase == "body" and cycle is not None and not cycle.response_started:
                self.transport.write(late_body)  # the application then reads a disconnect
            logger.info("closed the connection of %s: %s", "%s:%d" % self.client if self.client else "a client",
                        {"connected": "no request", "idle": "idle", "headers": "headers too slow",
                         "body": "body too slow"}.get(self._phase, self._phase))
            self.transport.close()

    return LimitedProtocol
