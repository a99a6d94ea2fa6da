"""Rows the PostgreSQL streaming sink refuses (a CHECK constraint, a unique constraint, a NUL in a text
column): dead letters with the server's reason where the stream's policy routes bad rows, else a
DataError naming the record's topic, partition and offset and the constraint; never a whole epoch
failed without saying which record, and the epoch stays atomic. Under APPLY_CHANGES (PostgreSQL
change data capture into a replica) a refused change names its commit LSN, its key and the constraint.

Through the real stream: the Kafka-protocol broker or PostgreSQL logical replication, the continuous
runner, PostgreSQL, the state store.
"""

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from faucet_postgres.stream_sink import PostgresStreamingSinkSession
from kafka_topics import create_topic, produce
from test_stream_postgres_cdc import Replication, commit_positions, replication  # noqa: F401 (a fixture)

from faucet_dagster.cli.main import main
from faucet_dagster.declarations.resources import FaucetConnection
from faucet_dagster.pipeline import BadRowPolicy, ResourceSchema
from faucet_dagster.protocol import (
    ConnectionFailed,
    Coverage,
    DataError,
    EpochCertificate,
    EpochId,
    ReadLimits,
    WritePolicy,
)
from faucet_dagster.runner.continuous import StreamRunner
from faucet_dagster.runner.spec import StoreDeadLetterRoute
from faucet_dagster.state import StateStore
from faucet_dagster.streams.declaration import FaucetStream

ROWS = 40
NEGATIVE = 7  # score -1: refused by the CHECK constraint
NUL = 23  # a NUL in a text column: refused by PostgreSQL's text type
TWIN = 31  # VERSIONED_UPSERT: the same name as row 30, refused by the unique constraint on name


def values(policy: WritePolicy) -> list[bytes]:
    rows: list[dict[str, Any]] = [{"id": i, "name": f"user-{i}", "score": i, "v": 1} for i in range(ROWS)]
    rows[NEGATIVE]["score"] = -1
    rows[NUL]["name"] = "nul\u0000here"
    if policy is WritePolicy.VERSIONED_UPSERT:
        rows[TWIN]["name"] = rows[TWIN - 1]["name"]
    return [json.dumps(row).encode() for row in rows]


def refused(policy: WritePolicy) -> set[int]:
    return {NEGATIVE, NUL} | ({TWIN} if policy is WritePolicy.VERSIONED_UPSERT else set())


def prepare(url: str, table: str) -> None:
    with psycopg.connect(url) as connection:
        connection.execute(
            f'CREATE TABLE "{table}" (id bigint PRIMARY KEY, name text UNIQUE, score bigint, v bigint, '
            "CONSTRAINT score_not_negative CHECK (score >= 0))"
        )


def table_ids(url: str, table: str) -> list[int]:
    with psycopg.connect(url) as connection:
        return [row[0] for row in connection.execute(f'SELECT id FROM "{table}" ORDER BY id')]


def make_stream(
    bootstrap: str,
    url: str,
    unique_name: Callable[..., str],
    tmp_path: Path,
    policy: WritePolicy,
    routed: bool,
) -> tuple[FaucetStream, str, str]:
    topic, table = unique_name("topic"), unique_name("table")
    create_topic(bootstrap, topic, 1)
    prepare(url, table)
    produce(bootstrap, topic, values(policy), partitions=1)
    kafka = FaucetConnection(
        connector="kafka", config={"bootstrap_servers": bootstrap, "group_id": unique_name("group")}
    )
    postgres = FaucetConnection(connector="postgres", config={"url": url})
    schema = ResourceSchema(on_bad_row=BadRowPolicy.DEAD_LETTER if routed else BadRowPolicy.HALT)
    stream = FaucetStream(
        name=unique_name("stream"),
        source=kafka.using(topics=[topic]),
        sink=postgres.using(table=table, **({"version_column": "v"} if policy.keyed else {})),
        resources=(topic,),
        policy=policy,
        key=("id",) if policy.keyed else (),
        schemas={topic: schema},
        limits=ReadLimits(records=ROWS, idle=1.0),
        state_url=f"sqlite:///{tmp_path / 'state.db'}",
    )
    return stream, topic, table


def run_epoch(stream: FaucetStream) -> EpochCertificate | None:
    store = state_store(stream)
    try:
        return asyncio.run(one_epoch(stream, store, "w1"))
    finally:
        store.close()


def state_store(stream: FaucetStream) -> StateStore:
    assert stream.state_url is not None
    return StateStore(stream.state_url)


