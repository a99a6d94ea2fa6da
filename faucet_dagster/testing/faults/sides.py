"""What the sides of a pair share: the record every source produces and where it was stored
(:class:`Produced`), the servers of a run, the harness's settings for its targets.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
from nats.js.client import JetStreamContext

from faucet_dagster.testing.servers import KafkaServer, NatsServer, PostgresServer

T = TypeVar("T")

Key = tuple[str, int]
"""A record's identity for the oracle: (producer id, sequence)."""

Row = dict[str, Any]
"""A table row by column name: what a change source's table and its replica are compared by."""

RECORD_COLUMNS = {"id": "int64 not null", "producer": "string", "seq": "int64 not null"}
KAFKA_PARTITIONS = 3
CHANGES_TABLE = "public.records"
"""The table a change source's case writes to (in a database of its own) and the stream reads."""
EXTRA_KEYS = 1_000_000
"""Sequences of rows a change workload inserts and deletes again (never in the final state)."""
MOVED_KEYS = 10_000_000
"""What a change workload adds to a sequence to re-key a row for a moment (above every extra key)."""
NATS_DUPLICATE_WINDOW = 120.0
"""Seconds the NATS target streams deduplicate message ids: longer than any harness run."""
STREAM_SINK_TIMEOUTS = {"lock_timeout": 1.0, "idle_in_transaction_session_timeout": 4.0}
"""The PostgreSQL streaming sink's timeouts in the harness, whose leases last 2 s (defaults: 10 s and
120 s, the default lease). A zombie's open epoch transaction ends 4 s after it froze, about when its
successor starts (the lease plus a process start later), and the successor's lock waits on it fail
retryably after 1 s each and are retried. 4 s, not the lease: it must exceed every pause between the
sink's statements inside an epoch, a consumer group's join included."""


KAFKA_PURGE = (
    "the Tansu test broker implements neither DeleteRecords (it drops the connection) nor topic "
    "retention settings (AlterConfigs is unsupported), so no Kafka position can be purged; the "
    "source's low-watermark check (PositionUnavailable) is not exercised end to end here"
)
"""Why the harness does not purge Kafka positions."""


@dataclass(frozen=True)
class Produced:
    """One record a source stored: its key and its position (``-1``: the source has none)."""

    producer: str
    seq: int
    resource: str
    partition: str
    position: int

    @property
    def key(self) -> Key:
        return (self.producer, self.seq)


@dataclass(frozen=True)
class Servers:
    """The servers a harness run uses (managed, so they can be restarted) and the PostgreSQL
    database the sinks write to."""

    postgres: PostgresServer
    nats: NatsServer
    kafka: KafkaServer
    database_url: str

    def server(self, name: str) -> PostgresServer | NatsServer | KafkaServer:
        found: PostgresServer | NatsServer | KafkaServer = getattr(self, name)
        return found


def run_blocking(factory: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await factory()

    return asyncio.run(main())


@asynccontextmanager
async def jetstream(url: str, **options: Any) -> AsyncIterator[JetStreamContext]:
    """A JetStream context on a connection of its own, closed on exit."""
    client = await nats.connect(url)
    try:
        yield client.jetstream(**options)
    finally:
        await client.close()


def record_payload(producer: str, seq: int, first_id: int) -> bytes:
    return json.dumps({"id": first_id + seq, "producer": producer, "seq": seq}).encode()
