"""The sink sides of the pairs (see :mod:`.pairs`): PostgreSQL (bounded, streaming, multiset) and NATS
JetStream.
"""

import asyncio
import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import psycopg
from psycopg.rows import dict_row

from faucet_dagster.testing.faults import cdc_variants
from faucet_dagster.testing.faults.sides import (
    NATS_DUPLICATE_WINDOW,
    STREAM_SINK_TIMEOUTS,
    Key,
    Row,
    Servers,
    jetstream,
    run_blocking,
)


class SinkSide(ABC):
    """One destination of one case."""

    connector: ClassVar[str]
    label: ClassVar[str]
    servers_used: ClassVar[tuple[str, ...]]

    def __init__(self, servers: Servers, name: str) -> None:
        self.servers = servers
        self.name = name

    def create(self) -> None:
        """Create what the sink needs but does not create itself."""

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The connector config a user would write."""

    @abstractmethod
    def read(self) -> list[Key]:
        """Every record the destination holds, as keys, duplicates included."""

    def rows(self) -> list[tuple[Key, Row]]:
        """Every row the destination holds, with its key, duplicates included (for a source of
        changes, whose replica is judged by its state)."""
        raise NotImplementedError(f"a {self.label} destination is judged record by record")


class PostgresSinkSide(SinkSide):
    """Table ``<name>_rows`` in the harness database (created by the sink)."""

    connector = "postgres"
    label = "PostgreSQL"
    servers_used = ("postgres",)

    @property
    def table(self) -> str:
        return f"{self.name}_rows"

    def config(self) -> dict[str, Any]:
        return {"url": self.servers.database_url, "table": self.table}

    def read(self) -> list[Key]:
        return [key for key, _ in self.rows()]

    def rows(self) -> list[tuple[Key, Row]]:
        with psycopg.connect(self.servers.database_url, connect_timeout=10, row_factory=dict_row) as conn:
            exists = conn.execute("SELECT to_regclass(%s) AS found", (self.table,)).fetchone()
            if exists is None or exists["found"] is None:
                return []
            rows = conn.execute(f'SELECT * FROM "{self.table}"').fetchall()
        return [((str(row["producer"]), int(row["seq"])), row) for row in rows]


class PostgresStreamSinkSide(PostgresSinkSide):
    """:class:`PostgresSinkSide` for a continuous stream: its epoch transactions bounded by
    :data:`STREAM_SINK_TIMEOUTS`, fitted to the harness's short leases; each row stamped with the
    epoch that wrote it (``epoch_column``), so ``faucet verify`` checks each event is there once."""

    def config(self) -> dict[str, Any]:
        return {**super().config(), **STREAM_SINK_TIMEOUTS, "epoch_column": "_faucet_epoch"}


class PostgresMultisetSinkSide(PostgresStreamSinkSide):
    """:class:`PostgresStreamSinkSide` judged as a multiset, identical rows distinct (for
    :class:`PostgresUnkeyedChangesSource`)."""

    def rows(self) -> list[tuple[Key, Row]]:
        return cdc_variants.numbered(super().rows())


class NatsSinkSide(SinkSide):
    """Stream ``<name>_out`` (subject ``<name>_out.rows``) deduplicating within
    :data:`NATS_DUPLICATE_WINDOW`, written by the NATS sink."""

    connector = "nats"
    label = "NATS"
    servers_used = ("nats",)

    window = NATS_DUPLICATE_WINDOW
    """The stream's duplicate window (seconds): :meth:`use_window` shortens it for one case."""

    @property
    def stream(self) -> str:
        return f"{self.name}_out"

    def create(self) -> None:
        async def create() -> None:
            async with jetstream(self.servers.nats.url) as js:
                await js.add_stream(
                    name=self.stream, subjects=[f"{self.stream}.rows"], duplicate_window=self.window
                )

        run_blocking(create)

    def use_window(self, seconds: float) -> None:
        """Create the (still empty) stream again with a duplicate window of ``seconds``: a case that
        must outlast the window (a replay after it would duplicate) without waiting minutes."""

        async def drop() -> None:
            async with jetstream(self.servers.nats.url) as js:
                await js.delete_stream(self.stream)

        run_blocking(drop)
        self.window = seconds
        self.create()

    def config(self) -> dict[str, Any]:
        return {
            "servers": [self.servers.nats.url],
            "stream": self.stream,
            "subject": f"{self.stream}.rows",
            "duplicate_window": self.window,
            "watermark_bucket": f"w_{self.stream}",
            "ack_timeout": 10.0,
            "request_timeout": 2.0,
        }

    def read(self) -> list[Key]:
        async def read() -> list[Key]:
            async with jetstream(self.servers.nats.url) as js:
                state = (await js.stream_info(self.stream)).state
                if not state.messages:
                    return []
                keys: list[Key] = []
                sequences = range(state.first_seq, state.last_seq + 1)
                for start in range(0, len(sequences), 500):
                    batch = sequences[start : start + 500]
                    messages = await asyncio.gather(*(js.get_msg(self.stream, seq) for seq in batch))
                    for message in messages:
                        row = json.loads(message.data or b"{}")
                        keys.append((str(row["producer"]), int(row["seq"])))
                return keys

        return run_blocking(read)
