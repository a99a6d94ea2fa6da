"""Members of a stream divided into partition groups, in worker processes the test kills, adds,
stops and freezes past their leases: a 12-partition Kafka topic into PostgreSQL, judged record by
record and by the certificates (one owner per partition at a time, coverage chained across owners).
The randomized run is ``python -m faucet_dagster.testing.faults.members --iterations 100``."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from faucet_dagster.testing import KafkaServer, NatsServer, PostgresServer, make_unique_name
from faucet_dagster.testing.faults.members import ACTIONS, member_schedule, run_member_case
from faucet_dagster.testing.faults.pairs import Servers


@pytest.fixture(scope="module")
def servers(
    postgres_server: PostgresServer, nats_server: NatsServer, kafka_server: KafkaServer
) -> Iterator[Servers]:
    name = make_unique_name("members")
    yield Servers(postgres_server, nats_server, kafka_server, postgres_server.create_database(name))
    postgres_server.drop_database(name)


def test_a_schedule_holds_every_kind_of_membership_change() -> None:
    assert sorted(member_schedule(3, 4)) == sorted(ACTIONS)
    assert member_schedule(3, 8) == member_schedule(3, 8)


def test_kill_add_stop_and_freeze_members_lose_and_duplicate_nothing(
    servers: Servers, tmp_path: Path
) -> None:
    result = run_member_case(servers, tmp_path, seed=16)
    assert result.passed, result
    assert result.verdict.records == result.verdict.found > 0
    assert result.domains == 12
    assert result.owner_changes > 0, "partitions changed owner"
