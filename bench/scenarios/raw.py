"""Raw client baselines: the bare client libraries with no framework, the rate a connector stack can reach.

Each scenario checks its result after the timed section (row counts, last payload) and raises if wrong.
"""

import asyncio
import sqlite3
import time
from collections.abc import Callable

import nats
import psycopg
from confluent_kafka import Consumer, Message
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from psycopg import sql

from bench import data
from bench.context import BenchContext
from bench.registry import Measurement, scenario
from bench.scenarios.connectors import sqlite_file

KAFKA_BATCH = 10_000
NATS_FETCH_BATCH = 5_000
NATS_PUSH_ACK_EVERY = 5_000
TIMEOUT_S = 300.0
SQLITE_FETCH_ROWS = 50_000
"""Rows per sqlite3 ``fetchmany``, as the bounded runner's page."""


def _count_rows(url: str, table: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
    assert row is not None
    return int(row[0])


def _expect(what: str, got: object, want: object) -> None:
    if got != want:
        raise RuntimeError(f"{what}: got {got!r}, expected {want!r}")


# ------------------------------------------------------------------------------------------------ PostgreSQL


@scenario("raw.pg_copy")
def pg_copy(ctx: BenchContext) -> Measurement:
    """psycopg COPY of the dataset (id, key, jsonb payload) into a new table, in one transaction."""
    rows, table = ctx.dataset(), ctx.unique("copy")
    with psycopg.connect(ctx.postgres_url) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (id bigint, k text, payload jsonb)").format(sql.Identifier(table))
        )
        conn.commit()
        start = time.perf_counter()
        copy_sql = sql.SQL("COPY {} (id, k, payload) FROM STDIN").format(sql.Identifier(table))
        with conn.cursor().copy(copy_sql) as copy:
            for row in rows:
                copy.write_row(row)
        conn.commit()
        seconds = time.perf_counter() - start
    _expect(f"rows in {table}", _count_rows(ctx.postgres_url, table), len(rows))
    return Measurement(len(rows), seconds)


@scenario("raw.sqlite_to_pg_copy")
def sqlite_to_pg_copy(ctx: BenchContext) -> Measurement:
    """sqlite3 read of the SQLite table in id order, fetchmany(50,000), psycopg COPY, one transaction."""
    path, table = sqlite_file(ctx), ctx.unique("sqlite_copy")
    with psycopg.connect(ctx.postgres_url) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (id bigint, k text, payload jsonb)").format(sql.Identifier(table))
        )
        conn.commit()
        start = time.perf_counter()
        source = sqlite3.connect(path)
        try:
            cursor = source.execute("SELECT id, k, payload FROM dataset ORDER BY id")
            copy_sql = sql.SQL("COPY {} (id, k, payload) FROM STDIN").format(sql.Identifier(table))
            with conn.cursor().copy(copy_sql) as copy:
                while rows := cursor.fetchmany(SQLITE_FETCH_ROWS):
                    for row in rows:
                        copy.write_row(row)
            conn.commit()
        finally:
            source.close()
        seconds = time.perf_counter() - start
    _expect(f"rows in {table}", _count_rows(ctx.postgres_url, table), ctx.rows)
    return Measurement(ctx.rows, seconds)


# ------------------------------------------------------------------------------------------------ Kafka


@scenario("raw.kafka_produce")
def kafka_produce(ctx: BenchContext) -> Measurement:
    """confluent-kafka produce of the dataset's payloads to a new 4-partition topic, until all are acked."""
    topic, keys, values = data.create_topic(ctx, "produce"), data.message_keys(ctx), ctx.payloads()
    start = time.perf_counter()
    delivered = data.produce_all(ctx.kafka_bootstrap, topic, keys, values)
    seconds = time.perf_counter() - start
    # produce_all raised if any delivery failed. (The topic's watermarks cannot confirm the count: Tansu
    # answers ListOffsets(latest) with the last batch's base offset + 1, not the last offset + 1.)
    return Measurement(delivered, seconds)


def _consume(ctx: BenchContext, handle: Callable[[list[Message]], None] | None = None) -> Measurement:
    """Consume the source topic through a new consumer group, calling ``handle`` on every batch and then
    committing the batch's offsets synchronously.

    Timed from the partition assignment (the group join is left out; fetching starts only then).
    """
    topic, want = data.kafka_source_topic(ctx), ctx.rows
    consumer = Consumer(
        {"bootstrap.servers": ctx.kafka_bootstrap, "group.id": ctx.unique("g"), **data.KAFKA_CONSUMER_CONFIG}
    )
    assigned: list[float] = []
    try:
        consumer.subscribe([topic], on_assign=lambda _c, _p: assigned.append(time.perf_counter()))
        count, deadline = 0, time.monotonic() + TIMEOUT_S
        while count < want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"consumed {count} of {want} messages from {topic} in {TIMEOUT_S:.0f} s")
            batch = consumer.consume(KAFKA_BATCH, 1.0)
            for msg in batch:
                if msg.error() is not None:
                    raise RuntimeError(f"consume error on {topic}: {msg.error()}")
            if handle is not None and batch:
                handle(batch)
                consumer.commit(asynchronous=False)
            count += len(batch)
        seconds = time.perf_counter() - assigned[0]
    finally:
        consumer.close()
    _expect(f"messages consumed from {topic}", count, want)
    return Measurement(count, seconds)


