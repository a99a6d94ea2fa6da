"""Config factories for the connectors of this repository, against the real test servers.

Each factory creates what its connector needs on the server (a database table, a replication slot, a
JetStream stream, a Kafka topic, a directory of files), starting empty, and returns the setup with the
hooks the battery uses: add rows the way real data arrives, read a destination back through the
system's own client, a config whose endpoint does not answer, a record the source cannot turn into a
row, and the provider's acknowledgement state. :data:`TARGETS` lists them by connector and role, with
the options each needs (``faucet conformance --all`` runs exactly these).

Client libraries (psycopg, nats-py, confluent-kafka) are imported inside the factories.
"""

import asyncio
import contextlib
import csv
import json
import os
import signal
import socket
import sqlite3
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from faucet_dagster.conformance.options import DEFAULT_OPTIONS, ConformanceOptions
from faucet_dagster.conformance.setup import ConfigFactory, Row, SinkSetup, SourceSetup
from faucet_dagster.protocol import Role, WritePolicy
from faucet_dagster.testing import NatsServer

T = TypeVar("T")

NAME_LIMIT = 40
"""The destinations the battery writes to refuse a ``name`` longer than this (a row-level refusal)."""


def closed_port() -> int:
    """A loopback TCP port nothing listens on (it was free a moment ago)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _run(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run setup work from a synchronous factory (pytest fixtures and the CLI call them outside a loop)."""
    return asyncio.run(factory())


def _refused_rows() -> list[dict[str, Any]]:
    return [{"id": 900_001, "name": "fits"}, {"id": 900_002, "name": "x" * (NAME_LIMIT * 50)}]


# -- files ------------------------------------------------------------------------------------------


def files_source(tmp_path: Path) -> SourceSetup:
    """CSV files ``part-NNNNN.csv`` in a fresh folder, one file per ``add_rows``, a shard per file."""
    folder = tmp_path / "files_source"
    folder.mkdir()
    written = [0]

    def write(name: str, lines: Sequence[Sequence[object]]) -> None:
        with open(folder / name, "w", newline="") as handle:
            csv.writer(handle).writerows([("id", "name"), *lines])

    write("part-00000.csv", [])  # an empty dataset is an empty file, not a missing one

    async def add_rows(rows: Sequence[Row]) -> None:
        written[0] += 1
        await asyncio.to_thread(
            write, f"part-{written[0]:05d}.csv", [(row["id"], row["name"]) for row in rows]
        )

    async def add_malformed() -> None:
        await asyncio.to_thread(write, "part-99999.csv", [("not-a-number", "bad")])

    config = {
        "paths": [str(folder / "part-*.csv")],
        "column_types": {"id": "int64", "name": "string"},
        "block_size": 4096,
        "shard_by_file": True,
    }
    return SourceSetup(
        config,
        add_rows,
        unreachable={**config, "paths": [str(tmp_path / "missing" / "*.csv")]},
        add_malformed=add_malformed,
    )


# -- sql (SQLite) -----------------------------------------------------------------------------------


def _sqlite(path: Path, *statements: str, rows: Sequence[Sequence[object]] = ()) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as conn:
        found: list[tuple[Any, ...]] = []
        for statement in statements:
            found = (
                conn.executemany(statement, rows).fetchall() if rows else conn.execute(statement).fetchall()
            )
        return found


def _unreachable_url() -> str:
    return f"postgresql://conformance@127.0.0.1:{closed_port()}/conformance"


def sql_source(tmp_path: Path) -> SourceSetup:
    """A SQLite table ``items`` read in primary-key order."""
    path = tmp_path / "source.db"
    _sqlite(path, "CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT)")

    async def add_rows(rows: Sequence[Row]) -> None:
        values = [(row["id"], row["name"]) for row in rows]
        await asyncio.to_thread(_sqlite, path, "INSERT INTO items VALUES (?, ?)", rows=values)

    async def add_malformed() -> None:
        # SQLite keeps a BLOB in a TEXT column as it is: invalid UTF-8 has no Arrow string form.
        await asyncio.to_thread(_sqlite, path, "INSERT INTO items VALUES (999999, X'FFFE')")

    config = {"url": f"sqlite:///{path}", "table": "items"}
    return SourceSetup(
        config, add_rows, unreachable={**config, "url": _unreachable_url()}, add_malformed=add_malformed
    )


