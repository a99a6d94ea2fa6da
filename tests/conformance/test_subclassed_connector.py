"""A subclass of a shipped connector overrides one session method, with no private code copied,
and passes the battery's checks of that method."""

import asyncio
from typing import ClassVar

import pytest
from faucet_kafka.config import KafkaSourceConfig
from faucet_kafka.source import KafkaStreamSession, KafkaStreamSource

from faucet_dagster.conformance import CHECKS_BY_ID, Subject, run_check
from faucet_dagster.conformance.options import DEFAULT_OPTIONS
from faucet_dagster.conformance.setup import factory_fixtures
from faucet_dagster.conformance.targets import kafka_source
from faucet_dagster.protocol import Authority, ConnectorRole, ConnectorSpec, Coverage, Role


class CountingSession(KafkaStreamSession):
    """Counts the acknowledgements it is asked for, then acknowledges as the shipped session does."""

    acknowledged: ClassVar[list[Coverage]] = []

    async def acknowledge(self, coverage: Coverage, authority: Authority) -> None:
        CountingSession.acknowledged.append(coverage)
        await super().acknowledge(coverage, authority)


class CountingSource(KafkaStreamSource):
    session_type = CountingSession


SPEC = ConnectorSpec("kafka_counting", {Role.STREAM_SOURCE: ConnectorRole(KafkaSourceConfig, CountingSource)})


@pytest.mark.parametrize("check", ["ownership_lost_before_ack", "speculative_ack"])
def test_a_subclass_overriding_one_session_method_passes_the_checks_of_it(
    request: pytest.FixtureRequest, check: str
) -> None:
    CountingSession.acknowledged.clear()
    setup = kafka_source(**{name: request.getfixturevalue(name) for name in factory_fixtures(kafka_source)})
    outcome = asyncio.run(
        run_check(CHECKS_BY_ID[check], Subject(SPEC, Role.STREAM_SOURCE, setup, DEFAULT_OPTIONS))
    )
    assert outcome.status.value == "pass", outcome.detail
    if check == "ownership_lost_before_ack":
        assert CountingSession.acknowledged, "the subclass's session was not the one opened"
