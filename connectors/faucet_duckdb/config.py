"""Configs of the DuckDB source, sink and streaming sink. Only pydantic and the protocol are imported here.

A DuckDB database is one file (``path``), opened in this process by the DuckDB library: there is no
server, URL or credential. DuckDB lets one process write a file at a time (and no other process read
it meanwhile); ``lock_timeout`` is how long a connector waits for another process (a notebook, a
Dagster IO manager, another run) to let go of the file before it fails with a typed error naming that
process (:class:`faucet_duckdb.database.DatabaseLocked`). An in-memory database (``:memory:``) is
refused: nobody else could ever read what was written there.
"""

from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from faucet_dagster.protocol import ConnectorConfig, check_write_key

DuckDbWriteMode = Literal["append", "upsert", "replace"]

DEFAULT_SCHEMA = "main"


class DuckDbConnection(ConnectorConfig):
    """Where the database is: a DuckDB file, and how long to wait for another process holding it."""

    path: str = Field(min_length=1, description="The DuckDB database file (created by a sink when missing).")
    lock_timeout: float = Field(
        default=30.0,
        ge=0,
        description="Seconds to wait for another process to release the file before failing.",
    )

    @field_validator("path")
    @classmethod
    def _a_file(cls, path: str) -> str:
        if path.strip() in (":memory:", "") or path.startswith(":memory:"):
            raise ValueError("an in-memory DuckDB database cannot be read by anyone else: use a file path")
        if path.startswith(("md:", "motherduck:")):
            raise ValueError("MotherDuck is not supported: use a local DuckDB file path")
        return path


class DuckDbTable(DuckDbConnection):
    """A table: ``table`` in ``schema_name`` (DuckDB's default schema ``main`` when unset)."""

    table: str = Field(min_length=1)
    schema_name: str = Field(default=DEFAULT_SCHEMA, min_length=1)


class DuckDbSourceConfig(DuckDbTable):
    """An incremental read of one table in ascending ``(cursor, key)`` order.

    ``cursor`` is the column that grows as rows are added or changed (``updated_at``, an id); rows
    whose cursor is NULL are not read. ``key`` breaks ties between rows sharing a cursor value and must
    be unique with it; empty means the table's primary key. Without a cursor the table is read in key
    order. ``columns`` reads only those columns (empty: all).
    """

    cursor: str | None = None
    key: list[str] = Field(default_factory=list)
    columns: list[str] | None = None


class DuckDbSinkConfig(DuckDbTable):
    """A table written by ``mode``: append, upsert (by ``key``) or replace (staged, swapped at finish).

    The table is created from the first batch's Arrow schema when missing (with ``key`` as its primary
    key in upsert mode). ``schema_evolution`` adds a column the table lacks (``ADD COLUMN IF NOT
    EXISTS``); off, such a column raises SchemaError. The commit-token watermark lives in
    ``watermark_table`` (same schema as the table), one row per ``sync_id`` (default: the qualified
    table name).
    """

    mode: DuckDbWriteMode = "append"
    key: list[str] = Field(default_factory=list)
    schema_evolution: bool = True
    sync_id: str | None = Field(default=None, min_length=1)
    watermark_table: str = Field(default="_faucet_watermarks", min_length=1)

    @model_validator(mode="after")
    def _key_for_upsert(self) -> Self:
        check_write_key(self.mode, self.key)
        return self

    def watermark_scope(self) -> str:
        """The ``sync_id`` keying this sink's watermark row."""
        return self.sync_id if self.sync_id is not None else f"{self.schema_name}.{self.table}"


class DuckDbStreamingSinkConfig(DuckDbConnection):
    """Where a continuous stream's epochs land: one DuckDB transaction per epoch.

    A resource goes to ``tables[resource]``, else ``table``, else a table named like the resource, in
    ``schema_name``; a missing table is created from the first batch's Arrow schema (the key as its
    primary key for UPSERT). ``schema_evolution`` adds columns the table lacks; off, they raise
    SchemaError. The stream's owner fence and last committed epoch (``epochs_table``, one row per
    stream) and its per-domain watermarks (``watermarks_table``) live in the same file and schema,
    written in the epoch's transaction.
    """

    table: str | None = Field(default=None, min_length=1)
    tables: dict[str, str] = Field(default_factory=dict)
    schema_name: str = Field(default=DEFAULT_SCHEMA, min_length=1)
    schema_evolution: bool = True
    epochs_table: str = Field(default="_faucet_stream_epochs", min_length=1)
    watermarks_table: str = Field(default="_faucet_stream_watermarks", min_length=1)

    def table_for(self, resource: str) -> str:
        return self.tables.get(resource) or self.table or resource


__all__ = [
    "DEFAULT_SCHEMA",
    "DuckDbConnection",
    "DuckDbSinkConfig",
    "DuckDbSourceConfig",
    "DuckDbStreamingSinkConfig",
    "DuckDbTable",
    "DuckDbWriteMode",
]