def _with_mode(config: Mapping[str, Any]) -> Callable[[WritePolicy, tuple[str, ...]], dict[str, Any]]:
    """``configure`` of a sink whose config has ``mode`` and ``key`` fields."""

    def configure(policy: WritePolicy, key: tuple[str, ...]) -> dict[str, Any]:
        return {**config, "mode": policy.value, "key": list(key)}

    return configure


def sql_sink(tmp_path: Path) -> SinkSetup:
    """A SQLite table ``items`` appended to (watermarked); ``items_keyed`` upserted by ``id``."""
    path = tmp_path / "sink.db"
    _sqlite(path, f"CREATE TABLE items (id INTEGER NOT NULL, name TEXT CHECK (length(name) <= {NAME_LIMIT}))")

    def reader(table: str) -> Callable[[], Coroutine[Any, Any, list[dict[str, Any]]]]:
        async def read_back() -> list[dict[str, Any]]:
            if not await asyncio.to_thread(
                _sqlite, path, f"SELECT name FROM sqlite_master WHERE type = 'table' AND name = '{table}'"
            ):
                return []
            found = await asyncio.to_thread(_sqlite, path, f"SELECT id, name FROM {table}")
            return [{"id": row[0], "name": row[1]} for row in found]

        return read_back

    url = f"sqlite:///{path}"
    return SinkSetup(
        {"url": url, "table": "items", "mode": "append"},
        reader("items"),
        keyed_config={"url": url, "table": "items_keyed", "mode": "upsert", "key": ["id"]},
        read_keyed=reader("items_keyed"),
        refused_rows=_refused_rows(),
        unreachable={"url": _unreachable_url(), "table": "items", "mode": "append"},
        configure=_with_mode({"url": url, "table": "items"}),
    )


# -- postgres ---------------------------------------------------------------------------------------


async def _pg(url: str, *statements: str, rows: Sequence[Sequence[object]] = ()) -> list[tuple[Any, ...]]:
    import psycopg

    async with await psycopg.AsyncConnection.connect(url) as conn:
        found: list[tuple[Any, ...]] = []
        for statement in statements:
            async with conn.cursor() as cursor:
                if rows:
                    await cursor.executemany(statement, rows)
                else:
                    await cursor.execute(statement)
                    found = await cursor.fetchall() if cursor.description else []
        return found


def _pg_rows(rows: Sequence[Row]) -> list[tuple[object, ...]]:
    return [(row["id"], row["name"]) for row in rows]


def _pg_reader(url: str, table: str) -> Callable[[], Coroutine[Any, Any, list[dict[str, Any]]]]:
    async def read_back() -> list[dict[str, Any]]:
        if (await _pg(url, f"SELECT to_regclass('public.{table}') IS NOT NULL"))[0][0] is False:
            return []
        return [{"id": i, "name": name} for i, name in await _pg(url, f"SELECT id, name FROM public.{table}")]

    return read_back


def _pg_unreachable(table: str) -> dict[str, Any]:
    return {"url": _unreachable_url(), "table": table, "connect_timeout": 2}


def postgres_source(postgres_url: str) -> SourceSetup:
    """A table ``items`` (id bigint primary key, name text, score numeric(10, 2)) in a fresh database."""
    _run(
        lambda: _pg(
            postgres_url, "CREATE TABLE items (id bigint PRIMARY KEY, name text, score numeric(10, 2))"
        )
    )

    async def add_rows(rows: Sequence[Row]) -> None:
        await _pg(postgres_url, "INSERT INTO items (id, name) VALUES (%s, %s)", rows=_pg_rows(rows))

    async def add_malformed() -> None:
        # numeric NaN has no decimal128 form.
        await _pg(postgres_url, "INSERT INTO items VALUES (999999, 'nan', 'NaN')")

    config = {"url": postgres_url, "table": "items", "fetch_rows": 100}
    return SourceSetup(
        config,
        add_rows,
        unreachable=_pg_unreachable("items"),
        add_malformed=add_malformed,
    )


def postgres_sink(postgres_url: str) -> SinkSetup:
    """``items`` (name at most 40 characters) appended to with the watermark; ``items_keyed`` upserted."""
    _run(lambda: _pg(postgres_url, f"CREATE TABLE items (id bigint NOT NULL, name varchar({NAME_LIMIT}))"))
    return SinkSetup(
        {"url": postgres_url, "table": "items", "mode": "append"},
        _pg_reader(postgres_url, "items"),
        keyed_config={"url": postgres_url, "table": "items_keyed", "mode": "upsert", "key": ["id"]},
        read_keyed=_pg_reader(postgres_url, "items_keyed"),
        refused_rows=_refused_rows(),
        unreachable=_pg_unreachable("items"),
        configure=_with_mode({"url": postgres_url, "table": "items"}),
    )


