"""Smoke and fault tests of the real test servers in faucet_dagster.testing."""

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable

import nats
import psycopg
import pytest
from confluent_kafka import Consumer, KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from nats.js.api import AckPolicy, ConsumerConfig

from faucet_dagster.testing import (
    ExternalServerError,
    KafkaServer,
    NatsServer,
    PostgresServer,
    S3Server,
    ServerStartError,
    make_unique_name,
)

# ---------------------------------------------------------------------------------------------- helpers


def _pg_fetch_ids(url: str, table: str) -> list[int]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute(f"SELECT id FROM {table} ORDER BY id").fetchall()]


def _pg_unreachable(url: str) -> bool:
    try:
        psycopg.connect(url, connect_timeout=2).close()
    except psycopg.OperationalError:
        return True
    return False


async def _nats_publish(url: str, stream: str, payloads: list[bytes]) -> list[int]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name=stream, subjects=[f"{stream}.>"])
        acks = [await js.publish(f"{stream}.x", p) for p in payloads]
        return [a.seq for a in acks]
    finally:
        await nc.close()


async def _nats_fetch_all(url: str, stream: str, count: int) -> tuple[int, list[bytes]]:
    """Return (messages in the stream, payloads fetched through a new pull consumer)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        sub = await js.pull_subscribe(
            f"{stream}.>", durable="reader", config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT)
        )
        got: list[bytes] = []
        while len(got) < count:
            for msg in await sub.fetch(count - len(got), timeout=5):
                got.append(msg.data)
                await msg.ack()
        return info.state.messages, got
    finally:
        await nc.close()


def _kafka_create_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(15)


def _kafka_produce(producer: Producer, topic: str, values: list[bytes]) -> list[Message]:
    delivered: list[Message] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        assert err is None, err
        delivered.append(msg)

    for i, value in enumerate(values):
        producer.produce(topic, key=str(i).encode(), value=value, on_delivery=on_delivery)
    assert producer.flush(30) == 0
    return delivered


def _kafka_consume(bootstrap: str, topic: str, group: str, count: int) -> list[bytes]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            # Tansu completes a new group's first join after about half the session timeout
            # (23 s with librdkafka's default of 45 s)
            "session.timeout.ms": 6000,
        }
    )
    try:
        consumer.subscribe([topic])
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            for msg in consumer.consume(count, 1.0):
                assert msg.error() is None, msg.error()
                value = msg.value()
                assert value is not None
                got.append(value)
        consumer.commit(asynchronous=False)
        return got
    finally:
        consumer.close()


# ---------------------------------------------------------------------------------------------- PostgreSQL


def test_postgres_roundtrip_with_logical_decoding(postgres_url: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        assert conn.execute("SHOW wal_level").fetchone() == ("logical",)
        slots = conn.execute("SHOW max_replication_slots").fetchone()
        assert slots is not None and int(slots[0]) >= 20
        conn.execute("SELECT pg_create_logical_replication_slot('s1', 'test_decoding')")
        conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text)")
        conn.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
        assert conn.execute("SELECT id, v FROM t ORDER BY id").fetchall() == [(1, "a"), (2, "b")]
        changes = [
            r[0] for r in conn.execute("SELECT data FROM pg_logical_slot_get_changes('s1', NULL, NULL)")
        ]
    inserts = [c for c in changes if c.startswith("table public.t: INSERT")]
    assert inserts == [
        "table public.t: INSERT: id[bigint]:1 v[text]:'a'",
        "table public.t: INSERT: id[bigint]:2 v[text]:'b'",
    ]
    # the fixture's database is the test's own
    assert postgres_url.rsplit("/", 1)[1].startswith("t_test_postgres_roundtrip")


def test_postgres_kill_and_restart_keep_committed_data(
    postgres_server: PostgresServer, postgres_url: str
) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE k (id int)")
        conn.execute("INSERT INTO k SELECT generate_series(1, 1000)")
        conn.execute("SELECT pg_create_logical_replication_slot('k_slot', 'pgoutput')")
    url_before, pid_before = postgres_server.url, postgres_server.pid

    postgres_server.kill()
    assert not postgres_server.is_running
    assert _pg_unreachable(postgres_url)

    postgres_server.restart()
    assert postgres_server.url == url_before
    assert postgres_server.pid not in (None, pid_before)
    assert _pg_fetch_ids(postgres_url, "k") == list(range(1, 1001))
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT slot_name FROM pg_replication_slots").fetchall() == [("k_slot",)]

    postgres_server.stop()
    assert _pg_unreachable(postgres_url)
    postgres_server.start()
    assert _pg_fetch_ids(postgres_url, "k") == list(range(1, 1001))


def test_postgres_bad_setting_fails_with_log_tail() -> None:
    server = PostgresServer(settings={"wal_level": "bogus"}, startup_timeout=30)
    try:
        with pytest.raises(ServerStartError, match=r"(?s)exited with code .*wal_level") as info:
            server.start()
        assert "log tail" in str(info.value)
        assert not server.is_running
    finally:
        server.close()
    assert server.workdir is not None and not server.workdir.exists()


# ---------------------------------------------------------------------------------------------- NATS


def test_nats_jetstream_roundtrip(nats_url: str, unique_name: Callable[..., str]) -> None:
    stream = unique_name("s")
    payloads = [json.dumps({"i": i}).encode() for i in range(50)]
    seqs = asyncio.run(_nats_publish(nats_url, stream, payloads))
    assert seqs == list(range(1, 51))
    stored, fetched = asyncio.run(_nats_fetch_all(nats_url, stream, 50))
    assert stored == 50
    assert fetched == payloads


def test_nats_kill_and_restart_keep_streams(nats_server: NatsServer, unique_name: Callable[..., str]) -> None:
    stream = unique_name("s")
    payloads = [f"m{i}".encode() for i in range(20)]
    asyncio.run(_nats_publish(nats_server.url, stream, payloads))

    nats_server.kill()  # right after the acks: acknowledged messages must be on disk
    assert not nats_server.is_running
    nats_server.restart()

    stored, fetched = asyncio.run(_nats_fetch_all(nats_server.url, stream, 20))
    assert stored == 20
    assert fetched == payloads


# ---------------------------------------------------------------------------------------------- Kafka


def test_kafka_roundtrip(kafka_bootstrap: str, unique_name: Callable[..., str]) -> None:
    topic = unique_name("topic")
    _kafka_create_topic(kafka_bootstrap, topic, partitions=2)
    values = [f"v{i}".encode() for i in range(100)]
    delivered = _kafka_produce(Producer({"bootstrap.servers": kafka_bootstrap}), topic, values)
    assert len(delivered) == 100
    assert {m.partition() for m in delivered} <= {0, 1}

    got = _kafka_consume(kafka_bootstrap, topic, unique_name("g"), 100)
    assert sorted(got) == sorted(values)
    assert len(got) == 100


def test_kafka_kill_and_restart_clients_reconnect(
    kafka_server: KafkaServer, unique_name: Callable[..., str]
) -> None:
    bootstrap = kafka_server.bootstrap
    topic = unique_name("topic")
    _kafka_create_topic(bootstrap, topic)
    producer = Producer({"bootstrap.servers": bootstrap, "message.timeout.ms": 30000})
    assert len(_kafka_produce(producer, topic, [b"before"])) == 1

    kafka_server.kill()
    assert not kafka_server.is_running
    kafka_server.restart()
    assert kafka_server.bootstrap == bootstrap

    # in-memory storage: the broker comes back empty, on the same address
    admin = AdminClient({"bootstrap.servers": bootstrap})
    assert topic not in admin.list_topics(timeout=10).topics
    _kafka_create_topic(bootstrap, topic)
    # the producer created before the crash reconnects by itself
    delivered = _kafka_produce(producer, topic, [b"after-1", b"after-2"])
    assert [m.value() for m in delivered] == [b"after-1", b"after-2"]
    assert _kafka_consume(bootstrap, topic, unique_name("g"), 2) == [b"after-1", b"after-2"]


# ---------------------------------------------------------------------------------------------- API


def test_s3_roundtrip_and_a_conditional_put_refused_when_the_key_exists(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """What Delta's commit on S3 relies on: ``If-None-Match: *`` creates a key only if it is absent."""
    import boto3
    from botocore.exceptions import ClientError

    client = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint_url,
        region_name=s3_server.region,
        aws_access_key_id=s3_server.access_key_id,
        aws_secret_access_key=s3_server.secret_access_key,
    )
    client.put_object(Bucket=s3_bucket, Key="log/1.json", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket=s3_bucket, Key="log/1.json", Body=b"second", IfNoneMatch="*")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=s3_bucket, Key="log/1.json")["Body"].read() == b"first"


