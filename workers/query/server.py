"""The query API over HTTP/JSON, in a process of its own beside the worker.

``gnnstream run --query-port PORT`` binds the port itself (so a port in
use stops the worker at once, with one line), then starts
``python -m gnnstream.workers.query.server`` with the listening socket. That process opens
the worker's state as a RocksDB follower (:class:`gnnstream.workers.query.state.QueryState`)
and serves it over HTTP/1.1 (:mod:`gnnstream.workers.query.http`: the
httptools parser on one epoll loop, each request answered as soon as it
has arrived). After every batch it commits, the worker writes a byte to
a pipe; the server then catches up with the state between two requests,
so every answer reflects the last batch the worker committed. When the
pipe closes (the worker stopped or died), the server exits.

Serving and streaming therefore share nothing but the files: the server
never takes the worker's interpreter lock, and the worker never waits
for a request. ``gnnstream serve`` runs the same server on its own beside
a worker (or on a stopped state), catching up every ``refresh`` seconds.

Routes:

- ``GET /v1/embeddings/{id}``: the stored final embedding (404 if none);
- ``POST /v1/infer``: exact what-if inference, nothing changes;
- ``POST /v1/score``: a typed model's score of a transaction that has not landed (a what-if of its
  ``edge_upsert``, then the transaction head);
- ``GET /v1/nodes/{id}/sample``: the node's samples per layer;
- ``GET /v1/health``: the model and how far the view has caught up (the
  worker's applied offsets and its dirty marks as of the last catch-up).

Every refusal is a 4xx with ``{"error": reason}``; a body over
:data:`MAX_BODY_BYTES`, more than :data:`gnnstream.workers.query.state.MAX_EVENTS` events
or :data:`gnnstream.workers.query.state.MAX_IDS` ids is refused before any work.

Clients are held to :class:`gnnstream.workers.query.limits.HttpLimits`: a request's
headers and its body must arrive within their timeouts (else 408 and the
connection closes), and a connection beyond ``max_connections`` gets 503
and is closed at once, while the open ones are served on.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from typing import Any

import orjson

from gnnstream.workers.heap import freeze_warm_heap, tune_collector
from gnnstream.workers.query.http import HttpServer
from gnnstream.workers.query.limits import HttpLimits, add_arguments, from_args
from gnnstream.workers.query.state import QueryError, QueryState, load_infer_body

__all__ = ["QueryApp", "QueryProcess", "serve", "MAX_BODY_BYTES", "bind", "run_ahead", "PRIORITY"]

logger = logging.getLogger("gnnstream.workers.query.server")  # its name also where it runs as __main__

MAX_BODY_BYTES = 1 << 20  # a what-if body; larger ones get 413 before they are read whole
_EMBEDDINGS = "/v1/embeddings/"
_NODES = "/v1/nodes/"
_SAMPLE = "/sample"
PRIORITY = -10  # nice value of the server process (and its session's), where it may raise them


class QueryApp:
    """The query API's answers over one :class:`QueryState`: the handler of
    :class:`~gnnstream.workers.query.http.HttpServer`, which counts its connections here.

    Args:
        state: the view answered from.
        max_body: largest accepted request body, in bytes.
    """

    def __init__(self, state: QueryState, max_body: int = MAX_BODY_BYTES):
        self.state = state
        self.max_body = max_body
        self.refreshed_at = 0.0
        self.requests = 0
        self.catch_ups: deque[float] = deque(maxlen=1000)  # seconds of the latest catch-ups (requests wait)
        self.busy = 0.0  # seconds spent answering, JSON encoding included
        self.open = 0  # connections open now (refused ones until they are closed)
        self.refused = 0  # connections closed at once with 503: max_connections were open
        self.timed_out = 0  # connections closed because a request's headers or body did not arrive in time

    def refresh(self) -> None:
        t = time.perf_counter()
        self.state.refresh()
        self.catch_ups.append(time.perf_counter() - t)
        self.refreshed_at = time.time()

    def __call__(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        """``(status, JSON answer)`` of one request; ``body`` None: it was over :attr:`max_body`."""
        self.requests += 1
        t = time.perf_counter()
        try:
            try:
                status, answer = self._route(method, path, body)
            except QueryError as exc:
                status, answer = exc.status, {"error": str(exc), **exc.extra}
            payload = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
        except Exception as exc:  # a bug: answer, log, keep serving
            logger.exception("query failed: %s %s", method, path[:200])
            status, payload = 500, orjson.dumps({"error": f"{type(exc).__name__}: {exc}"})
        self.busy += time.perf_counter() - t
        return status, payload

    def _route(self, method: str, path: str, body: bytes | None) -> tuple[int, Any]:
        if body is None:
            raise QueryError(413, f"the body is over {self.max_body} bytes")
        if path.startswith(_EMBEDDINGS) and len(path) > len(_EMBEDDINGS):
            _only(method, "GET")
            return 200, self.state.embedding(path[len(_EMBEDDINGS):])
        if path.startswith(_NODES) and path.endswith(_SAMPLE) and len(path) > len(_NODES) + len(_SAMPLE):
            _only(method, "GET")
            return 200, self.state.samples(path[len(_NODES):-len(_SAMPLE)])
        if path == "/v1/infer":
            _only(method, "POST")
            events, ids = self.state.parse_infer(load_infer_body(body))
            return 200, self.state.infer(events, ids)
        if path == "/v1/score":
            _only(method, "POST")
            return 200, self.state.score(*self.state.parse_score(load_infer_body(body)))
        if path == "/v1/health":
            _only(method, "GET")
            took = sorted(self.catch_ups)
            return 200, {"ok": True, **self.state.status(), "refreshed_at": self.refreshed_at,
                         "requests": self.requests, "busy_s": round(self.busy, 3),
                         "connections": {"open": self.open, "refused": self.refused, "timed_out": self.timed_out},
                         "catch_up_ms": {"count": len(took), "p50": round(1000 * took[len(took) // 2], 2),
                                         "max": round(1000 * took[-1], 2)} if took else None}
        raise QueryError(404, f"no route {method} {path[:200]}; see GET /v1/embeddings/{{id}}, POST /v1/infer, "
                              f"POST /v1/score, GET /v1/nodes/{{id}}/sample, GET /v1/health")


def _only(method: str, allowed: str) -> None:
    if method != allowed:
        raise QueryError(405, f"use {allowed}")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``.

    Raises:
        OSError: with a one-line message naming the address (in use, not local ...).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: an answer's head and body go out at once, not 40 ms apart (Nagle
        # waiting for the client's delayed ACK)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(f"query API cannot listen on {host}:{port}: {exc.strerror}; stop what uses that port or "
                      f"choose another --query-port") from None
    return sock


def serve(state_dir: str, model_dir: str | None, sock: socket.socket, *, notify_fd: int | None = None,
          refresh_s: float = 0.5, limits: HttpLimits = HttpLimits(), scratch: str | None = None) -> None:
    """Serve the query API on ``sock`` until the notify pipe closes (or SIGINT/SIGTERM without one).

    Args:
        notify_fd: read end of the worker's pipe: a byte means "a batch was committed", EOF means "stop".
        refresh_s: without a pipe, how often to catch up with the state.
        limits: what clients may hold (timeouts, connections).
        scratch: an empty directory for the secondary instance's own files (none: a temporary one); removed on
            exit, and by a caller that outlives this process.
    """
    run_ahead()
    import torch
    # one request's layers are a few dozen rows: a second thread only waits for a core the worker holds
    torch.set_num_threads(1)
    own = scratch or tempfile.mkdtemp(prefix="gnnstream-query-")
    try:
        state = QueryState(state_dir, model_dir, own)
        app = QueryApp(state)
        app.refresh()
        freeze_warm_heap()  # the page indexes and the model stay out of later collections
        host, port = sock.getsockname()[:2]
        logger.info("query API on http://%s:%d answers from state %s (model %s)", host, port, state_dir,
                    state.model_tag)

        server = HttpServer(app, limits)
        handlers = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                handlers[signum] = signal.signal(signum, lambda *_: server.stop())
        if notify_fd is not None:
            os.set_blocking(notify_fd, False)

            def committed() -> None:
                try:
                    data = os.read(notify_fd, 4096)
                except BlockingIOError:
                    return
                if not data:
                    server.remove_reader(notify_fd)
                    server.stop()
                    return
                app.refresh()

            server.add_reader(notify_fd, committed)
        else:
            server.every(refresh_s, app.refresh)
        try:
            server.serve(sock)
        finally:
            for signum, previous in handlers.items():
                signal.signal(signum, previous)
        state.close()
    finally:
        shutil.rmtree(own, ignore_errors=True)


def run_ahead(nice: int = PRIORITY) -> bool:
    """Run this process ahead of the worker for the CPU: a request is a millisecond of work that waits for
    nothing else, a batch is seconds of it. Returns whether the priority was raised.

    Where the kernel schedules by session (autogroup: each session a task group of its own, shares split
    between groups first), a nice value counts only within its session; a process that leads its own session
    (:class:`QueryProcess` starts the server so) raises its group's as well. Needs CAP_SYS_NICE (root);
    without it the process shares the CPU as an equal.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        logger.info("process %d runs at the worker's priority (%s): it cannot raise its own", os.getpid(),
                    exc.strerror)
        return False
    if os.getsid(0) == os.getpid():
        try:
            with open("/proc/self/autogroup", "w") as fh:
                fh.write(str(nice))
        except OSError:
            pass  # no scheduling by session here: the process's own nice value is all there is
    return True


