"""A stream divided among workers by partition groups and leases in the state store, on real servers.

Three workers of one stream run in one process (each its own worker id, its own state store client):
a 12-partition Kafka topic into PostgreSQL APPEND (the per-partition watermark: effectively-once), with
the state store in PostgreSQL as in production, while messages keep arriving. One worker dies (its
sessions dropped, its leases left to lapse), one joins, one stops cleanly. The destination must hold
every message once, and the certificates must show each partition owned by one fenced owner at a time,
its coverage chained across owners. The same with NATS (one ordering domain: one group reads it, the
others stand by and take over).
"""

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import nats
import psycopg
import pytest
from kafka_topics import committed, create_topic, produce

from faucet_dagster.cli.main import main
from faucet_dagster.declarations.resources import FaucetConnection
from faucet_dagster.protocol import (
    ConfigError,
    Delivery,
    EpochCertificate,
    Membership,
    OwnershipLost,
    ReadLimits,
)
from faucet_dagster.runner.continuous import StreamSpec
from faucet_dagster.runner.members import MemberWorker, assign, check_groups, group_stream
from faucet_dagster.state import StateStore
from faucet_dagster.state.members import MemberRegistry
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.testing.faults.members import check_ownership

PARTITIONS = 12
GROUPS = 3
LEASE = 3.0
LIMITS = ReadLimits(records=2_000, idle=0.3, age=2.0)
WAIT = 90.0


def ids(url: str, table: str) -> list[int]:
    with psycopg.connect(url) as conn:
        exists = conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()
        if exists is None or exists[0] is None:
            return []
        return [row[0] for row in conn.execute(f'SELECT id FROM "{table}" ORDER BY id')]


@dataclass
class Member:
    """One worker and the task running its rounds."""

    worker: MemberWorker
    task: asyncio.Task[None] | None = None
    stopping: bool = False
    certificates: list[EpochCertificate] = field(default_factory=list)

    async def loop(self) -> None:
        while not self.stopping:
            self.certificates.extend(await self.worker.run_round(LIMITS))