def postgres_streaming_sink(postgres_url: str) -> SinkSetup:
    """Epochs into ``items`` (name at most 40 characters), one transaction each; ``stall`` stops the
    server processes of the database's open connections (a local server only)."""
    _run(lambda: _pg(postgres_url, f"CREATE TABLE items (id bigint NOT NULL, name varchar({NAME_LIMIT}))"))
    unreachable = _pg_unreachable("items")
    return SinkSetup(
        {"url": postgres_url, "table": "items"},
        _pg_reader(postgres_url, "items"),
        refused_rows=_refused_rows(),
        unreachable=unreachable,
        stall=(lambda: _pg_stalled(postgres_url)) if _is_local(postgres_url) else None,
    )


def _is_local(url: str) -> bool:
    from urllib.parse import urlsplit

    return urlsplit(url).hostname in ("127.0.0.1", "localhost", "::1")


@contextlib.asynccontextmanager
async def _pg_stalled(url: str) -> AsyncIterator[None]:
    """SIGSTOP the backend processes of every connection to ``url``'s database; SIGCONT on exit."""
    found = await _pg(
        url, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    stopped: list[int] = []
    try:
        for (pid,) in found:
            if _process_name(int(pid)) == "postgres":  # never signal a process that is not the server's
                os.kill(int(pid), signal.SIGSTOP)
                stopped.append(int(pid))
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@contextlib.asynccontextmanager
async def _stopped(pid: int | None) -> AsyncIterator[None]:
    """The server process ``pid`` stopped (SIGSTOP) inside the context, continued (SIGCONT) on exit."""
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def postgres_cdc_source(postgres_url: str, unique_name: Callable[..., str]) -> SourceSetup:
    """Changes of ``public.items`` from a fresh slot; each ``add_rows`` is one source transaction."""
    from faucet_postgres.cdc import setup_replication
    from faucet_postgres.cdc_config import PostgresCdcConfig

    slot = unique_name("slot")
    config = {
        "url": postgres_url,
        "slot": slot,
        "publication": "faucet_conformance",
        "tables": ["public.items"],
        "heartbeat_interval": 0,
        "poll_interval": 0.1,
        "batch_rows": 10,
    }

    async def prepare() -> None:
        await _pg(postgres_url, "CREATE TABLE items (id bigint PRIMARY KEY, name text)")
        await setup_replication(PostgresCdcConfig.model_validate(config))

    _run(prepare)

    async def add_rows(rows: Sequence[Row]) -> None:
        await _pg(postgres_url, "INSERT INTO items (id, name) VALUES (%s, %s)", rows=_pg_rows(rows))

    async def add_malformed() -> None:
        # A BC date has no Arrow form: the source must refuse it (DataError), never drop it.
        await _pg(postgres_url, "ALTER TABLE items ADD COLUMN IF NOT EXISTS born date")
        await _pg(
            postgres_url, "INSERT INTO items (id, name, born) VALUES (-1, 'malformed', '0044-03-15 BC')"
        )

    async def acknowledged() -> str:
        found = await _pg(
            postgres_url,
            f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{slot}'",
        )
        return str(found[0][0]) if found else ""

    async def cleanup() -> None:
        await _pg(
            postgres_url,
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            f"WHERE slot_name = '{slot}'",
        )

    async def advance_out_of_band() -> None:
        # What an operator (or a retention job) does to a slot holding too much WAL: the changes
        # committed so far are released unread.
        await _pg(
            postgres_url,
            f"SELECT pg_replication_slot_advance('{slot}', pg_current_wal_insert_lsn())",
        )

    return SourceSetup(
        config,
        add_rows,
        resources=("public.items",),
        unreachable={**config, "url": _unreachable_url(), "connect_timeout": 2},
        add_malformed=add_malformed,
        acknowledged=acknowledged,
        cleanup=cleanup,
        make_unavailable=advance_out_of_band,
    )


# -- nats -------------------------------------------------------------------------------------------


async def _nats(url: str, work: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
    import nats

    client = await nats.connect(url)
    try:
        return await work(client)
    finally:
        await client.close()


def _nats_unreachable(config: Mapping[str, Any]) -> dict[str, Any]:
    return {**config, "servers": [f"nats://127.0.0.1:{closed_port()}"], "connect_timeout": 1}


def nats_source(nats_url: str, unique_name: Callable[..., str]) -> SourceSetup:
    """A fresh JetStream stream of JSON messages (``<stream>.items``); the source's durable consumer
    acknowledges within one second, so the slow sink outlasts it."""
    stream = unique_name("s")

    async def create(client: Any) -> None:
        await client.jetstream().add_stream(name=stream, subjects=[f"{stream}.>"])

    _run(lambda: _nats(nats_url, create))

    async def publish(payloads: Sequence[bytes]) -> None:
        async def send(client: Any) -> None:
            jetstream = client.jetstream()
            for payload in payloads:  # in order: the stream sequence is the rows' order
                await jetstream.publish(f"{stream}.items", payload)

        await _nats(nats_url, send)

    async def add_rows(rows: Sequence[Row]) -> None:
        await publish([json.dumps(dict(row)).encode() for row in rows])

    async def acknowledged() -> str:
        async def floor(client: Any) -> str:
            import nats.js.errors

            try:
                info = await client.jetstream().consumer_info(stream, f"faucet_{stream}")
            except nats.js.errors.NotFoundError:
                return "0"  # no session created the consumer yet: nothing is acknowledged
            return str(info.ack_floor.stream_seq)

        return await _nats(nats_url, floor)

    async def redelivered() -> int:
        async def count(client: Any) -> int:
            import nats.js.errors

            try:
                info = await client.jetstream().consumer_info(stream, f"faucet_{stream}")
            except nats.js.errors.NotFoundError:
                return 0
            # The consumer starts at the stream's first sequence with no filter: every delivery past
            # the last stream sequence delivered is a repeated one.
            return int(info.delivered.consumer_seq - info.delivered.stream_seq)

        return await _nats(nats_url, count)

    async def purge() -> None:
        async def remove(client: Any) -> None:
            await client.jetstream().purge_stream(stream)

        await _nats(nats_url, remove)

    async def cleanup() -> None:
        async def delete(client: Any) -> None:
            await client.jetstream().delete_stream(stream)

        await _nats(nats_url, delete)

    config = {
        "servers": [nats_url],
        "stream": stream,
        "columns": {"id": "int64 not null", "name": "string"},
        "ack_wait": 1.0,
        "idle_heartbeat": 0.5,
        "chunk_messages": 100,
    }
    return SourceSetup(
        config,
        add_rows,
        resources=(stream,),
        unreachable=_nats_unreachable(config),
        add_malformed=lambda: publish([b"{not json"]),
        acknowledged=acknowledged,
        cleanup=cleanup,
        redelivered=redelivered,
        make_unavailable=purge,
    )


def nats_sink(nats_server: NatsServer, unique_name: Callable[..., str]) -> SinkSetup:
    """A fresh stream with a 120 s duplicate window that refuses messages over 1 KiB; ``stall``
    stops the server process (SIGSTOP) when this process manages it."""
    nats_url = nats_server.url
    stream = unique_name("s")
    subject = f"{stream}.out"
    bucket = f"w_{stream}"

    async def create(client: Any) -> None:
        await client.jetstream().add_stream(
            name=stream, subjects=[subject], duplicate_window=120, max_msg_size=1024
        )

    _run(lambda: _nats(nats_url, create))

    async def read_back() -> list[dict[str, Any]]:
        async def read(client: Any) -> list[dict[str, Any]]:
            jetstream = client.jetstream()
            state = (await jetstream.stream_info(stream)).state
            if not state.messages:
                return []
            found = []
            for sequence in range(state.first_seq, state.last_seq + 1):
                message = await jetstream.get_msg(stream, sequence)
                found.append(json.loads(message.data or b"{}"))
            return found

        return await _nats(nats_url, read)

    async def cleanup() -> None:
        async def delete(client: Any) -> None:
            import nats.js.errors

            jetstream = client.jetstream()
            await jetstream.delete_stream(stream)
            # The bucket exists once a streaming session opened; a bounded sink has none.
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await jetstream.delete_key_value(bucket)

        await _nats(nats_url, delete)

    config = {
        "servers": [nats_url],
        "stream": stream,
        "subject": subject,
        "duplicate_window": 120,
        # nats-py never resolves the future of a publish the stream refuses (its reply handler
        # raises instead): such a write ends as UncertainOutcome after ack_timeout.
        "ack_timeout": 1,
        "watermark_bucket": bucket,
    }
    return SinkSetup(
        config,
        read_back,
        refused_rows=_refused_rows(),
        unreachable=_nats_unreachable(config),
        cleanup=cleanup,
        stall=(lambda: _stopped(nats_server.pid)) if nats_server.pid is not None else None,
    )


# -- kafka ------------------------------------------------------------------------------------------

KAFKA_PARTITIONS = 2


def kafka_source(kafka_bootstrap: str, unique_name: Callable[..., str]) -> SourceSetup:
    """A fresh topic of two partitions (a row goes to partition ``id % 2``) of JSON records."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    topic, group = unique_name("t"), unique_name("g")
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, KAFKA_PARTITIONS, 1)])[topic].result(timeout=30)

    def produce(values: Sequence[tuple[int, bytes]]) -> None:
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
        for key, value in values:
            producer.produce(topic, value, key=str(key).encode(), partition=key % KAFKA_PARTITIONS)
        if producer.flush(30):
            raise TimeoutError(f"records for topic {topic} were not acknowledged")

    async def add_rows(rows: Sequence[Row]) -> None:
        values = [(int(row["id"]), json.dumps(dict(row)).encode()) for row in rows]
        await asyncio.to_thread(produce, values)

    async def add_malformed() -> None:
        await asyncio.to_thread(produce, [(0, b"{not json")])

    def committed() -> str:
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer(
            {"bootstrap.servers": kafka_bootstrap, "group.id": group, "enable.auto.commit": False}
        )
        try:
            found = consumer.committed(
                [TopicPartition(topic, p) for p in range(KAFKA_PARTITIONS)], timeout=10
            )
            return ",".join(str(item.offset) for item in found)
        finally:
            consumer.close()

    async def acknowledged() -> str:
        return await asyncio.to_thread(committed)

    config = {
        "bootstrap_servers": kafka_bootstrap,
        "topics": [topic],
        "group_id": group,
        "batch_size": 100,
        "poll_timeout": 0.1,
        # librdkafka prefetches up to 64 MiB per partition by default (native memory): check 2 sees
        # that as buffering the dataset. These bound what a Kafka read holds.
        "client_properties": {"queued.max.messages.kbytes": "64", "max.partition.fetch.bytes": "65536"},
    }
    return SourceSetup(
        config,
        add_rows,
        resources=(topic,),
        unreachable={**config, "bootstrap_servers": f"127.0.0.1:{closed_port()}", "request_timeout": 2},
        add_malformed=add_malformed,
        acknowledged=acknowledged,
    )


# -- the registry -----------------------------------------------------------------------------------

TARGETS: Mapping[str, Mapping[Role, tuple[ConfigFactory, ConformanceOptions]]] = {
    "files": {Role.SOURCE: (files_source, DEFAULT_OPTIONS)},
    "sql": {Role.SOURCE: (sql_source, DEFAULT_OPTIONS), Role.SINK: (sql_sink, DEFAULT_OPTIONS)},
    "postgres": {
        Role.SOURCE: (postgres_source, DEFAULT_OPTIONS),
        Role.SINK: (postgres_sink, DEFAULT_OPTIONS),
        Role.STREAM_SOURCE: (postgres_cdc_source, DEFAULT_OPTIONS),
        Role.STREAMING_SINK: (postgres_streaming_sink, DEFAULT_OPTIONS),
    },
    "nats": {
        Role.SOURCE: (nats_source, DEFAULT_OPTIONS),
        Role.SINK: (nats_sink, DEFAULT_OPTIONS),
        Role.STREAM_SOURCE: (nats_source, DEFAULT_OPTIONS),
        Role.STREAMING_SINK: (nats_sink, ConformanceOptions(replay_duplicates="within_window")),
    },
    "kafka": {
        Role.SOURCE: (kafka_source, DEFAULT_OPTIONS),
        Role.STREAM_SOURCE: (kafka_source, DEFAULT_OPTIONS),
    },
}
"""Every connector role of this repository with its config factory and options."""


def target(connector: str, role: Role) -> tuple[ConfigFactory, ConformanceOptions]:
    return TARGETS[connector][role]


__all__ = [
    "TARGETS",
    "closed_port",
    "files_source",
    "kafka_source",
    "nats_sink",
    "nats_source",
    "postgres_cdc_source",
    "postgres_sink",
    "postgres_source",
    "postgres_streaming_sink",
    "sql_sink",
    "sql_source",
    "target",
]
