"""The source sides of the pairs (see :mod:`.pairs`): NATS JetStream, Kafka, files, and PostgreSQL tables
read by change data capture (keyed, with a snapshot, unkeyed).
"""

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import psycopg
from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from nats.js.api import PubAck
from psycopg.rows import dict_row

from faucet_dagster.runner.replication import setup_change_source
from faucet_dagster.testing.faults import cdc_variants
from faucet_dagster.testing.faults.sides import (
    CHANGES_TABLE,
    EXTRA_KEYS,
    KAFKA_PARTITIONS,
    MOVED_KEYS,
    RECORD_COLUMNS,
    Key,
    Produced,
    Row,
    Servers,
    jetstream,
    record_payload,
    run_blocking,
)
from faucet_dagster.testing.faults.spec import Target


class SourceSide(ABC):
    """One source of one case: named ``name``, in ``workdir`` when it needs files."""

    connector: ClassVar[str]
    label: ClassVar[str]
    servers_used: ClassVar[tuple[str, ...]]
    transactions: ClassVar[bool] = False
    """True when the source delivers its records in transactions an epoch never cuts, written to the
    sink in batches before the transaction's end is read: a fault can land inside one."""

    def __init__(self, servers: Servers, name: str, workdir: Path) -> None:
        self.servers = servers
        self.name = name
        self.workdir = workdir

    @abstractmethod
    def create(self) -> None:
        """Create the stream, topic or directory (empty)."""

    @abstractmethod
    def produce(self, producer: str, count: int, first_id: int) -> list[Produced]:
        """Store ``count`` records of ``producer`` (sequences 0..count-1); return where they went."""

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The connector config a user would write."""

    def resources(self) -> tuple[str, ...]:
        return (self.name,)

    def state(self) -> dict[Key, Row] | None:
        """What the destination must equal at the end, row by row by key, for a source of changes;
        None for a source of records (judged record by record against what was produced)."""
        return None

    def drop(self) -> None:
        """Remove what the source holds on the servers beyond its case (a replication slot keeps
        WAL and one of the server's few slots for good); called when the case ends."""

    def delete(self) -> None:
        """Delete the source (while a worker may be reading it)."""
        raise NotImplementedError(f"a {self.label} source is not deleted by this harness")

    def recreate(self) -> None:
        """Delete the source and create it again, empty (a new incarnation)."""
        raise NotImplementedError(f"a {self.label} source is not recreated by this harness")

    def change_existing(self, producer: str) -> list[Produced]:
        """Delete and update records of ``producer`` already stored (a source of changes)."""
        raise NotImplementedError(f"a {self.label} source does not change what it stored")

    def purge(self, keep_from: int) -> None:
        """Remove every record before position ``keep_from`` (retention)."""
        raise NotImplementedError(f"a {self.label} source has no retention this harness can trigger")

    def targets(self, produced: Sequence[Produced]) -> tuple[Target, ...]:
        """The last position of every domain ``produced`` touched: where coverage must reach."""
        last: dict[tuple[str, str], int] = {}
        for item in produced:
            where = (item.resource, item.partition)
            last[where] = max(last.get(where, -1), item.position)
        return tuple(
            Target(resource, partition, position) for (resource, partition), position in last.items()
        )


class NatsSource(SourceSide):
    """A JetStream stream ``name`` (subjects ``name.>``) read by the NATS stream source."""

    connector = "nats"
    label = "NATS"
    servers_used = ("nats",)

    def create(self) -> None:
        async def create() -> None:
            async with jetstream(self.servers.nats.url) as js:
                await js.add_stream(name=self.name, subjects=[f"{self.name}.>"])

        run_blocking(create)

    def produce(self, producer: str, count: int, first_id: int) -> list[Produced]:
        async def publish() -> list[PubAck]:
            async with jetstream(self.servers.nats.url, publish_async_max_pending=4_000) as js:
                futures = [
                    await js.publish_async(f"{self.name}.records", record_payload(producer, seq, first_id))
                    for seq in range(count)
                ]
                return list(await asyncio.gather(*futures))

        acks = run_blocking(publish)
        return [Produced(producer, seq, self.name, "", ack.seq) for seq, ack in enumerate(acks)]

    def config(self) -> dict[str, Any]:
        return {
            "servers": [self.servers.nats.url],
            "stream": self.name,
            "columns": RECORD_COLUMNS,
            "idle_heartbeat": 0.5,
            "request_timeout": 2.0,
        }

    def recreate(self) -> None:
        async def recreate() -> None:
            async with jetstream(self.servers.nats.url) as js:
                await js.delete_stream(self.name)
                await js.add_stream(name=self.name, subjects=[f"{self.name}.>"])

        run_blocking(recreate)

    def purge(self, keep_from: int) -> None:
        async def purge() -> None:
            async with jetstream(self.servers.nats.url) as js:
                await js.purge_stream(self.name, seq=keep_from)

        run_blocking(purge)


class KafkaSource(SourceSide):
    """A topic ``name`` of ``partitions`` (:data:`KAFKA_PARTITIONS`) partitions read by the Kafka source."""

    connector = "kafka"
    label = "Kafka"
    servers_used = ("kafka",)
    partitions = KAFKA_PARTITIONS

    def _admin(self) -> AdminClient:
        return AdminClient({"bootstrap.servers": self.servers.kafka.bootstrap, "log_level": 2})

    def create(self) -> None:
        admin = self._admin()  # held until the result: a collected client cancels its requests
        admin.create_topics([NewTopic(self.name, self.partitions, 1)])[self.name].result(timeout=30)

    def produce(self, producer: str, count: int, first_id: int) -> list[Produced]:
        stored: dict[int, tuple[int, int]] = {}
        failures: list[KafkaError] = []

        def delivered(error: KafkaError | None, message: Message) -> None:
            if error is not None:
                failures.append(error)
                return
            seq = int((message.key() or b"0").decode())
            stored[seq] = (message.partition() or 0, message.offset() or 0)

        client = Producer(
            {
                "bootstrap.servers": self.servers.kafka.bootstrap,
                "linger.ms": 10,
                "enable.idempotence": True,
                "log_level": 2,
            }
        )
        for seq in range(count):
            while True:
                try:
                    client.produce(
                        self.name,
                        record_payload(producer, seq, first_id),
                        key=str(seq).encode(),
                        partition=seq % self.partitions,
                        on_delivery=delivered,
                    )
                    break
                except BufferError:
                    client.poll(0.05)
        if client.flush(60) != 0 or failures or len(stored) != count:
            raise KafkaException(failures[0] if failures else KafkaError(KafkaError._MSG_TIMED_OUT))
        return [
            Produced(producer, seq, self.name, str(partition), offset)
            for seq, (partition, offset) in sorted(stored.items())
        ]

    def config(self) -> dict[str, Any]:
        return {
            "bootstrap_servers": self.servers.kafka.bootstrap,
            "topics": [self.name],
            "group_id": f"g_{self.name}",
            "request_timeout": 5.0,
            "poll_timeout": 0.2,
        }

    def delete(self) -> None:
        admin = self._admin()
        admin.delete_topics([self.name])[self.name].result(timeout=30)

    def recreate(self) -> None:
        admin = self._admin()
        admin.delete_topics([self.name])[self.name].result(timeout=30)
        deadline = time.monotonic() + 30
        while True:
            try:
                admin.create_topics([NewTopic(self.name, self.partitions, 1)])[self.name].result(timeout=30)
                return
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # the deletion is still being applied


class FilesSource(SourceSide):
    """A directory of JSON-lines files, one per producer, read by the files source (bounded)."""

    connector = "files"
    label = "files"
    servers_used = ()

    @property
    def directory(self) -> Path:
        return self.workdir / self.name

    def create(self) -> None:
        self.directory.mkdir(parents=True)

    def produce(self, producer: str, count: int, first_id: int) -> list[Produced]:
        lines = b"\n".join(record_payload(producer, seq, first_id) for seq in range(count))
        (self.directory / f"{producer}.jsonl").write_bytes(lines + b"\n")
        return [Produced(producer, seq, self.name, producer, seq) for seq in range(count)]

    def config(self) -> dict[str, Any]:
        return {
            "paths": [str(self.directory / "*.jsonl")],
            "column_types": {"id": "int64", "producer": "string", "seq": "int64"},
        }

    def resources(self) -> tuple[str, ...]:
        return ()


class PostgresChangesSource(SourceSide):
    """Table :data:`CHANGES_TABLE` of a database ``name`` of its own (dropped with the case, slot and
    publication included), read through slot ``name`` by the PostgreSQL change source.

    The slot and publication are made by the change source's own setup (``faucet cdc setup``).
    :meth:`produce` writes transactions of inserts, updates, deletes, deletes followed by inserts of
    the same key, and key changes (a delete and an insert at the destination); the first and the last
    transactions are large (hundreds of rows, written to the sink in several batches). Each change's
    :class:`Produced` position is the WAL insert position read inside its transaction just before
    the commit: at most the commit LSN the source certifies, and above every earlier commit's.
    """

    connector = "postgres"
    label = "PostgreSQL CDC"
    servers_used = ("postgres",)
    transactions = True

    @property
    def url(self) -> str:
        return self.servers.postgres.database_url(self.name)

    def create(self) -> None:
        self.servers.postgres.create_database(self.name)
        with psycopg.connect(self.url, connect_timeout=10) as conn:
            conn.execute(
                f"CREATE TABLE {CHANGES_TABLE} (producer text, seq bigint, id bigint NOT NULL, "
                "version int NOT NULL, note text NOT NULL, PRIMARY KEY (producer, seq))"
            )
        setup_change_source(self.connector, self.config())

    def produce(self, producer: str, count: int, first_id: int) -> list[Produced]:
        """Leave rows ``0..count-1`` of ``producer`` in the table, through every kind of change: the
        first half inserted in one transaction; the rest in transactions of 25 rows, each also
        re-keying some of its rows (to a temporary key and back), deleting the row the previous one
        added under an extra key and adding another, updating the first half's rows ``seq % 40 = n``,
        and deleting a row of the first half and inserting it again; then one transaction updating
        every third row and deleting the last extra row."""
        half, chunk = count // 2, 25
        table = CHANGES_TABLE
        insert = (
            f"INSERT INTO {table} SELECT %s, g, %s::bigint + g, 0, 'new' "
            "FROM generate_series(%s::bigint, %s::bigint) AS g"
        )
        delete = f"DELETE FROM {table} WHERE producer = %s AND seq = %s"
        produced: list[Produced] = []
        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:

            def transaction(keys: Iterable[int], *statements: tuple[str, tuple[Any, ...]]) -> None:
                with conn.transaction():
                    for statement, params in statements:
                        conn.execute(statement, params)
                    row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
                assert row is not None  # a SELECT without FROM returns one row
                produced.extend(Produced(producer, seq, self.name, "", int(row[0])) for seq in keys)

            transaction(range(half), (insert, (producer, first_id, 0, half - 1)))
            doomed: list[int] = []
            for step, start in enumerate(range(half, count, chunk)):
                end = min(start + chunk, count)
                moved = [seq for seq in range(start, end) if seq % 10 == 7]
                reborn = step * 13 % half if half else start
                updated = range(step % 40, half, 40)
                doomed.append(EXTRA_KEYS + start)
                transaction(
                    [*range(start, end), *doomed[-2:], reborn, *updated],
                    (insert, (producer, first_id, start, end - 1)),
                    (
                        f"UPDATE {table} SET seq = seq + %s WHERE producer = %s AND seq = ANY(%s)",
                        (MOVED_KEYS, producer, moved),
                    ),
                    (
                        f"UPDATE {table} SET seq = seq - %s WHERE producer = %s AND seq >= %s",
                        (MOVED_KEYS, producer, MOVED_KEYS),
                    ),
                    (insert, (producer, first_id, doomed[-1], doomed[-1])),
                    (delete, (producer, doomed[-2] if len(doomed) > 1 else -1)),
                    (
                        f"UPDATE {table} SET version = version + 1, note = 'updated' "
                        "WHERE producer = %s AND seq < %s AND seq %% 40 = %s",
                        (producer, half, step % 40),
                    ),
                    (delete, (producer, reborn)),
                    (
                        f"INSERT INTO {table} VALUES (%s, %s, %s, 100, 'reborn')",
                        (producer, reborn, first_id + reborn),
                    ),
                )
            transaction(
                [*range(0, count, 3), *doomed[-1:]],
                (
                    f"UPDATE {table} SET version = version + 1, note = 'final' "
                    "WHERE producer = %s AND seq < %s AND seq %% 3 = 0",
                    (producer, count),
                ),
                (f"DELETE FROM {table} WHERE producer = %s AND seq >= %s", (producer, EXTRA_KEYS)),
            )
        return produced

    def config(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "slot": self.name,
            "publication": f"{self.name}_pub",
            "tables": [CHANGES_TABLE],
            "heartbeat_interval": 0,
            "poll_interval": 0.05,
            # Small pieces: a large transaction reaches the sink in several batches.
            "batch_rows": 100,
        }

    def resources(self) -> tuple[str, ...]:
        return (CHANGES_TABLE,)

    def state(self) -> dict[Key, Row]:
        return dict(self.keyed_rows())

    def keyed_rows(self) -> list[tuple[Key, Row]]:
        with psycopg.connect(self.url, connect_timeout=10, row_factory=dict_row) as conn:
            rows = conn.execute(f"SELECT * FROM {CHANGES_TABLE}").fetchall()
        return [((str(row["producer"]), int(row["seq"])), row) for row in rows]

    def drop(self) -> None:
        self.servers.postgres.drop_database(self.name)


class PostgresSnapshotChangesSource(PostgresChangesSource):
    """:class:`PostgresChangesSource` with ``snapshot`` (see :mod:`.cdc_variants`)."""

    label = "PostgreSQL CDC snapshot"

    def config(self) -> dict[str, Any]:
        return {**super().config(), "snapshot": True}

    def change_existing(self, producer: str) -> list[Produced]:
        seqs, position = cdc_variants.change_existing(self.url, CHANGES_TABLE, producer)
        return [Produced(producer, seq, self.name, "", position) for seq in seqs]


class PostgresUnkeyedChangesSource(PostgresChangesSource):
    """:class:`PostgresChangesSource` on a table without a key, holding identical rows (see
    :mod:`.cdc_variants`)."""

    label = "PostgreSQL CDC no key"

    def create(self) -> None:
        self.servers.postgres.create_database(self.name)
        with psycopg.connect(self.url, connect_timeout=10) as conn:
            conn.execute(cdc_variants.UNKEYED_TABLE.format(table=CHANGES_TABLE))
        setup_change_source(self.connector, self.config())

    def config(self) -> dict[str, Any]:
        return {**super().config(), "replica_identity_full": True}

    def produce(self, producer: str, count: int, first_id: int) -> list[Produced]:
        produced = super().produce(producer, count, first_id)
        seqs, position = cdc_variants.duplicate_rows(self.url, CHANGES_TABLE, producer)
        return [*produced, *(Produced(producer, seq, self.name, "", position) for seq in seqs)]

    def state(self) -> dict[Key, Row]:
        return dict(cdc_variants.numbered(self.keyed_rows()))