def test_external_servers_refuse_lifecycle_calls() -> None:
    handles = [
        PostgresServer.external("postgresql://postgres@127.0.0.1:1/postgres"),
        NatsServer.external("nats://127.0.0.1:1"),
        KafkaServer.external("127.0.0.1:1"),
        S3Server.external("http://127.0.0.1:1"),
    ]
    for handle in handles:
        assert handle.is_external
        for call in (handle.stop, handle.kill, handle.restart):
            with pytest.raises(ExternalServerError, match="external"):
                call()
        handle.close()  # no-op, never touches the external server


def test_external_server_that_does_not_answer_is_an_error() -> None:
    handle = NatsServer.external("nats://127.0.0.1:1", startup_timeout=1)
    with pytest.raises(ServerStartError, match="does not answer"):
        handle.start()


def test_database_url_and_unique_names() -> None:
    server = PostgresServer.external("postgresql://u:p@db.example:5433/postgres?sslmode=disable")
    assert server.database_url("x_1") == "postgresql://u:p@db.example:5433/x_1?sslmode=disable"
    a, b = make_unique_name("Orders", "test_x[param-1]"), make_unique_name("Orders", "test_x[param-1]")
    assert a != b
    assert a.startswith("orders_test_x_param_1_")
    assert all(c.isalnum() or c == "_" for c in a) and a == a.lower() and len(a) <= 50


def test_plugin_imports_without_dagster_or_clients() -> None:
    code = (
        "import sys, faucet_dagster.testing.pytest_plugin\n"
        "heavy = {'dagster', 'psycopg', 'nats', 'confluent_kafka', 'boto3', 'moto'}\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & heavy)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
