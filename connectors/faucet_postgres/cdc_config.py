"""Configuration of the PostgreSQL change source (no psycopg import: capabilities are read offline)."""

import re

from pydantic import Field, field_validator

from faucet_postgres.config import PostgresConnection

HEARTBEAT_PREFIX = "faucet-heartbeat"
"""The prefix of the logical messages the source writes to move an idle slot forward."""

MARKER_TABLE = "faucet_cdc_slots"
"""The table, in ``metadata_schema``, that records each slot's incarnation when it is created."""

_SLOT_NAME = re.compile(r"[a-z0-9_]{1,63}")


class PostgresCdcConfig(PostgresConnection):
    """A change stream read from logical replication slot ``slot`` through publication ``publication``.

    ``tables`` (``schema.table``) are the tables :func:`faucet_postgres.cdc.setup_replication` puts in
    the publication, and the resources a stream reads when the runner selects none. The slot must
    have been created by ``setup_replication``, which records its incarnation in
    ``metadata_schema.faucet_cdc_slots``.

    ``snapshot``: when a stream has no certified position yet, its first read delivers every row of
    its tables at one consistent point taken then (as inserts, one source transaction), then the
    changes committed after that point: no gap, no overlap. ``stop_at_open``: a bounded read: the
    session delivers what was committed before it opened (with ``snapshot``: the snapshot alone,
    whose point is later), then reports ``exhausted``.

    ``heartbeat_interval``: when the stream has had no safe boundary for this many seconds, a read that
    finds nothing writes a small logical message whose commit becomes a progress boundary, so an idle
    database's slot can be acknowledged forward instead of holding WAL (0 turns it off).
    """

    slot: str
    publication: str = Field(min_length=1, max_length=63)
    tables: tuple[str, ...] = ()
    snapshot: bool = False
    stop_at_open: bool = False
    metadata_schema: str = Field(default="public", min_length=1, max_length=63)
    heartbeat_interval: float = Field(default=10.0, ge=0)
    poll_interval: float = Field(default=0.5, gt=0)
    """The longest pause between two reads of the slot that found nothing."""
    changes_per_call: int = Field(default=100_000, ge=1)
    """The target number of pgoutput messages decoded per server call (a transaction is never cut). A
    read still ends at the first transaction end after its limits, inside a call."""
    batch_rows: int = Field(default=10_000, ge=1)
    """Rows buffered (of the complete transactions of a group and the open one) before they are written
    to the pipeline."""
    replica_identity_full: bool = False
    """Setup only: a table without a primary key (or replica identity) gets REPLICA IDENTITY FULL
    instead of being refused (its rows are then replicated as a multiset)."""

    @field_validator("slot")
    @classmethod
    def _slot_name(cls, slot: str) -> str:
        if not _SLOT_NAME.fullmatch(slot):
            raise ValueError("a replication slot name is 1 to 63 of a-z, 0-9 and _")
        return slot

    @field_validator("tables")
    @classmethod
    def _qualified_tables(cls, tables: tuple[str, ...]) -> tuple[str, ...]:
        for table in tables:
            qualified_name(table)
        if len(set(tables)) != len(tables):
            raise ValueError("tables must be distinct")
        return tables


def qualified_name(table: str) -> tuple[str, str]:
    """Split ``schema.table`` at its first dot; raises ValueError for anything else."""
    schema, dot, name = table.partition(".")
    if not (schema and dot and name):
        raise ValueError(f"{table!r} is not schema.table")
    return schema, name