async def one_epoch(stream: FaucetStream, store: StateStore, worker: str) -> EpochCertificate | None:
    """One epoch of ``stream`` by a runner of its own, as worker ``worker``."""
    runner = StreamRunner(stream.build_spec(), store, worker_id=worker)
    try:
        return await runner.run_epoch()
    finally:
        await runner.close()


def fail_first_commit(
    monkeypatch: pytest.MonkeyPatch, error: ConnectionFailed, before: Callable[[bool], None]
) -> None:
    """The sink's first ``commit_epoch`` raises ``error`` instead of committing; the later ones commit.
    ``before(failing)`` runs at the start of every commit (``failing``: this one raises)."""
    commit = PostgresStreamingSinkSession.commit_epoch
    pending = [error]

    async def failing_once(self: PostgresStreamingSinkSession, epoch: EpochId, coverage: Coverage) -> Any:
        before(bool(pending))
        if pending:
            raise pending.pop()
        return await commit(self, epoch, coverage)

    monkeypatch.setattr(PostgresStreamingSinkSession, "commit_epoch", failing_once)


@pytest.mark.parametrize("policy", [WritePolicy.APPEND, WritePolicy.VERSIONED_UPSERT])
def test_refused_rows_are_dead_lettered_with_the_reason_and_the_rest_commits_with_the_certificate(
    kafka_bootstrap: str,
    postgres_url: str,
    unique_name: Callable[..., str],
    tmp_path: Path,
    policy: WritePolicy,
) -> None:
    stream, topic, table = make_stream(kafka_bootstrap, postgres_url, unique_name, tmp_path, policy, True)
    certificate = run_epoch(stream)
    assert certificate is not None
    bad = refused(policy)
    assert table_ids(postgres_url, table) == [i for i in range(ROWS) if i not in bad]
    assert certificate.dead_lettered == {topic: len(bad)}
    assert certificate.row_counts == {topic: ROWS - len(bad)}
    store = state_store(stream)
    try:
        letters = {
            int(json.loads(letter["payload"])["id"]): letter for letter in store.dead_letters(stream.name)
        }
        last = store.last_certificate(stream.name)
    finally:
        store.close()
    assert set(letters) == bad
    assert last is not None and last.sequence == certificate.sequence
    offsets = {i: letter["event"] for i, letter in letters.items()}
    for index, event in offsets.items():
        assert f"/{topic}/0/" in event and f"@{index}#" in event, event  # topic, partition, offset
    assert "score_not_negative" in letters[NEGATIVE]["reason"] and "23514" in letters[NEGATIVE]["reason"]
    assert "22021" in letters[NUL]["reason"], letters[NUL]["reason"]  # invalid byte sequence: 0x00
    if policy is WritePolicy.VERSIONED_UPSERT:
        assert "23505" in letters[TWIN]["reason"], letters[TWIN]["reason"]


