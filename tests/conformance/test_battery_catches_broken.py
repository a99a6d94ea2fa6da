"""Self-tests of the conformance battery: every check catches a connector that breaks its rule.

The cases are :data:`faucet_dagster.conformance.selftest.CASES`: each broken connector wraps a real one
and breaks exactly one thing; its check runs against the real server and must fail with a
ConformanceFailure naming one of the case's rules (never another rule, never a raw exception). The
generated scenarios must catch theirs under every seed: here each scenario case runs under one seed,
the cases spread over :data:`~faucet_dagster.conformance.selftest.SEEDS` seeds (``faucet conformance
--self-test`` runs every case under every seed). The passing side of every check is the battery's run
on the real connectors (``test_conformance_<connector>.py``).
"""

from collections.abc import Iterator

import pytest

from faucet_dagster.conformance.fixtures import Fixtures
from faucet_dagster.conformance.selftest import CASES, DIMENSIONS, SEEDS, SelfTestCase, run_case
from faucet_dagster.conformance.setup import factory_fixtures

RUNS = [(case, number % SEEDS if case.seeded else 0) for number, case in enumerate(CASES)]


@pytest.fixture
def fresh_setups(request: pytest.FixtureRequest) -> Iterator[Fixtures]:
    fixtures = Fixtures(
        lambda kind: request.getfixturevalue(f"{kind}_server").start(), hint=request.node.name
    )
    yield fixtures
    fixtures.close()


@pytest.mark.parametrize(
    ("case", "seed"), RUNS, ids=[f"{case.id}-seed{seed}" if case.seeded else case.id for case, seed in RUNS]
)
def test_the_check_catches_the_broken_connector(
    request: pytest.FixtureRequest, fresh_setups: Fixtures, case: SelfTestCase, seed: int
) -> None:
    setup = case.factory(**{name: request.getfixturevalue(name) for name in factory_fixtures(case.factory)})
    failure = run_case(case, setup, seed=seed, fresh=fresh_setups.fresh(case.factory))
    assert failure.rule in case.accepted


def test_every_check_has_a_broken_connector_it_catches() -> None:
    from faucet_dagster.conformance import CHECKS

    caught = {case.check for case in CASES}
    assert [check.id for check in CHECKS if check.id not in caught] == []


def test_every_rule_is_broken_by_at_least_two_different_connectors() -> None:
    from collections import Counter

    from faucet_dagster.conformance import CHECKS

    mechanisms = Counter(case.check for case in {(case.check, case.broken): case for case in CASES}.values())
    assert {check.id: mechanisms[check.id] for check in CHECKS if mechanisms[check.id] < 2} == {}


def test_every_dimension_has_a_broken_connector_that_only_the_scenarios_catch() -> None:
    """One broken connector per dimension of the issue, caught by the generated scenarios: no check
    is written for any of them."""
    from faucet_dagster.conformance import CHECKS

    by_dimension = {case.dimension: case for case in CASES if case.dimension is not None}
    assert sorted(by_dimension) == sorted(DIMENSIONS)
    assert {case.check for case in by_dimension.values()} == {"scenarios"}
    assert {check.id for check in CHECKS} & {"resume", "idempotent_replay", "replay_after_commit"} == set()


def test_faucet_conformance_self_test_prints_which_check_caught_which_broken_connector(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from faucet_dagster.cli.main import main

    assert main(["conformance", "--self-test", "--check", "config_schema", "--check", "capabilities"]) == 0
    printed = capsys.readouterr().out
    assert "InvalidSchemaSource (files source)" in printed
    assert "-> config_schema" in printed and "-> capabilities" in printed
    assert "7 of 7 broken connector runs caught" in printed
