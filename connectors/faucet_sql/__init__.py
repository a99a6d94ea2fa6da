"""faucet_sql: a bounded source and sink for any SQLAlchemy database (SQLite is the embedded default).

Registered as the ``sql`` connector (``faucet.connectors`` entry point). Building either role does no
I/O and does not import SQLAlchemy's engine machinery; see :mod:`faucet_sql.source` and
:mod:`faucet_sql.sink` for order, bookmarks, write modes and the watermark.
"""

from typing import TYPE_CHECKING

from faucet_dagster.protocol import ConnectorRole, ConnectorSpec, Role
from faucet_sql.config import SqlSinkConfig, SqlSourceConfig

if TYPE_CHECKING:
    from faucet_sql.sink import SqlSink
    from faucet_sql.source import SqlSource


def _source(config: SqlSourceConfig) -> "SqlSource":
    from faucet_sql.source import SqlSource

    return SqlSource(config)


def _sink(config: SqlSinkConfig) -> "SqlSink":
    from faucet_sql.sink import SqlSink

    return SqlSink(config)


CONNECTOR = ConnectorSpec(
    name="sql",
    roles={
        Role.SOURCE: ConnectorRole(SqlSourceConfig, _source),
        Role.SINK: ConnectorRole(SqlSinkConfig, _sink),
    },
    description="Any SQLAlchemy database: incremental keyset reads; append, upsert and replace writes.",
    docs={"readme": "connectors/faucet_sql/README.md"},
)

__all__ = ["CONNECTOR", "SqlSinkConfig", "SqlSourceConfig"]