def test_a_refused_row_without_a_dead_letter_route_names_its_offset_and_the_constraint_and_commits_nothing(
    kafka_bootstrap: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> None:
    stream, topic, table = make_stream(
        kafka_bootstrap, postgres_url, unique_name, tmp_path, WritePolicy.APPEND, False
    )
    with pytest.raises(DataError) as raised:
        run_epoch(stream)
    error = raised.value
    assert error.where is not None
    assert f"/{topic}/0/" in error.where and f"@{NEGATIVE}#" in error.where, error.where
    assert "score_not_negative" in error.message and "1 more row(s)" in error.message, error.message
    assert table_ids(postgres_url, table) == [], "the epoch is atomic: nothing of it committed"
    store = state_store(stream)
    try:
        assert store.last_certificate(stream.name) is None
        assert store.dead_letters(stream.name) == []
    finally:
        store.close()


def test_apply_changes_a_change_the_replica_refuses_names_its_commit_lsn_key_and_constraint(
    replication: Replication,  # noqa: F811 (the imported fixture) capsys: pytest.CaptureFixture[str]
) -> None:
    replication.execute("CREATE TABLE scores (id int PRIMARY KEY, score int)")
    replication.execute(
        "CREATE TABLE scores (id int PRIMARY KEY, "
        "score int CONSTRAINT score_not_negative CHECK (score >= 0))",
        url=replication.target_url,
    )
    publication = f"{replication.slot}_pub"
    setup = [
        "cdc", "setup",
        "--set", f"url={replication.source_url}",
        "--set", f"slot={replication.slot}",
        "--set", f"publication={publication}",
        "--table", "public.scores",
    ]  # fmt: skip
    assert main(setup) == 0
    observer = f"{replication.slot}_observer"
    replication.execute(f"SELECT pg_create_logical_replication_slot('{observer}', 'pgoutput')")
    replication.execute("INSERT INTO scores SELECT g, g FROM generate_series(1, 50) g")
    replication.execute(
        "UPDATE scores SET score = -1 WHERE id = 17", "UPDATE scores SET score = 0 WHERE id = 18"
    )
    commits, _ = commit_positions(replication.source_url, observer, publication)
    assert len(commits) == 2

    async def scenario() -> None:
        runner = replication.runner(("scores",), "w1")
        try:
            await runner.run_epoch()
        finally:
            await runner.close()

    with pytest.raises(DataError) as raised:
        asyncio.run(scenario())
    error = raised.value
    assert error.where is not None and error.where.endswith(f"@{commits[1]}#0"), error.where  # the LSN
    assert "table scores @ " in error.where
    assert "key (17)" in error.message and "score_not_negative" in error.message, error.message
    assert replication.execute("SELECT * FROM scores", url=replication.target_url) == [], "atomic"
    assert replication.store.last_certificate(replication.name) is None


def test_an_epoch_that_fails_to_commit_withdraws_its_dead_letters_and_its_replay_routes_them_once(
    kafka_bootstrap: str,
    postgres_url: str,
    unique_name: Callable[..., str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream, topic, table = make_stream(
        kafka_bootstrap, postgres_url, unique_name, tmp_path, WritePolicy.APPEND, True
    )
    store = state_store(stream)
    seen: list[list[dict[str, Any]]] = []

    def routed(failing: bool) -> None:
        seen.append(store.dead_letters(stream.name))  # routed before the commit

    fail_first_commit(monkeypatch, ConnectionFailed("the commit is refused once (injected)"), routed)

    async def scenario() -> EpochCertificate | None:
        runner = StreamRunner(stream.build_spec(), store, worker_id="w1")
        try:
            with pytest.raises(ConnectionFailed):
                await runner.run_epoch()
            assert store.dead_letters(stream.name) == [], "the aborted epoch's dead letters are withdrawn"
            assert table_ids(postgres_url, table) == []
            return await runner.run_epoch()
        finally:
            await runner.close()

    try:
        certificate = asyncio.run(scenario())
        letters = store.dead_letters(stream.name)
    finally:
        store.close()
    assert [len(found) for found in seen] == [2, 2]
    assert certificate is not None and certificate.dead_lettered == {topic: 2}
    assert sorted(json.loads(letter["payload"])["id"] for letter in letters) == [NEGATIVE, NUL]
    assert table_ids(postgres_url, table) == [i for i in range(ROWS) if i not in (NEGATIVE, NUL)]


def test_dead_letters_of_an_epoch_whose_owner_died_before_committing_do_not_outlive_its_replay(
    kafka_bootstrap: str,
    postgres_url: str,
    unique_name: Callable[..., str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream, topic, table = make_stream(
        kafka_bootstrap, postgres_url, unique_name, tmp_path, WritePolicy.APPEND, True
    )
    store = state_store(stream)

    def dying(failing: bool) -> None:
        if failing:
            # What kill -9 leaves behind here: the dead letters are routed, nothing is committed,
            # and nobody withdraws them.
            monkeypatch.setattr(StoreDeadLetterRoute, "withdraw", keep_them)

    async def keep_them(self: StoreDeadLetterRoute, epoch: EpochId, records: Any) -> None:
        return None

    fail_first_commit(monkeypatch, ConnectionFailed("the worker dies before its commit (injected)"), dying)

    try:
        with pytest.raises(ConnectionFailed):
            asyncio.run(one_epoch(stream, store, "dead"))
        assert len(store.dead_letters(stream.name)) == 2, "the dead owner's letters are left behind"
        # Before the replay the constraint is dropped: the row it refused now lands.
        with psycopg.connect(postgres_url) as connection:
            connection.execute(f'ALTER TABLE "{table}" DROP CONSTRAINT score_not_negative')
        monkeypatch.undo()
        certificate = asyncio.run(one_epoch(stream, store, "next"))
        letters = store.dead_letters(stream.name)
    finally:
        store.close()
    assert certificate is not None and certificate.dead_lettered == {topic: 1}
    assert [json.loads(letter["payload"])["id"] for letter in letters] == [NUL], (
        "no letter for a row that landed"
    )
    assert table_ids(postgres_url, table) == [i for i in range(ROWS) if i != NUL]
