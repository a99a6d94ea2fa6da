"""``faucet verify`` on real servers: a clean stream verifies, and every tampering is found and named.

A NATS JetStream stream runs into PostgreSQL through the continuous runner (several epochs); then
the verifier re-reads each certificate's range from the stream and compares it with the table. Each
tamper test changes one thing behind the stream's back (a row of the destination, a certificate in the
state store, the source itself) and checks that ``verify_stream`` reports that certificate diverged,
naming what it found; the untouched stream around it stays verified.
"""

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest
import sqlalchemy as sa
from faucet_nats.config import NatsSourceConfig
from faucet_nats.source import NatsStreamSource
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.stream_sink import PostgresStreamingSink

from faucet_dagster.pipeline import ResourceSchema
from faucet_dagster.protocol import EpochCertificate, ReadLimits, WritePolicy
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.state import StateStore
from faucet_dagster.state.certificates import fingerprint_and_body
from faucet_dagster.state.tables import certificates_table
from faucet_dagster.verify import Outcome, Report, VerifyOptions, verify_stream

COLUMNS = {"id": "int64 not null", "name": "string"}
EPOCH_COLUMN = "_faucet_epoch"


@dataclass
class Stream:
    """One test's NATS stream into one PostgreSQL table, its state store and runner spec."""

    nats_url: str
    postgres_url: str
    name: str
    store: StateStore
    policy: WritePolicy = WritePolicy.APPEND
    published: int = 0

    @property
    def table(self) -> str:
        return f"{self.name}_rows"

    def spec(self, **sink: Any) -> StreamSpec:
        source = NatsSourceConfig.parse({"servers": [self.nats_url], "stream": self.name, "columns": COLUMNS})
        sink_config = {"url": self.postgres_url, "table": self.table, "epoch_column": EPOCH_COLUMN, **sink}
        return StreamSpec(
            name=self.name,
            source=NatsStreamSource(source),
            sink=PostgresStreamingSink(PostgresStreamingSinkConfig.parse(sink_config)),
            resources=(self.name,),
            policy=self.policy,
            key=("id",) if self.policy is not WritePolicy.APPEND else (),
            schemas={self.name: ResourceSchema.from_columns(COLUMNS)},
            limits=ReadLimits(records=100, idle=0.2),
            lease_seconds=30,
        )

    def publish(self, rows: list[dict[str, Any]]) -> None:
        async def send() -> None:
            client = await nats.connect(self.nats_url)
            try:
                js = client.jetstream()
                for row in rows:
                    await js.publish(f"{self.name}.rows", json.dumps(row).encode())
            finally:
                await client.close()

        asyncio.run(send())
        self.published += len(rows)

    def run(self, **sink: Any) -> list[EpochCertificate]:
        """Run epochs until the stream has certified everything published."""

        async def scenario() -> list[EpochCertificate]:
            runner = StreamRunner(self.spec(**sink), self.store, worker_id="w1")
            try:
                return await runner.run_epochs(30.0)
            finally:
                await runner.close()

        return asyncio.run(scenario())

    def verify(self, **options: Any) -> Report:
        return asyncio.run(
            verify_stream(self.spec(), self.store, VerifyOptions(**{"first": 1, "record": False, **options}))
        )

    def sql(self, statement: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.postgres_url, autocommit=True) as conn:
            cursor = conn.execute(statement.replace("{table}", f'"{self.table}"'), params)
            return cursor.fetchall() if cursor.description else []


def outcomes(report: Report) -> dict[int, Outcome]:
    return {item.sequence: item.outcome for item in report.verifications}


def found(report: Report, sequence: int) -> list[str]:
    """The kinds of problem found for certificate ``sequence``."""
    [item] = [item for item in report.verifications if item.sequence == sequence]
    return [finding.kind for finding in item.problems]


async def _create(nats_url: str, name: str) -> None:
    client = await nats.connect(nats_url)
    try:
        await client.jetstream().add_stream(name=name, subjects=[f"{name}.>"])
    finally:
        await client.close()


@pytest.fixture
def stream(nats_url: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path) -> Iterator[Stream]:
    name = unique_name("v")
    asyncio.run(_create(nats_url, name))
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    made = Stream(nats_url, postgres_url, name, store)
    made.publish([{"id": n, "name": f"row-{n}"} for n in range(300)])
    certificates = made.run()
    assert sum(sum(c.row_counts.values()) for c in certificates) == 300 and len(certificates) >= 3
    yield made
    store.close()


def test_an_untouched_stream_verifies_and_a_tampered_row_is_named(stream: Stream) -> None:
    clean = stream.verify()
    assert set(outcomes(clean).values()) == {Outcome.VERIFIED}, clean.verifications
    assert clean.rows_replayed == 300 and clean.rows_compared == 300

    # A row deleted at the destination: its certificate diverged, naming the event's position.
    [(epoch,)] = stream.sql("DELETE FROM {table} WHERE id = 150 RETURNING " + EPOCH_COLUMN)
    report = stream.verify()
    assert outcomes(report)[epoch] is Outcome.DIVERGED and found(report, epoch) == ["missing row"]
    assert "@151#0" in report.verifications[epoch - 1].problems[0].where  # stream sequence 151
    assert {s for s, o in outcomes(report).items() if o is Outcome.DIVERGED} == {epoch}
    stream.sql("INSERT INTO {table} (id, name, " + EPOCH_COLUMN + ") VALUES (150, 'row-150', %s)", epoch)

    # A row changed: named with what it should hold and what it holds.
    stream.sql("UPDATE {table} SET name = 'forged' WHERE id = 42")
    report = stream.verify()
    [(epoch,)] = stream.sql("SELECT " + EPOCH_COLUMN + " FROM {table} WHERE id = 42")
    assert found(report, epoch) == ["changed row"]
    detail = report.verifications[epoch - 1].problems[0].detail
    assert "row-42" in detail and "forged" in detail
    stream.sql("UPDATE {table} SET name = 'row-42' WHERE id = 42")

    # A row duplicated.
    stream.sql("INSERT INTO {table} SELECT * FROM {table} WHERE id = 7")
    [(epoch,)] = stream.sql("SELECT DISTINCT " + EPOCH_COLUMN + " FROM {table} WHERE id = 7")
    report = stream.verify()
    assert found(report, epoch) == ["duplicated row"]
    assert "2 copies" in report.verifications[epoch - 1].problems[0].detail
    stream.sql("DELETE FROM {table} WHERE ctid = (SELECT max(ctid) FROM {table} WHERE id = 7)")
    assert set(outcomes(stream.verify()).values()) == {Outcome.VERIFIED}

