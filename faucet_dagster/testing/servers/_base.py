"""The lifecycle the three test servers share (see :mod:`faucet_dagster.testing.servers`): a process
group on a free loopback port, readiness probes, logs, and the watchdog that leaves no orphans.
"""

import atexit
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, ClassVar, Self, TypeVar

POSTGRES_URL_ENV = "FAUCET_TEST_POSTGRES_URL"
NATS_URL_ENV = "FAUCET_TEST_NATS_URL"
KAFKA_BOOTSTRAP_ENV = "FAUCET_TEST_KAFKA_BOOTSTRAP"
S3_ENDPOINT_ENV = "FAUCET_TEST_S3_ENDPOINT"

#: OS user PostgreSQL runs as when this process is root (PostgreSQL refuses to run as root).
POSTGRES_OS_USER = "faucet_pg"

HOST = "127.0.0.1"
_LOG_TAIL_LINES = 40
_T = TypeVar("_T")


class ServerStartError(RuntimeError):
    """A server could not be started, or did not answer within its startup timeout.

    The message names the server, the reason and the tail of the server's log.
    """


class ExternalServerError(RuntimeError):
    """A lifecycle call (stop, kill, restart) was made on an external server we do not own."""


def make_unique_name(prefix: str = "t", hint: str = "") -> str:
    """Return a fresh name usable as a PostgreSQL database, NATS stream or Kafka topic name.

    The name is lower case, made of ``[a-z0-9_]``, at most 50 characters, and ends with 8 random hex
    digits: ``make_unique_name("orders", "test_x[1]")`` gives e.g. ``orders_test_x_1_3f9a2c1b``.
    """
    parts = [_slug(prefix)[:16], _slug(hint)[:24], uuid.uuid4().hex[:8]]
    return "_".join(p for p in parts if p)


def _slug(text: str) -> str:
    out = "".join(c if c.isascii() and c.isalnum() else "_" for c in text.lower())
    return "_".join(p for p in out.split("_") if p)


# --------------------------------------------------------------------------------------------------
# process plumbing


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def port_accepts(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux ``/proc``), parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_blocking(factory: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine to completion, also when called from inside a running event loop.

    Inside a running loop the coroutine runs on a fresh loop in a helper thread; the caller's loop is
    blocked meanwhile (these calls are short probes).
    """
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with ThreadPoolExecutor(1, thread_name_prefix="faucet-probe") as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


_REAPER_SOURCE = r"""
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
groups, dirs = set(), set()
for raw in sys.stdin.buffer:
    op, arg = raw[:1], raw[1:].rstrip(b"\n").decode()
    if op == b"+":
        groups.add(int(arg))
    elif op == b"-":
        groups.discard(int(arg))
    elif op == b"d":
        dirs.add(arg)
    elif op == b"r":
        dirs.discard(arg)
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
if dirs:
    time.sleep(0.5)
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
"""


class _Reaper:
    """A watchdog child that cleans up after this interpreter if it dies without running ``atexit``.

    It reads lines on a pipe: ``+PGID`` / ``-PGID`` (un)register a process group, ``dPATH`` / ``rPATH`` a
    directory. End of file (every write end closed, which the kernel does when this process dies for any
    reason) makes it SIGKILL the groups and delete the directories still registered, then exit.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner = 0
        self._lines: set[str] = set()

    def _send(self, line: str) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None or self._owner != os.getpid():
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _REAPER_SOURCE],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            self._proc, self._owner = proc, os.getpid()
            line = "".join(f"{known}\n" for known in self._lines) + line
        assert proc.stdin is not None
        proc.stdin.write(f"{line}\n".encode())
        proc.stdin.flush()

    def add(self, kind: str, value: object) -> None:
        """Register a process group (``kind="+"``) or a directory (``kind="d"``)."""
        with self._lock:
            line = f"{kind}{value}"
            self._send(line)
            self._lines.add(line)

    def remove(self, kind: str, value: object) -> None:
        """Unregister what :meth:`add` registered."""
        with self._lock:
            line = f"{kind}{value}"
            if line in self._lines:
                self._lines.discard(line)
                undo = {"+": "-", "d": "r"}[kind]
                if self._proc is not None and self._proc.poll() is None and self._owner == os.getpid():
                    self._send(f"{undo}{value}")


