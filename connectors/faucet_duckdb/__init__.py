"""faucet_duckdb: DuckDB files, written from Arrow in one transaction per page or epoch.

Registered as the ``duckdb`` connector (``faucet.connectors`` entry point). Roles: a bounded source
(:mod:`faucet_duckdb.source`, keyset pages in (cursor, key) order), a bounded sink
(:mod:`faucet_duckdb.sink`, append, upsert, replace, the commit-token watermark in the page's
transaction) and a streaming sink (:mod:`faucet_duckdb.stream_sink`, one transaction per epoch with
its watermarks and owner fence). What every role shares (opening the file under DuckDB's one-writer
rule, errors, names, types) lives in :mod:`faucet_duckdb.database`. Building a role does no I/O and
imports no DuckDB: the factories import their module when called.
"""

from typing import TYPE_CHECKING

from faucet_dagster.protocol import ConnectorRole, ConnectorSpec, Role
from faucet_duckdb.config import (
    DuckDbConnection,
    DuckDbSinkConfig,
    DuckDbSourceConfig,
    DuckDbStreamingSinkConfig,
)

if TYPE_CHECKING:
    from faucet_duckdb.sink import DuckDbSink
    from faucet_duckdb.source import DuckDbSource
    from faucet_duckdb.stream_sink import DuckDbStreamingSink


def _source(config: DuckDbSourceConfig) -> "DuckDbSource":
    from faucet_duckdb.source import DuckDbSource

    return DuckDbSource(config)


def _sink(config: DuckDbSinkConfig) -> "DuckDbSink":
    from faucet_duckdb.sink import DuckDbSink

    return DuckDbSink(config)


def _streaming_sink(config: DuckDbStreamingSinkConfig) -> "DuckDbStreamingSink":
    from faucet_duckdb.stream_sink import DuckDbStreamingSink

    return DuckDbStreamingSink(config)


CONNECTOR = ConnectorSpec(
    name="duckdb",
    roles={
        Role.SOURCE: ConnectorRole(DuckDbSourceConfig, _source),
        Role.SINK: ConnectorRole(DuckDbSinkConfig, _sink),
        Role.STREAMING_SINK: ConnectorRole(DuckDbStreamingSinkConfig, _streaming_sink),
    },
    description="DuckDB files: keyset reads; Arrow appends, upserts and replaces in one transaction each.",
    docs={"readme": "connectors/faucet_duckdb/README.md"},
)

__all__ = [
    "CONNECTOR",
    "DuckDbConnection",
    "DuckDbSinkConfig",
    "DuckDbSourceConfig",
    "DuckDbStreamingSinkConfig",
]
