"""What the clients of the query API may hold: read timeouts and a bound on connections.

:class:`HttpLimits` and its flags; :mod:`gnnstream.workers.query.http`
holds the connections to them:

- from the connection (for its first request) or a later request's first
  byte to the end of the request's headers: ``header_timeout_s``;
- from the end of the headers to the end of the body: ``body_timeout_s``;
- connections open at once: ``max_connections``.

A client past a timeout gets ``408`` with ``{"error": ...}`` and its
connection closes; one more connection than the bound gets ``503`` and is
closed at once, while the open ones are served on.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from gnnstream.workers.settings import finite_number, whole_number

__all__ = ["HttpLimits", "add_arguments", "from_args"]


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