_reaper = _Reaper()
_live: "set[ManagedServer]" = set()
_live_lock = threading.Lock()
_owner_pid = os.getpid()


@atexit.register
def _close_all_at_exit() -> None:
    if os.getpid() != _owner_pid:  # a forked child must not tear down its parent's servers
        return
    with _live_lock:
        servers = list(_live)
    for server in servers:
        server._close_at_exit()


# --------------------------------------------------------------------------------------------------
# the shared lifecycle


class NotReady(Exception):
    """A readiness probe did not get an answer yet."""


class ManagedServer:
    """Lifecycle shared by the three servers. Subclasses provide the command line and the probe."""

    kind: ClassVar[str] = "server"
    env_var: ClassVar[str] = ""
    #: Signal asking the server for a graceful shutdown.
    stop_signal: ClassVar[signal.Signals] = signal.SIGTERM

    def __init__(
        self,
        *,
        port: int | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 30.0,
        external: str | None = None,
    ) -> None:
        """``port``: fixed port (default: a free one). ``base_dir``: parent of the temporary directory
        (default: the system temp dir). ``external``: the address of a server we do not own
        (:meth:`external`)."""
        self._external = external
        self._port_fixed = port is not None
        self._port = port if port is not None else (0 if external is not None else _free_port())
        self._base_dir = Path(base_dir) if base_dir is not None else None
        self.startup_timeout = startup_timeout
        self._workdir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._prepared = False
        self._closed = False
        self._external_checked = False
        self._log_offset = 0
        self._ever_started = False
        self._lock = threading.RLock()

    # -- subclass hooks ---------------------------------------------------------------------------

    def _prepare(self, workdir: Path) -> None:
        """Once per handle, before the first start: create data directories, initdb, ..."""

    def _command(self, workdir: Path) -> list[str]:
        raise NotImplementedError

    def _probe(self, timeout: float) -> None:
        """Return when the server answers a real client request; raise ``NotReady`` otherwise."""
        raise NotImplementedError

    def _run_as(self) -> pwd.struct_passwd | None:
        return None

    def _child_env(self, workdir: Path) -> dict[str, str]:
        return dict(os.environ)

    def _describe(self) -> str:
        raise NotImplementedError

    # -- public state -----------------------------------------------------------------------------

    @classmethod
    def external(cls, address: str, *, startup_timeout: float = 30.0) -> Self:
        """A handle to a server we do not own at ``address`` (its URL; Kafka: ``host:port[,...]``)."""
        self = cls.__new__(cls)
        ManagedServer.__init__(
            self, port=None, base_dir=None, startup_timeout=startup_timeout, external=address
        )
        return self

    @classmethod
    def from_env(cls) -> Self:
        """:meth:`external` when the class's ``env_var`` is set, else a managed server (not started)."""
        address = os.environ.get(cls.env_var)
        return cls.external(address) if address else cls()

    @property
    def is_external(self) -> bool:
        """True when this handle points at a server we did not start (set through ``from_env``)."""
        return self._external is not None

    @property
    def is_running(self) -> bool:
        """True if the managed process is alive (it may still be starting). Always True when external."""
        if self._external is not None:
            return True
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """PID of the managed server process, or None when it is not running or external."""
        return self._proc.pid if self.is_running and self._proc is not None else None

    @property
    def port(self) -> int:
        """TCP port on 127.0.0.1; stays the same across restarts. 0 for external servers."""
        return self._port

    @property
    def workdir(self) -> Path | None:
        """Private directory holding data and log, or None before the first start or when external."""
        return self._workdir

    @property
    def log_path(self) -> Path | None:
        """The server's stdout and stderr, appended across restarts (None when external)."""
        return None if self._workdir is None else self._workdir / "server.log"

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server log ('' when there is none)."""
        path = self.log_path
        if path is None or not path.exists():
            return ""
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def __repr__(self) -> str:
        state = "external" if self.is_external else ("running" if self.is_running else "stopped")
        return f"<{type(self).__name__} {self._describe()} {state}>"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> Self:
        """Start the server if it is not running and block until it answers a client request.

        Idempotent: returns at once when the server is already running. For an external server it checks
        (once per handle) that the server answers. Blocks at most ``startup_timeout`` seconds per attempt;
        on failure raises :class:`ServerStartError` with the log tail and leaves no process behind. When the
        port was picked automatically and turns out to be taken on the very first start, it retries on
        another free port.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            if self._external is not None:
                if not self._external_checked:
                    self._check_external()
                return self
            if self.is_running:
                return self
            if self._workdir is None:
                base = str(self._base_dir) if self._base_dir is not None else None
                self._workdir = Path(tempfile.mkdtemp(prefix=f"faucet-{self.kind.lower()}-", dir=base))
                _reaper.add("d", self._workdir)
                with _live_lock:
                    _live.add(self)
            if not self._prepared:
                self._prepare(self._workdir)
                self._prepared = True
            attempts = 1 if self._port_fixed else 3
            for attempt in range(attempts):
                try:
                    self._spawn_and_wait()
                    return self
                except ServerStartError:
                    port_taken = "already in use" in self._attempt_log().lower()
                    if not port_taken or attempt == attempts - 1 or self._ever_started:
                        raise
                    self._port = _free_port()
            raise AssertionError("unreachable")

    def stop(self, timeout: float = 30.0) -> None:
        """Gracefully stop the server and block until its process has exited.

        Sends the server's shutdown signal and waits up to ``timeout`` seconds, then SIGKILLs the whole
        process group. Data on disk is kept; ``start()`` or ``restart()`` bring the server back on the same
        port. No-op when it is not running. Raises :class:`ExternalServerError` for an external server.
        """
        self._require_owned("stop")
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(self.stop_signal)
                with contextlib.suppress(subprocess.TimeoutExpired):  # escalated to SIGKILL just below
                    proc.wait(timeout)
            self._reap(proc)

    def kill(self) -> None:
        """SIGKILL the server's whole process group (a crash) and block until the process is gone.

        Data already handed to the OS survives (the page cache is kept; only the process dies), so a
        ``restart()`` runs the server's crash recovery on the same data. No-op when it is not running.
        Raises :class:`ExternalServerError` for an external server.
        """
        self._require_owned("kill")
        with self._lock:
            if self._proc is not None:
                self._reap(self._proc)

    @contextlib.contextmanager
    def frozen(self, at_most: float | None = None) -> Iterator[None]:
        """The server stopped (SIGSTOP) inside the context, continued (SIGCONT) on exit, or after
        ``at_most`` seconds if the context lasts longer (so a client that waits for the server ends
        instead of hanging its test): a server that hangs. Its process and every descendant are stopped
        (PostgreSQL's backends run in sessions of their own, so the process group alone would leave
        them answering). Its kernel still accepts connections and acknowledges bytes, so clients see
        no error, only no answer. Raises :class:`ExternalServerError` for an external server and
        RuntimeError when it is not running."""
        self._require_owned("freeze")
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{self!r} is not running: it cannot be frozen")
        stopped: list[int] = []
        thawing = threading.Lock()

        def thaw() -> None:
            with thawing:
                while stopped:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(stopped.pop(), signal.SIGCONT)

        os.kill(proc.pid, signal.SIGSTOP)  # first: a stopped server forks no new process
        stopped.append(proc.pid)
        for pid in _descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        timer = None if at_most is None else threading.Timer(at_most, thaw)
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            yield
        finally:
            if timer is not None:
                timer.cancel()
            thaw()

    def restart(self, timeout: float = 30.0) -> Self:
        """``stop(timeout)`` if running, then ``start()``: same port, same data directory.

        Blocks until the server answers again. Raises :class:`ExternalServerError` for an external server.
        """
        self._require_owned("restart")
        self.stop(timeout)
        return self.start()

    def close(self) -> None:
        """Stop the server (SIGKILL after 10 s) and delete its directory. Idempotent; no-op when external.

        The handle cannot be started again afterwards.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._external is not None:
                return
            try:
                self.stop(timeout=10.0)
            finally:
                with _live_lock:
                    _live.discard(self)
                if self._workdir is not None:
                    shutil.rmtree(self._workdir, ignore_errors=True)
                    _reaper.remove("d", self._workdir)

    # -- internals --------------------------------------------------------------------------------

    def _close_at_exit(self) -> None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            self.close()

    def _require_owned(self, action: str) -> None:
        if self._external is not None:
            raise ExternalServerError(
                f"cannot {action} the {self.kind} server at {self._external}: it is external (set through "
                f"{self.env_var}), faucet_dagster.testing does not own its process. Unset {self.env_var} to "
                "let the tests start their own server."
            )

    def _check_external(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last = "no attempt"
        while time.monotonic() < deadline:
            try:
                self._probe(min(5.0, max(0.5, deadline - time.monotonic())))
                self._external_checked = True
                return
            except NotReady as exc:
                last = str(exc)
            time.sleep(0.2)
        raise ServerStartError(
            f"the external {self.kind} server at {self._external} (from {self.env_var}) does not answer "
            f"after {self.startup_timeout:.0f} s: {last}"
        )

    def _attempt_log(self) -> str:
        path = self.log_path
        if path is None or not path.exists():
            return ""
        with path.open("rb") as f:
            f.seek(self._log_offset)
            return f.read().decode("utf-8", "replace")

    def _popen(self, cmd: list[str], log: IO[bytes], *, new_session: bool) -> subprocess.Popen[bytes]:
        assert self._workdir is not None
        user = self._run_as()
        kwargs: dict[str, Any] = {}
        if user is not None:
            kwargs = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self._workdir,
            env=self._child_env(self._workdir),
            start_new_session=new_session,
            **kwargs,
        )

    def _spawn_and_wait(self) -> None:
        assert self._workdir is not None
        log_path = self._workdir / "server.log"
        self._log_offset = log_path.stat().st_size if log_path.exists() else 0
        cmd = self._command(self._workdir)
        with log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
            log.flush()
            self._log_offset = log.tell()
            try:
                proc = self._popen(cmd, log, new_session=True)
            except OSError as exc:
                raise ServerStartError(f"could not run the {self.kind} server {cmd[0]}: {exc}") from exc
        self._proc = proc
        _reaper.add("+", proc.pid)
        deadline = time.monotonic() + self.startup_timeout
        last = "no attempt yet"
        while True:
            code = proc.poll()
            if code is not None:
                self._reap(proc)
                raise ServerStartError(
                    f"the {self.kind} server ({self._describe()}) exited with code {code} while starting.\n"
                    f"--- log tail ({log_path}) ---\n{self.log_tail()}"
                )
            remaining = deadline - time.monotonic()
            try:
                self._probe(min(5.0, max(0.5, remaining)))
                self._ever_started = True
                return
            except NotReady as exc:
                last = str(exc)
            if time.monotonic() >= deadline:
                self._reap(proc)
                raise ServerStartError(
                    f"the {self.kind} server ({self._describe()}) did not answer within "
                    f"{self.startup_timeout:.0f} s; last probe error: {last}\n"
                    f"--- log tail ({log_path}) ---\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _reap(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the process group of ``proc`` (whatever is left of it) and wait for ``proc``."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _reaper.remove("+", proc.pid)
        if self._proc is proc:
            self._proc = None


# --------------------------------------------------------------------------------------------------
# PostgreSQL
