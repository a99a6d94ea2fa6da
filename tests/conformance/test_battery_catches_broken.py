"""Self-tests of the conformance battery: every check catches a connector that breaks its rule.

The cases are :data:`faucet_dagster.conformance.selftest.CASES`: each broken connector wraps a real one
and breaks exactly one thing; its check runs against the real server and must fail with a
ConformanceFailure naming the check's rule (never another rule, never a raw exception). The passing
side of every check is the battery's run on the real connectors (``test_conformance_<connector>.py``).
"""

import pytest

from faucet_dagster.conformance.selftest import CASES, SelfTestCase, run_case
from faucet_dagster.conformance.setup import factory_fixtures


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_check_catches_the_broken_connector(request: pytest.FixtureRequest, case: SelfTestCase) -> None:
    setup = case.factory(**{name: request.getfixturevalue(name) for name in factory_fixtures(case.factory)})
    failure = run_case(case, setup)
    assert str(failure).startswith(f"[{case.rule}]")


def test_every_check_has_a_broken_connector_it_catches() -> None:
    from faucet_dagster.conformance import CHECKS

    caught = {case.check for case in CASES}
    assert [check.id for check in CHECKS if check.id not in caught] == []


def test_every_rule_is_broken_by_at_least_two_different_connectors() -> None:
    from collections import Counter

    from faucet_dagster.conformance import CHECKS

    mechanisms = Counter(case.check for case in {(case.check, case.broken): case for case in CASES}.values())
    assert {check.id: mechanisms[check.id] for check in CHECKS if mechanisms[check.id] < 2} == {}


def test_faucet_conformance_self_test_prints_which_check_caught_which_broken_connector(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from faucet_dagster.cli.main import main

    assert main(["conformance", "--self-test", "--check", "config_schema", "--check", "resume"]) == 0
    printed = capsys.readouterr().out
    assert "InvalidSchemaSource (files source)" in printed
    assert "-> config_schema" in printed and "-> resume" in printed
    assert "4 of 4 broken connectors caught by the check of their rule" in printed
