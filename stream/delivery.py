"""Delivering embedding updates: encode a batch of node states, send it, flush.

:class:`UpdateColumns` is what the worker hands over: the stored state of
some nodes, one entry per node in each column. :class:`Delivery` encodes
columns (:func:`encode_columns`: one :func:`gnnstream.stream.updates.encode_updates`
call a column set, tombstones for withdrawn nodes), sends the messages and
flushes, in this process. :class:`DeliveryProcess` runs the same
:class:`Delivery` in a child process (``python -m stream.delivery``) that
owns the producer, so that encoding and the client's per-message work run
beside the worker's engine rather than between its batches: the worker's
interpreter holds one lock for all its threads, and encoding JSON takes
longer than computing the embeddings.

Both raise :class:`~gnnstream.stream.exceptions.DeliveryError` when a batch was not
acknowledged and :class:`ValueError` when it cannot be encoded at all (no
retry cures that). The error's kind (:func:`gnnstream.stream.errors.classify`, carried
across the process boundary in ``DeliveryError.kind``) says whether sending
it again can help: a transient one is retried (the outbox keeps the batch), a
permanent one (an update too large, an unknown or forbidden topic) is not. A child that died is
replaced at the next :meth:`DeliveryProcess.deliver`, which raises
:class:`~gnnstream.stream.exceptions.DeliveryError` for the batch it lost. The child
runs in a session of its own and ignores SIGINT and SIGTERM (a Ctrl-C or a
signal to the worker's process group must not cut a flush short: the worker
decides when it stops and tells it), and it exits when its parent's end of
the socket closes, so a killed worker never leaves it behind.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import logging
import math
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Sequence

import numpy as np

from gnnstream.stream.clients import MAX_MESSAGE_BYTES, ProducerClient
from gnnstream.stream.errors import classify
from gnnstream.stream.exceptions import DeliveryError
from gnnstream.stream.deadletter import RECORD_OVERHEAD
from gnnstream.stream.partitioning import partitions_for
from gnnstream.stream.updates import check_packed, encode_updates, mode_codes, packed_frames, tombstone, utf8_ids

__all__ = ["UpdateColumns", "Delivery", "DeliveryProcess", "NodePartitions", "encode_columns", "encode_frames",
           "chunk_columns", "keep_freed_memory", "CHUNK", "WORKER_HEADER"]

logger = logging.getLogger(__name__)

Message = tuple[bytes, "bytes | None", Any]
Frame = tuple[int, bytes, bytes]  # (partition, key, value) of a packed frame
Format = Literal["json", "binary", "packed"]
WORKER_HEADER = "gnnstream.worker"  # names the worker of a group that published a message
CHUNK = 4096  # messages encoded, then sent, at a time: the client sends a chunk while the next is encoded
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


@dataclass(frozen=True, slots=True, eq=False)
class UpdateColumns:
    """The stored state of some nodes, one entry per node in each column.

    ``rows`` is ``(n, dim)`` float32 (zeros where ``deleted``); ``deleted``
    marks withdrawn nodes, published as tombstones. ``iids`` and
    ``mode_codes`` (the nodes' interned ids and the small integers standing
    for ``modes``, stable within a process) let the worker compare with
    what it sent before without looking names up; they are not sent, but
    ``iids`` cross to the delivery process, which remembers each node's
    output partition by them.
    """

    names: list[str]
    versions: np.ndarray
    event_ts: np.ndarray
    computed_at: float
    modes: list[str]
    rows: np.ndarray
    deleted: np.ndarray
    iids: np.ndarray | None = None
    mode_codes: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.names)

    def __reduce__(self) -> tuple:  # what crosses to the child: the columns it encodes, and the ids
        return (UpdateColumns, (self.names, self.versions, self.event_ts, self.computed_at, self.modes, self.rows,
                                self.deleted, self.iids))


def encode_columns(columns: Sequence[UpdateColumns], model: str, fmt: Literal["json", "binary"]) -> list[Message]:
    """The messages ``(key, value, headers)`` of ``columns``, in order (``value`` None for a tombstone).

    Raises:
        ValueError: a row or time that cannot be encoded (non-finite values, fields too long).
    """
    return [message for cols in columns for message in _messages(cols, model, fmt)]


def _messages(cols: UpdateColumns, model: str, fmt: Literal["json", "binary"]) -> Iterable[Message]:
    """The messages of ``cols`` (:func:`encode_columns`), every value encoded already: the tombstones, then the
    updates, the tuples made as they are taken (one sent at a time, the sender's loop reuses them)."""
    names, modes, versions, event_ts, rows = cols.names, cols.modes, cols.versions, cols.event_ts, cols.rows
    gone: list[Message] = []
    if cols.deleted.any():
        dead = np.flatnonzero(cols.deleted)
        gone = [tombstone(names[i], version) for i, version in zip(dead.tolist(), versions[dead].tolist())]
        keep = np.flatnonzero(~cols.deleted)
        names, modes = [names[i] for i in keep.tolist()], [modes[i] for i in keep.tolist()]
        versions, event_ts, rows = versions[keep], event_ts[keep], rows[keep]
    values = encode_updates(names, model, versions, event_ts, cols.computed_at, modes, rows, fmt)
    return itertools.chain(gone, zip(map(str.encode, names), values, itertools.repeat(None)))


def encode_frames(columns: Sequence[UpdateColumns], model: str, partitions: np.ndarray, max_bytes: int,
                  id_lens: np.ndarray | None = None) -> list[Frame]:
    """The packed frames ``(partition, key, value)`` of ``columns``: per output partition (``partitions``, that
    of each node of ``columns`` in order: the one its id maps to, :mod:`gnnstream.stream.partitioning`), in
    partition order, the rows in order, tombstones as flagged rows, split into frames of at most ``max_bytes``
    (value and key); the key is the partition number in decimal ASCII. ``id_lens``: each node id's length in
    UTF-8 when known (:class:`NodePartitions`).

    Raises:
        ValueError: a row or time that cannot be encoded, or a row that alone exceeds ``max_bytes``.
    """
    columns = [c for c in columns if len(c)]
    if not columns:
        return []
    if len(columns) == 1:
        (c,) = columns
        names, modes, versions, event_ts, rows, deleted = c.names, c.modes, c.versions, c.event_ts, c.rows, c.deleted
        computed = np.full(len(c), c.computed_at)
    else:
        names = list(itertools.chain.from_iterable(c.names for c in columns))
        modes = list(itertools.chain.from_iterable(c.modes for c in columns))
        versions = np.concatenate([c.versions for c in columns])
        event_ts = np.concatenate([c.event_ts for c in columns])
        computed = np.repeat([c.computed_at for c in columns], [len(c) for c in columns])
        rows = np.concatenate([c.rows for c in columns])
        deleted = np.concatenate([c.deleted for c in columns])
    if len(partitions) != len(names):
        raise ValueError(f"Expected a partition for each of the {len(names)} rows (got {len(partitions)})")
    times = np.asarray(event_ts, dtype=np.float64)
    table, codes = mode_codes(modes)
    if id_lens is None:
        id_blob, id_lens = utf8_ids(names)
    else:
        id_blob = "".join(names).encode("utf-8")
        if len(id_blob) != int(id_lens.sum()):
            raise ValueError("Expected the remembered id lengths to match the node ids (an interned id renamed?)")
    flags = deleted.astype(np.uint8)
    versions = np.asarray(versions, dtype=">u8")
    order = np.argsort(partitions.astype(np.int16) if partitions.max() < 2**15 else partitions, kind="stable")
    ordered = partitions[order]
    starts = [0, *(np.flatnonzero(np.diff(ordered)) + 1).tolist()]
    if len(starts) > 1:  # rows of several partitions: put in partition order once, each partition's a slice then
        lens = id_lens[order]
        at = np.cumsum(lens)
        # each id's bytes moved from where it was to where it goes, all at once
        moved = np.repeat((np.cumsum(id_lens) - id_lens)[order] - (at - lens), lens) + np.arange(at[-1])
        id_blob = np.frombuffer(id_blob, dtype=np.uint8)[moved].tobytes()
        versions, times, computed, flags, codes, rows, id_lens = (versions[order], times[order], computed[order],
                                                                  flags[order], codes[order], rows[order], lens)
    # checked in partition order: the rows just moved are still in the cache
    check_packed(lambda j: names[order[j]], rows, times, computed)
    id_at = [0, *np.cumsum(id_lens)[[b - 1 for b in starts[1:]]].tolist(), len(id_blob)]
    frames: list[Frame] = []
    for i, (a, b) in enumerate(zip(starts, [*starts[1:], len(names)])):
        p = int(ordered[a])
        key = str(p).encode()
        for value in packed_frames(lambda j, a=a: names[order[a + j]], id_blob[id_at[i]:id_at[i + 1]],
                                   id_lens[a:b], model, versions[a:b], times[a:b], computed[a:b], flags[a:b], table,
                                   codes[a:b], rows[a:b], max_bytes - len(key)):
            frames.append((p, key, value))
    return frames


class NodePartitions:
    """What the delivery process remembers of each node by its interned id: its output partition (among
    ``count``) and the length of its id in UTF-8. A node's updates go out again and again, and looking its hash
    up by name costs more than encoding its row.

    Columns without ``iids`` are looked up by name each time (:func:`partitions_for`).
    """

    def __init__(self, count: int):
        self.count = count
        self._known = np.zeros(0, dtype=np.int32)  # by iid: the node's partition, -1 = not known yet
        self._lens = np.zeros(0, dtype=np.int32)  # by iid: its id's length in UTF-8

    def of(self, columns: Sequence[UpdateColumns]) -> tuple[np.ndarray, np.ndarray | None]:
        """The partition of each node of ``columns``, in order, and the length of each one's id in UTF-8
        (None unless all columns have ``iids``)."""
        found = [self._of(c) for c in columns if len(c)]
        if not found:
            return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
        parts, lens = zip(*found)
        lens = None if any(n is None for n in lens) else lens[0] if len(lens) == 1 else np.concatenate(lens)
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), lens

    def _of(self, cols: UpdateColumns) -> tuple[np.ndarray, np.ndarray | None]:
        iids = cols.iids
        if iids is None:
            return (partitions_for(cols.names, self.count) if self.count > 1
                    else np.zeros(len(cols), dtype=np.int32)), None
        top = int(iids.max()) + 1
        if top > len(self._known):
            size = max(top, len(self._known) * 3 // 2)
            self._known = np.concatenate([self._known, np.full(size - len(self._known), -1, dtype=np.int32)])
            self._lens = np.concatenate([self._lens, np.zeros(size - len(self._lens), dtype=np.int32)])
        part = self._known[iids]
        unknown = np.flatnonzero(part < 0)
        if len(unknown):
            names = [cols.names[i] for i in unknown.tolist()]
            part[unknown] = partitions_for(names, self.count) if self.count > 1 else 0
            self._known[iids[unknown]] = part[unknown]
            self._lens[iids[unknown]] = [len(n.encode("utf-8")) for n in names]
        return part, self._lens[iids]


def chunk_columns(columns: Sequence[UpdateColumns], size: int) -> list[UpdateColumns]:
    """``columns`` cut into pieces of at most ``size`` nodes, in order."""
    out = []
    for cols in columns:
        if len(cols) <= size:
            out.append(cols)
            continue
        for start in range(0, len(cols), size):
            part = slice(start, start + size)
            out.append(UpdateColumns(cols.names[part], cols.versions[part], cols.event_ts[part], cols.computed_at,
                                     cols.modes[part], cols.rows[part], cols.deleted[part]))
    return out


class Delivery:
    """Encodes update columns and sends them with ``producer`` to ``topic``, in this process.

    Args:
        producer: the Kafka producer (owned: :meth:`close` closes it).
        topic: the output topic.
        model: ``name:version`` written into every update.
        fmt: ``"json"``, ``"binary"`` or ``"packed"`` (see :mod:`gnnstream.stream.updates`).
        worker: when given, every message carries the header
            ``gnnstream.worker`` with this name (which worker of a group
            published it).
        partitions: packed only: the output topic's partition count, or a function that looks it up (called at
            the first delivery; until it answers, deliveries fail as transient errors).
    """

    def __init__(self, producer: ProducerClient, topic: str, model: str, fmt: Format = "json",
                 worker: str | None = None, partitions: int | Callable[[], int] | None = None):
        if fmt == "packed" and partitions is None:
            raise ValueError("Expected the output topic's partitions for --output-format packed")
        self.producer, self.topic, self.model, self.fmt = producer, topic, model, fmt
        self._worker = [(WORKER_HEADER, worker.encode())] if worker else None
        self._partitions = partitions
        self._nodes: NodePartitions | None = None

    def partitions(self) -> NodePartitions:
        """The output partition of each node (packed), the topic's partition count looked up once.

        Raises:
            DeliveryError: the look-up failed (transient: the batch is sent again).
        """
        if self._nodes is None:
            count = self._partitions
            if callable(count):
                try:
                    count = int(count())
                except Exception as exc:
                    raise DeliveryError(f"the partitions of topic {self.topic!r} are not known yet ({exc}); the "
                                        f"batch is sent again", cause=exc, kind="kafka") from exc
            assert isinstance(count, int)
            self._nodes = NodePartitions(count)
        return self._nodes

    def deliver(self, columns: Sequence[UpdateColumns], timeout_s: float = 30.0,
                headers: list[tuple[str, bytes]] | None = None) -> int:
        """Encode, send and flush ``columns``; the number of messages (packed: of frames, each produced to its
        partition). Every message carries ``headers`` too (the serving version and marker number,
        :func:`gnnstream.stream.rollout.stamp_headers`).

        Raises:
            ValueError: the columns cannot be encoded (non-finite values are
                found before anything is sent).
            DeliveryError: the flush failed: all of them count as unsent.
        """
        send_many, topic = self.producer.send_many, self.topic
        count = 0
        extra = [*(self._worker or ()), *(headers or ())] or None
        if self.fmt == "packed":  # every frame is encoded before the first is sent
            room = (self.producer.max_message_bytes - RECORD_OVERHEAD
                    - sum(len(k.encode()) + len(v) for k, v in extra or ()))
            parts, id_lens = self.partitions().of(columns)
            frames = encode_frames(columns, self.model, parts, room, id_lens)
            for partition, key, value in frames:
                self.producer.send(topic, key, value, extra, partition=partition)
                count += 1
            self.producer.flush(timeout_s)
            return count
        chunks = chunk_columns(columns, CHUNK)
        for cols in chunks[1:]:  # the messages go out chunk by chunk: nothing is sent if any cannot be encoded
            if not (np.isfinite(cols.rows).all() and np.isfinite(cols.event_ts).all()
                    and math.isfinite(cols.computed_at)):
                encode_columns([cols], self.model, "binary")  # raises, naming the nodes
        for cols in chunks:  # (the first is checked as it is encoded, before anything is sent)
            count += send_many(topic, _messages(cols, self.model, self.fmt), extra)
        self.producer.flush(timeout_s)
        return count

    def close(self, timeout_s: float = 5.0) -> None:
        self.producer.close(timeout_s)


class _Pipe:
    """Pickled objects over a stream socket, the arrays they hold through a shared memory file.

    A message is a header (the pickle's length, the shared file's size and the
    number of buffers), each buffer's offset and size in the shared file, then
    the pickle (protocol 5). The sender copies every contiguous array the
    object holds into the shared file (grown when too small), the receiver
    rebuilds the arrays as views of its mapping of that file: a round's rows
    are copied once, into the file, and the socket carries only the small
    rest. The two ends take turns (a request, then its answer), so a sender
    writes the file only while the other end no longer reads what it received
    (an object a receiver keeps must not outlive its next :meth:`recv`).
    """

    _HEAD = struct.Struct("<QQI")
    _ALIGN = 64

    def __init__(self, sock: socket.socket, shared: int):
        self.sock, self._fd = sock, shared
        self._map: mmap.mmap | None = None
        self._view = memoryview(b"")

    def _mapped(self, size: int) -> memoryview:
        """The shared file mapped whole, at least ``size`` bytes (mapped again when the other end grew it)."""
        if len(self._view) < size:
            self._view.release()
            self._map = mmap.mmap(self._fd, size)  # the old mapping goes with the last array viewing it
            self._view = memoryview(self._map)
        return self._view

    def send(self, obj: Any) -> None:
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        places, end = [], 0
        for raw in raws:
            places += (end, raw.nbytes)
            end += -(-raw.nbytes // self._ALIGN) * self._ALIGN
        size = len(self._view)
        if end > size:
            size = max(end, 2 * os.fstat(self._fd).st_size)
            os.ftruncate(self._fd, size)
        view = self._mapped(size)
        for raw, at in zip(raws, places[::2]):
            view[at:at + raw.nbytes] = raw
        self.sock.sendall(b"".join((self._HEAD.pack(len(data), size, len(raws)),
                                    struct.pack(f"<{len(places)}Q", *places), data)))

    def recv(self) -> Any:
        length, size, count = self._HEAD.unpack(self._read(self._HEAD.size))
        rest = self._read(16 * count + length)
        places, data = struct.unpack_from(f"<{2 * count}Q", rest), memoryview(rest)[16 * count:]
        view = self._mapped(size) if count else self._view
        return pickle.loads(data, buffers=[view[at:at + n] for at, n in zip(places[::2], places[1::2])])

    def poll(self, timeout_s: float) -> bool:
        """Whether a message (or the end of the stream) can be read now, waiting up to ``timeout_s``."""
        return bool(select.select([self.sock], [], [], timeout_s)[0])

    def _read(self, size: int) -> bytes:
        parts, left = [], size
        while left:
            data = self.sock.recv(left)
            if not data:
                raise EOFError("the other end closed the socket")
            parts.append(data)
            left -= len(data)
        return b"".join(parts)

    def close(self) -> None:
        self.sock.close()
        os.close(self._fd)


class DeliveryProcess:
    """A :class:`Delivery` in a child process, with the same :meth:`deliver` and :meth:`close`.

    The child is started here and again after it died. Calls come from one
    thread at a time.

    Args:
        client: Kafka client of the child's producer (see :mod:`gnnstream.stream.backends`).
        bootstrap: ``host:port[,host:port...]``.
        topic, model, fmt, worker: as for :class:`Delivery`.
        max_message_bytes: the child's producer's record size limit.
    """

    def __init__(self, client: str, bootstrap: str, topic: str, model: str,
                 fmt: Format = "json", worker: str | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES):
        self._args = ["--client", client, "--bootstrap", bootstrap, "--topic", topic, "--model", model,
                      "--format", fmt, "--max-message-bytes", str(max_message_bytes),
                      *(["--worker", worker] if worker else [])]
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: _Pipe | None = None
        self._busy = False  # a call waits for the child's answer
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        shared = os.memfd_create("gnnstream-delivery")  # an empty file in memory, shared with the child
        argv = [sys.executable, "-m", "gnnstream.stream.delivery", "--fd", str(theirs.fileno()),
                "--shared-fd", str(shared), *self._args]
        try:
            self._proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(), shared), stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        except BaseException:
            ours.close()
            os.close(shared)
            raise
        finally:
            theirs.close()
        self._conn = _Pipe(ours, shared)

    @property
    def pid(self) -> int | None:
        """The child's process id (None while none runs)."""
        return self._proc.pid if self._proc is not None else None

    def _lost(self, doing: str) -> DeliveryError:
        """Forget a child that stopped answering (killing it if it still runs); the error to raise."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        code = None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            code = proc.wait()
        return DeliveryError(f"the delivery process exited (code {code}) while {doing}; a new one is started and "
                             f"the batch is sent again")

    def _call(self, request: tuple, doing: str, timeout_s: float | None) -> tuple:
        if self._conn is None:
            self._start()
        conn, proc = self._conn, self._proc
        assert conn is not None and proc is not None
        self._busy = True
        try:
            conn.send(request)
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while not conn.poll(0.5):
                if proc.poll() is not None or (deadline is not None and time.monotonic() > deadline):
                    raise EOFError
            return conn.recv()
        except (EOFError, OSError):
            raise self._lost(doing) from None
        finally:
            self._busy = False

    def deliver(self, columns: Sequence[UpdateColumns], timeout_s: float = 30.0,
                headers: list[tuple[str, bytes]] | None = None) -> int:
        """As :meth:`Delivery.deliver`, in the child (which bounds its flush by ``timeout_s``)."""
        reply = self._call(("deliver", list(columns), timeout_s, headers), "delivering", None)
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "refused":
            raise ValueError(reply[1])
        raise DeliveryError(reply[1], failed=reply[2], pending=reply[3], kind=reply[4])

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the child, letting its producer close within ``timeout_s``; kill it after that.

        From another thread while a :meth:`deliver` waits for the child, the
        child is killed at once (that call then raises
        :class:`~gnnstream.stream.exceptions.DeliveryError`).
        """
        proc = self._proc
        if self._busy and proc is not None:
            proc.kill()
            return
        if self._conn is None:
            return
        try:
            self._call(("close", timeout_s), "closing", timeout_s + 2.0)
        except DeliveryError:
            return
        proc, self._proc = self._proc, None
        self._conn.close()
        self._conn = None
        if proc is not None:
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _serve(conn: _Pipe, delivery: Delivery) -> None:
    """Answer the parent's requests until it says close or goes away."""
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the parent is gone: nothing is waiting for an answer
            delivery.close(1.0)
            return
        if request[0] == "close":
            delivery.close(request[1])
            conn.send(("closed",))
            return
        _, columns, timeout_s, headers = request
        try:
            reply: tuple = ("ok", delivery.deliver(columns, timeout_s, headers))
        except ValueError as exc:
            reply = ("refused", str(exc))
        except Exception as exc:  # DeliveryError, or a client error of another kind: classified for the parent
            failed, pending = (exc.failed, exc.pending) if isinstance(exc, DeliveryError) else (0, 0)
            text = str(exc) if isinstance(exc, DeliveryError) else f"{type(exc).__name__}: {exc}"
            reply = ("failed", text, failed, pending, classify(exc).kind)
        try:
            conn.send(reply)
        except OSError:  # the parent died while this batch was sent: nobody waits for the answer
            delivery.close(1.0)
            return


def topic_partitions(client: str, bootstrap: str, topic: str, timeout_s: float = 10.0) -> int:
    """How many partitions ``topic`` has, from the cluster's metadata (a consumer that joins no group).

    Raises:
        StreamError: none known within ``timeout_s``.
    """
    from gnnstream.stream.backends import open_consumer
    consumer = open_consumer(client, bootstrap, topic, f"gnnstream-delivery-{topic}", assign_all=True)
    try:
        return len(consumer.partitions_of(topic, timeout_s))
    finally:
        consumer.close()


def keep_freed_memory() -> None:
    """Have glibc's allocator keep the memory this process frees (elsewhere: nothing).

    A round's frames and the client's copies of them take megabytes, allocated and freed every round. By
    default glibc maps each block of more than 128 KiB anew and unmaps it when freed, so the next round
    faults every page in again: for packed updates, about half of the CPU of a round. Blocks of up to
    32 MiB come from the heap instead, and up to 64 MiB freed at its top stay with the process.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 << 20)
    except (OSError, AttributeError):  # not glibc
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the worker's delivery process (started by the worker)")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the worker")
    parser.add_argument("--shared-fd", type=int, required=True, help="the file shared with the worker")
    parser.add_argument("--client", required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--format", choices=("json", "binary", "packed"), default="json")
    parser.add_argument("--worker", default=None)
    parser.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker stops it: a Ctrl-C reaches it through the worker
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s delivery: %(message)s")
    keep_freed_memory()
    from gnnstream.stream.backends import open_producer
    conn = _Pipe(socket.socket(fileno=args.fd), args.shared_fd)
    # librdkafka: one produce request in flight. Its idempotent producer sends one at a time anyway while each
    # partition's records fit in one batch; allowed more, it polls in a busy loop while a partition's next batch
    # waits for the one in flight (a JSON round of more than batch.size per partition)
    limit = {"max_in_flight": 1} if args.client == "confluent" else {}
    producer = open_producer(args.client, args.bootstrap, max_message_bytes=args.max_message_bytes, **limit)
    partitions = (lambda: topic_partitions(args.client, args.bootstrap, args.topic)) if args.format == "packed" \
        else None
    _serve(conn, Delivery(producer, args.topic, args.model, args.format, args.worker, partitions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