class Cluster:
    """Workers of one stream in this process, and the producer feeding it."""

    def __init__(self, spec: StreamSpec, state_url: str) -> None:
        self.spec = spec
        self.state_url = state_url
        self.members: dict[str, Member] = {}
        self.stores: list[StateStore] = []

    def store(self) -> StateStore:
        store = StateStore(self.state_url)
        self.stores.append(store)
        return store

    def start(self, name: str) -> None:
        member = Member(MemberWorker(self.spec, self.store(), groups=GROUPS, worker_id=name))
        member.task = asyncio.get_running_loop().create_task(member.loop())
        self.members[name] = member

    async def kill(self, name: str) -> None:
        """Like a crash: the reads interrupted, the sessions dropped, the leases left to lapse."""
        member = self.members.pop(name)
        member.stopping = True
        member.worker.cancel()
        assert member.task is not None
        await member.task
        await member.worker.close(release=False)

    async def stop(self, name: str) -> None:
        """A clean stop: the groups closed at certified positions, every lease released."""
        member = self.members.pop(name)
        member.stopping = True
        member.worker.cancel()
        assert member.task is not None
        await member.task
        await member.worker.close()

    async def stop_all(self) -> None:
        for name in list(self.members):
            await self.stop(name)
        for store in self.stores:
            store.close()

    async def wait_for(self, what: str, condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT
        while not condition():
            for member in self.members.values():
                assert member.task is not None
                if member.task.done():
                    member.task.result()  # a worker that failed fails the test with its error
            assert time.monotonic() < deadline, f"timed out waiting until {what}"
            await asyncio.sleep(0.2)

    def owner_of(self, group: int) -> str | None:
        certificates = self.stores[0].certificates(group_stream(self.spec.name, group, GROUPS))
        return certificates[-1].worker if certificates else None

    def groups_of(self, name: str) -> set[int]:
        return {group for group in range(GROUPS) if self.owner_of(group) == name}


class Producer:
    """Produces numbered messages on a thread until stopped; ``sent`` is how many were acknowledged."""

    def __init__(self, send: Callable[[int, int], None], batch: int = 300) -> None:
        self.sent = 0
        self._send = send
        self._batch = batch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._send(self.sent, self._batch)
            self.sent += self._batch
            time.sleep(0.1)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(60)
        return self.sent


def groups_reading(resource: str, partitions: Sequence[str]) -> set[int]:
    """The groups that own some of ``partitions`` (the others read nothing, so never certify)."""
    return {g for g in range(GROUPS) for p in partitions if Membership(g, GROUPS).owns(resource, p)}


async def membership_changes(
    cluster: Cluster, postgres_url: str, table: str, producer: Producer, active: set[int]
) -> None:
    """Three workers; one dies, one joins, one stops; every message reaches the destination once.
    ``active`` are the groups that own partitions."""
    for name in ("w1", "w2", "w3"):
        cluster.start(name)
    await cluster.wait_for(
        f"groups {sorted(active)} are certified", lambda: all(cluster.owner_of(g) for g in active)
    )
    victim = next(name for name in ("w1", "w2", "w3") if cluster.groups_of(name))
    lost = cluster.groups_of(victim)
    await cluster.kill(victim)
    await cluster.wait_for(
        f"the groups of {victim} (killed) are certified by another worker",
        lambda: all(cluster.owner_of(g) not in (None, victim) for g in lost),
    )
    cluster.start("w4")
    await cluster.wait_for(
        "w4 (joined) runs its group and certifies if it reads partitions",
        lambda: (
            bool(cluster.members["w4"].worker.running)
            and (
                not set(cluster.members["w4"].worker.running) & active
                or any(c.worker == "w4" for c in cluster.members["w4"].certificates)
            )
        ),
    )
    leaving = next(str(cluster.owner_of(g)) for g in sorted(active) if cluster.owner_of(g) in cluster.members)
    left = cluster.groups_of(leaving)
    await cluster.stop(leaving)
    await cluster.wait_for(
        f"the groups of {leaving} (stopped) are certified by another worker",
        lambda: all(cluster.owner_of(g) not in (None, leaving) for g in left),
    )
    total = await asyncio.to_thread(producer.stop)
    await cluster.wait_for(
        f"all {total} messages are in the destination", lambda: len(ids(postgres_url, table)) >= total
    )
    await cluster.stop_all()


@pytest.fixture
def kafka_stream(kafka_bootstrap: str, postgres_url: str, unique_name: Callable[..., str]) -> Iterator[Any]:
    # Partitions go to groups by a hash of the topic's name: with 12 partitions and 3 groups about
    # one name in 40 leaves a group without any, which the scenario needs to be reading.
    every = set(range(GROUPS))
    names = (unique_name("topic") for _ in range(200))
    topic = next(name for name in names if groups_reading(name, [str(p) for p in range(PARTITIONS)]) == every)
    group = unique_name("group")
    create_topic(kafka_bootstrap, topic, PARTITIONS)
    kafka = FaucetConnection(
        connector="kafka", config={"bootstrap_servers": kafka_bootstrap, "group_id": group}
    )
    postgres = FaucetConnection(connector="postgres", config={"url": postgres_url})
    stream = FaucetStream(
        name=unique_name("stream"),
        source=kafka.using(topics=[topic]),
        sink=postgres.using(table="events"),
        resources=(topic,),
    )
    yield replace(stream.build_spec(), limits=LIMITS, lease_seconds=LEASE), topic, group


def test_kafka_partitions_move_between_members_with_no_loss_and_no_duplicate(
    kafka_bootstrap: str, postgres_url: str, kafka_stream: Any
) -> None:
    spec, topic, group = kafka_stream

    def send(start: int, count: int) -> None:
        values = [json.dumps({"id": i, "name": f"n{i}"}).encode() for i in range(start, start + count)]
        produce(kafka_bootstrap, topic, values, partitions=PARTITIONS, start=start)

    cluster = Cluster(spec, postgres_url)

    async def scenario() -> int:
        producer = Producer(send)
        try:
            active = groups_reading(topic, [str(p) for p in range(PARTITIONS)])
            assert active == set(range(GROUPS))
            await membership_changes(cluster, postgres_url, "events", producer, active)
        finally:
            producer.stop()
            await cluster.stop_all()
        return producer.sent

    total = asyncio.run(scenario())
    store = StateStore(postgres_url)
    try:
        chains = {
            group_stream(spec.name, g, GROUPS): store.certificates(group_stream(spec.name, g, GROUPS))
            for g in range(GROUPS)
        }
    finally:
        store.close()
    ownership = check_ownership(chains)
    assert sorted(int(domain.partition) for domain in ownership) == list(range(PARTITIONS))
    assert {worker for item in ownership.values() for _, worker in item.owners} == {"w1", "w2", "w3", "w4"}
    assert ids(postgres_url, "events") == list(range(total)), "every message exactly once"
    assert sum(sum(c.row_counts.values()) for chain in chains.values() for c in chain) == total
    assert any(len(item.owners) > 1 for item in ownership.values()), "some partition changed owner"
    offsets = committed(kafka_bootstrap, topic, group, PARTITIONS)
    assert offsets == {int(d.partition): int(item.end or -1) + 1 for d, item in ownership.items()}, (
        "each partition's committed offset is its certified end + 1"
    )


@pytest.fixture
def nats_stream(nats_url: str, postgres_url: str, unique_name: Callable[..., str]) -> Any:
    name = unique_name("s")

    async def create() -> None:
        client = await nats.connect(nats_url)
        try:
            await client.jetstream().add_stream(name=name, subjects=[f"{name}.>"])
        finally:
            await client.close()

    asyncio.run(create())
    nats_source = FaucetConnection(
        connector="nats",
        config={"servers": [nats_url], "stream": name, "columns": {"id": "int64 not null", "name": "string"}},
    )
    postgres = FaucetConnection(connector="postgres", config={"url": postgres_url})
    stream = FaucetStream(
        name=name, source=nats_source.using(), sink=postgres.using(table=f"{name}_rows"), resources=(name,)
    )
    return replace(stream.build_spec(), limits=LIMITS, lease_seconds=LEASE), name


def test_nats_stream_moves_between_members_with_no_loss_and_no_duplicate(
    nats_url: str, postgres_url: str, nats_stream: Any
) -> None:
    spec, name = nats_stream

    def send(start: int, count: int) -> None:
        async def publish() -> None:
            client = await nats.connect(nats_url)
            try:
                js = client.jetstream()
                for n in range(start, start + count):
                    await js.publish(f"{name}.rows", json.dumps({"id": n, "name": f"n{n}"}).encode())
            finally:
                await client.close()

        asyncio.run(publish())

    cluster = Cluster(spec, postgres_url)

    async def scenario() -> int:
        producer = Producer(send, batch=100)
        try:
            active = groups_reading(name, [""])
            await membership_changes(cluster, postgres_url, f"{name}_rows", producer, active)
        finally:
            producer.stop()
            await cluster.stop_all()
        return producer.sent

    total = asyncio.run(scenario())
    store = StateStore(postgres_url)
    try:
        chains = {
            group_stream(spec.name, g, GROUPS): store.certificates(group_stream(spec.name, g, GROUPS))
            for g in range(GROUPS)
        }
    finally:
        store.close()
    ownership = check_ownership(chains)
    [(domain, item)] = ownership.items()
    assert domain.resource == name
    assert len(item.owners) >= 3, f"the stream changed owner at the kill and at the stop: {item.owners}"
    assert ids(postgres_url, f"{name}_rows") == list(range(total)), "every message exactly once"
    assert int(item.end or 0) == total, "the certified end is the stream's last sequence"


def test_assignment_gives_each_group_to_one_live_member() -> None:
    members = ["a", "b", "c"]
    split = {member: assign(members, 7, member) for member in members}
    assert split == {"a": (0, 3, 6), "b": (1, 4), "c": (2, 5)}
    assert assign(members, 7, "d") == ()
    assert assign(["b", "c"], 3, "c") == (1,)


def test_member_leases_lapse_rejoin_with_a_new_token_and_leave(tmp_path: Any) -> None:
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    registry = MemberRegistry(store)
    first = registry.join("s", "a", 30)
    second = registry.join("s", "b", 0.3)
    assert (first.fencing_token, second.fencing_token) == (1, 1)
    assert [m.member for m in registry.live("s")] == ["a", "b"]
    time.sleep(0.5)
    assert [m.member for m in registry.live("s")] == ["a"], "b's lease lapsed"
    with pytest.raises(OwnershipLost, match="counted out"):
        registry.renew(second, 30)
    again = registry.join("s", "b", 30)
    assert again.fencing_token == 2, "a member that lapsed joins again as a new incarnation"
    with pytest.raises(OwnershipLost):
        registry.renew(second, 30)
    assert registry.renew(again, 30).fencing_token == 2
    assert registry.leave(first)
    assert [m.member for m in registry.live("s")] == ["b"]
    assert registry.live("other") == ()
    store.close()


def test_the_number_of_groups_cannot_change_under_certificates(tmp_path: Any) -> None:
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    check_groups(store, "s", 3)  # nothing certified yet: any division
    lease = store.acquire_lease(group_stream("s", 0, 3), "w", 30)
    certificate = EpochCertificate(
        stream=group_stream("s", 0, 3),
        sequence=1,
        fencing_token=lease.fencing_token,
        worker="w",
        coverage=(),
        receipts=(),
        row_counts={},
        digest="",
        delivery=Delivery.AT_LEAST_ONCE,
    )
    store.append_certificate(certificate, lease)
    check_groups(store, "s", 3)
    with pytest.raises(ConfigError, match="3 partition groups"):
        check_groups(store, "s", 4)
    check_groups(store, "s2", 4)
    store.close()


def test_streams_status_names_each_partition_group_and_the_live_members(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = StateStore(url)
    registry = MemberRegistry(store)
    registry.join("orders", "a", 30)
    registry.join("orders", "b", 30)
    store.acquire_lease(group_stream("orders", 1, 2), "b", 30)
    store.acquire_lease("plain", "c", 30)
    store.close()
    assert main(["streams", "status", "--state-url", url]) == 0
    out = capsys.readouterr().out
    assert "orders[1/2]: leased to b" in out
    assert "partition group 1 of 2 of stream orders; live members: a, b" in out
    assert out.count("partition group") == 1, "a stream of its own has no group line"
    assert main(["streams", "status", "--state-url", url, "--json"]) == 0
    by_name = {item["stream"]: item for item in json.loads(capsys.readouterr().out)}
    assert by_name["orders[1/2]"]["members"] == ["a", "b"] and "members" not in by_name["plain"]
