"""The fixtures a config factory may name, outside pytest and inside it, fresh on every call.

A config factory (see :mod:`.setup`) names fixtures as a pytest fixture does: ``postgres_url``,
``nats_url``, ``nats_server``, ``kafka_bootstrap``, ``s3_server``, ``unique_name`` and ``tmp_path``.
The generated scenarios need a new setup for every run (each example, each try while shrinking), so
the battery calls the factory again and again: :class:`Fixtures` gives each call fresh values (a new database,
new names, a new folder) on servers started once. ``faucet conformance`` starts the servers itself
(:mod:`faucet_dagster.testing`, or the ``FAUCET_TEST_*`` environment variables); under pytest the
session's server fixtures are used.
"""

import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from faucet_dagster.conformance.setup import ConfigFactory, Setup, factory_fixtures
from faucet_dagster.protocol import ConfigError
from faucet_dagster.testing import KafkaServer, NatsServer, PostgresServer, S3Server, make_unique_name

FIXTURES = (
    "postgres_url",
    "nats_url",
    "nats_server",
    "kafka_bootstrap",
    "s3_server",
    "unique_name",
    "tmp_path",
)


class Fixtures:
    """Fresh fixture values for config factories; what they create is released at :meth:`close`.

    ``servers`` gives a running server by kind (``postgres``, ``nats``, ``kafka``, ``s3``); by default they
    are started here on first use and stopped at close.
    """

    def __init__(self, servers: Callable[[str], Any] | None = None, hint: str = "conformance") -> None:
        self._stack = ExitStack()
        self._started: dict[str, Any] = {}
        self._servers = servers or self._start
        self.hint = hint

    def __enter__(self) -> "Fixtures":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def setup(self, factory: ConfigFactory) -> Setup:
        """Call ``factory`` with fresh fixture values."""
        return factory(**{name: self.value(name) for name in factory_fixtures(factory)})

    def fresh(self, factory: ConfigFactory) -> Callable[[], Setup]:
        return lambda: self.setup(factory)

    def value(self, name: str) -> Any:
        if name == "postgres_url":
            server = self._servers("postgres")
            database = make_unique_name("conformance", self.hint)
            url = server.create_database(database)
            self._stack.callback(self._drop, server, database)
            return url
        if name in ("nats_url", "nats_server"):
            server = self._servers("nats")
            return server.url if name == "nats_url" else server
        if name == "kafka_bootstrap":
            return self._servers("kafka").bootstrap
        if name == "s3_server":
            return self._servers("s3")
        if name == "unique_name":
            return lambda prefix="t": make_unique_name(prefix, self.hint)
        if name == "tmp_path":
            folder = Path(tempfile.mkdtemp(prefix="faucet-conformance-"))
            self._stack.callback(shutil.rmtree, folder, True)
            return folder
        raise ConfigError(
            f"a config factory asks for fixture {name!r}; the battery knows {', '.join(FIXTURES)}",
            where="faucet conformance",
        )

    @staticmethod
    def _drop(server: Any, database: str) -> None:
        if getattr(server, "is_running", True):
            server.drop_database(database)

    def _start(self, kind: str) -> Any:
        server = self._started.get(kind)
        if server is None:
            kinds: dict[str, Any] = {
                "postgres": PostgresServer,
                "nats": NatsServer,
                "kafka": KafkaServer,
                "s3": S3Server,
            }
            made = kinds[kind].from_env()
            self._stack.callback(made.close)
            server = self._started[kind] = made.start()
        return server


__all__ = ["FIXTURES", "Fixtures"]