@scenario("raw.kafka_consume")
def kafka_consume(ctx: BenchContext) -> Measurement:
    """confluent-kafka consume() in batches of 10,000 from the 4-partition source topic (no commits)."""
    return _consume(ctx)


@scenario("raw.kafka_to_pg", baseline="raw.kafka_consume")
def kafka_to_pg(ctx: BenchContext) -> Measurement:
    """Kafka to PostgreSQL loop: consume a batch, COPY it, commit PostgreSQL, then commit the offsets."""
    table = ctx.unique("k2pg")
    with psycopg.connect(ctx.postgres_url) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (topic text, part int, off bigint, payload jsonb)").format(
                sql.Identifier(table)
            )
        )
        conn.commit()
        copy_sql = sql.SQL("COPY {} (topic, part, off, payload) FROM STDIN").format(sql.Identifier(table))

        def to_pg(batch: list[Message]) -> None:
            with conn.cursor().copy(copy_sql) as copy:
                for msg in batch:
                    value = msg.value()
                    assert value is not None
                    copy.write_row((msg.topic(), msg.partition(), msg.offset(), value.decode()))
            conn.commit()

        result = _consume(ctx, to_pg)
    _expect(f"rows in {table}", _count_rows(ctx.postgres_url, table), ctx.rows)
    return result


# ------------------------------------------------------------------------------------------------ NATS


@scenario("raw.nats_push")
def nats_push(ctx: BenchContext) -> Measurement:
    """JetStream push consumer (AckAll every 5,000, flow control) read through a plain core subscription."""
    stream = data.nats_source_stream(ctx)
    return asyncio.run(_nats_push(ctx.nats_url, stream, ctx.rows, ctx.payloads()[-1]))


async def _nats_push(url: str, stream: str, want: int, last_payload: bytes) -> Measurement:
    nc = await nats.connect(url, pending_size=data.NATS_PENDING_BYTES)
    try:
        js = nc.jetstream()
        inbox = nc.new_inbox()
        done = asyncio.Event()
        count = 0
        last: list[Msg] = []

        async def on_msg(msg: Msg) -> None:
            nonlocal count
            headers = msg.headers or {}
            if "Status" in headers:  # flow control request or idle heartbeat
                if msg.reply:
                    await nc.publish(msg.reply, b"")
                stalled = headers.get("Nats-Consumer-Stalled")
                if stalled:
                    await nc.publish(stalled, b"")
                return
            count += 1
            if count % NATS_PUSH_ACK_EVERY == 0 or count >= want:
                await msg.ack()
            if count >= want:
                last.append(msg)
                done.set()

        sub = await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
        start = time.perf_counter()
        await js.add_consumer(
            stream,
            ConsumerConfig(
                durable_name="push",
                deliver_subject=inbox,
                ack_policy=AckPolicy.ALL,
                max_ack_pending=-1,
                flow_control=True,
                idle_heartbeat=5.0,
            ),
        )
        await asyncio.wait_for(done.wait(), TIMEOUT_S)
        seconds = time.perf_counter() - start
        await sub.unsubscribe()
        await js.delete_consumer(stream, "push")
    finally:
        await nc.close()
    _expect("messages pushed", count, want)
    _expect("last payload", last[0].data, last_payload)
    return Measurement(count, seconds)


@scenario("raw.nats_fetch", baseline="raw.nats_push")
def nats_fetch(ctx: BenchContext) -> Measurement:
    """nats-py JetStream pull consumer: fetch(5,000) and AckAll on each batch's last message."""
    stream = data.nats_source_stream(ctx)
    return asyncio.run(_nats_fetch(ctx.nats_url, stream, ctx.rows, ctx.payloads()[-1]))


async def _nats_fetch(url: str, stream: str, want: int, last_payload: bytes) -> Measurement:
    nc = await nats.connect(url, pending_size=data.NATS_PENDING_BYTES)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            f"{stream}.>",
            durable="fetch",
            stream=stream,
            config=ConsumerConfig(ack_policy=AckPolicy.ALL, max_ack_pending=-1),
        )
        count, last = 0, b""
        start = time.perf_counter()
        while count < want:
            batch = await sub.fetch(min(NATS_FETCH_BATCH, want - count), timeout=10)
            await batch[-1].ack()
            count += len(batch)
            last = batch[-1].data
        seconds = time.perf_counter() - start
        await sub.unsubscribe()
        await js.delete_consumer(stream, "fetch")
    finally:
        await nc.close()
    _expect("messages fetched", count, want)
    _expect("last payload", last, last_payload)
    return Measurement(count, seconds)