class QueryProcess:
    """The worker's side of the query server: the bound socket, the child process and the notify pipe.

    Args:
        state_dir: the worker's state directory.
        model_dir: the model directory (None: the one the state uses).
        host: address to listen on.
        port: port to listen on (0: any free one, see :attr:`port`).
        limits: what the server's clients may hold.

    The server logs at this process's root logging level, in the same format.

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, state_dir: str, model_dir: str | None, host: str, port: int,
                 limits: HttpLimits = HttpLimits()):
        sock = bind(host, port)
        self.host, self.port = host, sock.getsockname()[1]
        read_end, self._notify = os.pipe()
        os.set_blocking(self._notify, False)
        # the server's own files: removed by the server as it exits, and here in case it was killed
        self._scratch = tempfile.mkdtemp(prefix="gnnstream-query-")
        argv = [sys.executable, "-m", "gnnstream.workers.query.server", "--state", state_dir, "--socket-fd",
                str(sock.fileno()), "--notify-fd", str(read_end), "--scratch", self._scratch, *limits.argv(),
                "--log-level", str(logging.getLogger().getEffectiveLevel()),
                *(("--model", model_dir) if model_dir is not None else ())]
        try:
            # a session of its own: a Ctrl-C at the terminal reaches the worker, which then closes the pipe
            self._child = subprocess.Popen(argv, pass_fds=(sock.fileno(), read_end), start_new_session=True)
        except BaseException:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise
        finally:
            os.close(read_end)
            sock.close()
        logger.info("query API on http://%s:%d (process %d)", self.host, self.port, self._child.pid)

    def notify(self) -> None:
        """A batch was committed: the server catches up before its next answer."""
        if self._notify < 0:
            return
        try:
            os.write(self._notify, b"\x01")
        except BlockingIOError:
            pass  # the pipe is full of unread notes: one catch-up covers them all
        except BrokenPipeError:
            logger.error("the query API process exited (code %s); the worker streams on without it: restart the "
                         "worker to serve queries again", self._child.wait())
            os.close(self._notify)
            self._notify = -1

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the pipe (the server exits) and wait for the process."""
        if self._notify >= 0:
            os.close(self._notify)
            self._notify = -1
        try:
            self._child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        shutil.rmtree(self._scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    from gnnstream.workers.settings import configure_logging
    parser = argparse.ArgumentParser(prog="python -m gnnstream.workers.query.server", description="the query API server "
                                     "process (started by `gnnstream run --query-port`)")
    parser.add_argument("--state", required=True, help="the worker's state directory")
    parser.add_argument("--model", help="the model directory (default: the one the state uses)")
    parser.add_argument("--socket-fd", type=int, required=True, help="the listening socket, inherited")
    parser.add_argument("--notify-fd", type=int, required=True, help="the worker's pipe, inherited")
    parser.add_argument("--scratch", help="directory for the secondary instance's files (removed on exit)")
    parser.add_argument("--log-level", type=int, default=logging.WARNING, help="the worker's logging level")
    add_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    tune_collector()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker stops this process by closing the pipe
    sock = socket.socket(fileno=args.socket_fd)
    serve(args.state, args.model, sock, notify_fd=args.notify_fd, limits=from_args(args), scratch=args.scratch)


if __name__ == "__main__":
    main()
