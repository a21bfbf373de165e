"""One rule for Kafka errors: transient ones are retried, permanent ones are acted on once.

Every producer and consumer error the project meets goes through
:func:`classify`, whichever client raised it (confluent-kafka's
``KafkaException``/``KafkaError``, kafka-python's ``KafkaError`` classes, a
:class:`~gnnstream.stream.exceptions.DeliveryError` wrapping either, or a Python error
from encoding a record):

======================  =========  =====================================================================================
kind                    permanent  examples
======================  =========  =====================================================================================
``record_too_large``    yes        over the client's ``message.max.bytes`` / ``max_request_size``, or the broker's limit
``unknown_topic``       yes        unknown topic or partition, invalid topic name
``not_authorised``      yes        topic or cluster authorisation failed
``invalid_record``      yes        corrupt or invalid record, invalid argument
``serialisation``       yes        key or value that cannot be serialised
``broker_unavailable``  no         connection refused, all brokers down
``timeout``             no         request or delivery timed out, records with no answer
``leader_change``       no         not leader, leader not available
``queue_full``          no         the client's local queue is full
``kafka``               no         anything else (retried, like a transient error)
======================  =========  =====================================================================================

A transient error is retried with backoff; a permanent one is never retried
with the same record (the caller changes it, skips it, or stops).
:class:`Limited` is the one rule for repeated warnings: the first of a kind is
logged, repeats are counted and summarised in one line a minute.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, NamedTuple, TypeVar

T = TypeVar("T")

__all__ = ["ErrorKind", "classify", "is_permanent", "PERMANENT_KINDS", "TRANSIENT_KINDS", "Limited", "retrying",
           "backoff_s"]

logger = logging.getLogger(__name__)

PERMANENT_KINDS = ("record_too_large", "unknown_topic", "not_authorised", "invalid_record", "serialisation")
TRANSIENT_KINDS = ("broker_unavailable", "timeout", "leader_change", "queue_full", "kafka")

# Kafka protocol error codes (positive) and librdkafka's local ones (negative), as both clients report them
_BY_CODE = {
    10: "record_too_large", 18: "record_too_large", 4: "record_too_large",
    2: "invalid_record", 87: "invalid_record", -186: "invalid_record", 21: "invalid_record",
    3: "unknown_topic", 17: "unknown_topic", -188: "unknown_topic", -190: "unknown_topic",
    29: "not_authorised", 31: "not_authorised",
    -161: "serialisation", -162: "serialisation",
    -195: "broker_unavailable", -187: "broker_unavailable",
    -192: "timeout", -185: "timeout", 7: "timeout",
    5: "leader_change", 6: "leader_change",
    -184: "queue_full",
}
_BY_NAME = {  # kafka-python classes without an error code
    "KafkaConnectionError": "broker_unavailable",
    "KafkaTimeoutError": "timeout",
}


class ErrorKind(NamedTuple):
    """What an error is: ``kind`` (see the module table) and whether a retry can cure it."""

    kind: str
    permanent: bool


def _code(exc: BaseException) -> int | None:
    """The Kafka error code of ``exc`` (confluent: ``args[0].code()``; kafka-python: ``errno``)."""
    error = exc.args[0] if exc.args else None
    code = getattr(error, "code", None)
    if callable(code):  # confluent_kafka.KafkaError inside a KafkaException
        return code()
    if callable(getattr(exc, "code", None)) and hasattr(exc, "fatal"):  # a bare confluent_kafka.KafkaError
        return exc.code()
    errno = getattr(exc, "errno", None)
    return errno if isinstance(errno, int) and type(exc).__module__.startswith("kafka") else None


def classify(exc: BaseException | None) -> ErrorKind:
    """The kind of a Kafka client error (see the module table); unknown errors are transient ``kafka``.

    A :class:`~gnnstream.stream.exceptions.DeliveryError` is classified by the ``kind``
    it carries, else by its cause; one with neither (records that got no
    answer) is a ``timeout``.
    """
    if exc is None:
        return ErrorKind("timeout", False)
    kind = getattr(exc, "kind", None)
    if isinstance(kind, str) and kind in PERMANENT_KINDS + TRANSIENT_KINDS:
        return ErrorKind(kind, kind in PERMANENT_KINDS)
    if type(exc).__name__ == "DeliveryError":
        cause = getattr(exc, "cause", None)
        return classify(cause) if cause is not None else ErrorKind("timeout", False)
    if isinstance(exc, BufferError):
        return ErrorKind("queue_full", False)
    if isinstance(exc, (TypeError, UnicodeError)):
        return ErrorKind("serialisation", True)
    found = _BY_CODE.get(_code(exc)) or _BY_NAME.get(type(exc).__name__) or "kafka"  # type: ignore[arg-type]
    return ErrorKind(found, found in PERMANENT_KINDS)


def is_permanent(exc: BaseException | None) -> bool:
    """Whether no retry can cure ``exc`` (:func:`classify`)."""
    return classify(exc).permanent


def backoff_s(attempt: int, first_s: float = 0.5, most_s: float = 5.0) -> float:
    """The pause before retry number ``attempt`` (from 1) of a transient error: 0.5, 1, 2, 4, 5, 5 ... s."""
    return min(first_s * 2 ** max(attempt - 1, 0), most_s)


def retrying(call: Callable[[], T], what: str, timeout_s: float = 60.0,
             sleep: Callable[[float], None] = time.sleep) -> T:
    """``call()``, called again with backoff after a transient Kafka error until ``timeout_s`` has passed.

    For one-shot commands (``gnnstream rollout``) that send and flush; the
    worker's loop has its own retries.

    Raises:
        Exception: a permanent error at once, a transient one after ``timeout_s``.
    """
    from gnnstream.stream.exceptions import DeliveryError
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        try:
            return call()
        except DeliveryError as exc:
            found = classify(exc)
            attempt += 1
            if found.permanent or time.monotonic() + backoff_s(attempt) > deadline:
                raise
            _limited.warning(f"retrying:{what}", "%s failed (%s, transient), retrying: %s", what, found.kind, exc)
            sleep(backoff_s(attempt))


class Limited:
    """Repeated warnings, limited: the first of each key is logged, repeats within ``every_s`` are counted
    (and logged at DEBUG), and the next one after that says how many there were.

    Args:
        log: where the lines go.
        every_s: the shortest time between two lines of one key.
        clock: monotonic seconds.
    """

    def __init__(self, log: logging.Logger, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.log, self.every_s, self.clock = log, every_s, clock
        self._lock = threading.Lock()
        self._seen: dict[str, list] = {}  # key -> [time of the last line, repeats since]

    def warning(self, key: str, msg: str, *args: object, level: int = logging.WARNING) -> bool:
        """Log ``msg % args`` unless a line of ``key`` was logged less than ``every_s`` ago; whether it was."""
        with self._lock:
            now = self.clock()
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self.every_s:
                seen[1] += 1
                repeats = -1
            else:
                repeats = seen[1] if seen is not None else 0
                if len(self._seen) >= 1024 and seen is None:
                    del self._seen[next(iter(self._seen))]
                self._seen[key] = [now, 0]
        if repeats < 0:
            self.log.debug(msg + " (a repeat)", *args)
            return False
        if repeats:
            self.log.log(level, msg + " [repeated %d times in the last %.0f s]", *args, repeats, now - seen[0])
        else:
            self.log.log(level, msg, *args)
        return True

    def forget(self, key: str) -> None:
        """The condition of ``key`` is over: its next warning is logged at once."""
        with self._lock:
            self._seen.pop(key, None)


_limited = Limited(logger)
