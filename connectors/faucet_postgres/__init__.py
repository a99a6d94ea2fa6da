"""faucet_postgres: PostgreSQL through psycopg 3 (asyncio).

Registered as the ``postgres`` connector (``faucet.connectors`` entry point). Roles: a bounded source
(:mod:`faucet_postgres.source`, a server-side cursor in (cursor, key) order) and a bounded sink
(:mod:`faucet_postgres.sink`, COPY, upsert, delete, replace, commit-token watermark), a change
source (:mod:`faucet_postgres.cdc`, logical replication through pgoutput, in commit order with
transaction boundaries; :func:`faucet_postgres.cdc.setup_replication` creates its slot). Pieces every
PostgreSQL role shares live in :mod:`faucet_postgres.common`. Building a role does no I/O and imports
no driver: the factories import their module when called.
"""

from typing import TYPE_CHECKING

from faucet_dagster.protocol import ConnectorRole, ConnectorSpec, Role
from faucet_postgres.cdc_config import PostgresCdcConfig
from faucet_postgres.config import (
    PostgresConnection,
    PostgresSinkConfig,
    PostgresSourceConfig,
    PostgresStreamingSinkConfig,
)

if TYPE_CHECKING:
    from faucet_postgres.cdc import PostgresCdcSource
    from faucet_postgres.sink import PostgresSink
    from faucet_postgres.source import PostgresSource
    from faucet_postgres.stream_sink import PostgresStreamingSink


def _source(config: PostgresSourceConfig) -> "PostgresSource":
    from faucet_postgres.source import PostgresSource

    return PostgresSource(config)


def _sink(config: PostgresSinkConfig) -> "PostgresSink":
    from faucet_postgres.sink import PostgresSink

    return PostgresSink(config)


def _streaming_sink(config: PostgresStreamingSinkConfig) -> "PostgresStreamingSink":
    from faucet_postgres.stream_sink import PostgresStreamingSink

    return PostgresStreamingSink(config)


def _stream_source(config: PostgresCdcConfig) -> "PostgresCdcSource":
    from faucet_postgres.cdc import PostgresCdcSource

    return PostgresCdcSource(config)


ROLES: dict[Role, ConnectorRole] = {
    Role.SOURCE: ConnectorRole(PostgresSourceConfig, _source),
    Role.SINK: ConnectorRole(PostgresSinkConfig, _sink),
    Role.STREAMING_SINK: ConnectorRole(PostgresStreamingSinkConfig, _streaming_sink),
    Role.STREAM_SOURCE: ConnectorRole(PostgresCdcConfig, _stream_source),
}
"""The roles of the ``postgres`` connector; the streaming roles add themselves here."""

CONNECTOR = ConnectorSpec(
    name="postgres",
    roles=ROLES,
    description="PostgreSQL: fast keyset reads; COPY-based append, upsert, delete, replace.",
    docs={"readme": "connectors/faucet_postgres/README.md"},
)

__all__ = [
    "CONNECTOR",
    "ROLES",
    "PostgresCdcConfig",
    "PostgresConnection",
    "PostgresSinkConfig",
    "PostgresSourceConfig",
    "PostgresStreamingSinkConfig",
]
