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


def test_a_subclass_overriding_one_session_method_passes_the_scenarios(
    request: pytest.FixtureRequest,
) -> None:
    """The scenarios run the connector in worker processes: the subclass (a class of this test module)
    is what they build there, and its acknowledgements are what they judge."""
    setup = kafka_source(**{name: request.getfixturevalue(name) for name in factory_fixtures(kafka_source)})
    outcome = asyncio.run(
        run_check(CHECKS_BY_ID["scenarios"], Subject(SPEC, Role.STREAM_SOURCE, setup, DEFAULT_OPTIONS))
    )
    assert outcome.status.value == "pass", outcome.detail
    assert "acknowledge after authority()" in outcome.exercised


def test_the_subclass_is_what_the_worker_builds() -> None:
    from faucet_dagster.conformance.scenarios.agent import AgentPlan
    from faucet_dagster.conformance.scenarios.workers import Worker

    async def built() -> str:
        worker = Worker(AgentPlan(SPEC, Role.STREAM_SOURCE), timeout=30)
        try:
            handle = await worker.build(
                {"bootstrap_servers": "127.0.0.1:9", "topics": ["t"], "group_id": "g"}
            )
            return str(await worker.request("attribute", handle, "session_type"))
        finally:
            await worker.stop()

    assert "CountingSession" in asyncio.run(built())
