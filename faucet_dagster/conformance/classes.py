"""``conformance_tests``: a connector's whole conformance test module in one line.

::

    from faucet_dagster.conformance import conformance_tests
    from faucet_dagster.conformance.targets import postgres_sink

    TestPostgresSink = conformance_tests(sink="postgres", config=postgres_sink)

The returned class has one test per check of the role's suite (``test_conformance[<check id>]``).
Each test builds a fresh setup by calling the config factory with the fixtures it names (the real
servers of :mod:`faucet_dagster.testing.pytest_plugin`), runs the check and cleans the setup up; the
generated scenarios call the factory again for every run, on the session's servers. A check that does
not apply passes after asserting the connector's honest declaration; nothing skips.
``--conformance-seed`` and ``--conformance-examples`` choose the scenarios (see
:mod:`faucet_dagster.conformance.pytest_plugin`).
"""

import asyncio
import dataclasses
from typing import Any

import pytest

from faucet_dagster.conformance.fixtures import Fixtures
from faucet_dagster.conformance.harness import Subject
from faucet_dagster.conformance.options import DEFAULT_OPTIONS, ConformanceOptions
from faucet_dagster.conformance.setup import ConfigFactory, factory_fixtures
from faucet_dagster.conformance.suites import CHECKS_BY_ID, SUITES, run_check
from faucet_dagster.conformance.table import PROPERTY
from faucet_dagster.protocol import ConfigError, ConnectorSpec, Role, get_connector


def conformance_tests(
    *,
    config: ConfigFactory,
    source: str | ConnectorSpec | None = None,
    sink: str | ConnectorSpec | None = None,
    stream_source: str | ConnectorSpec | None = None,
    streaming_sink: str | ConnectorSpec | None = None,
    options: ConformanceOptions = DEFAULT_OPTIONS,
) -> type:
    """A pytest test class running the battery on one role of a connector (a name or a spec).

    Exactly one of ``source``, ``sink``, ``stream_source``, ``streaming_sink`` names the role under
    test. ``config`` is the config factory (see :mod:`faucet_dagster.conformance.setup`).
    """
    named = {
        Role.SOURCE: source,
        Role.SINK: sink,
        Role.STREAM_SOURCE: stream_source,
        Role.STREAMING_SINK: streaming_sink,
    }
    chosen = [(role, connector) for role, connector in named.items() if connector is not None]
    if len(chosen) != 1:
        raise ConfigError(
            "conformance_tests takes exactly one of source, sink, stream_source, streaming_sink"
        )
    role, connector = chosen[0]
    checks = [
        check.id for check in SUITES[role].checks if options.checks is None or check.id in options.checks
    ]
    fixtures = factory_fixtures(config)

    class ConformanceTests:
        __doc__ = f"The conformance battery on the {role.value} role of {_name(connector)}."

        @pytest.fixture
        def conformance_subject(self, request: pytest.FixtureRequest) -> Any:
            spec = get_connector(connector) if isinstance(connector, str) else connector
            setup = config(**{name: request.getfixturevalue(name) for name in fixtures})
            chosen = options
            for option, field in (("--conformance-seed", "seed"), ("--conformance-examples", "examples")):
                value = request.config.getoption(option, default=None)
                if value is not None:
                    chosen = dataclasses.replace(chosen, **{field: value})
            more = Fixtures(
                lambda kind: request.getfixturevalue(f"{kind}_server").start(), hint=request.node.name
            )
            yield Subject(spec, role, setup, chosen, fresh=more.fresh(config))
            more.close()

        @pytest.mark.parametrize("check_id", checks)
        def test_conformance(self, conformance_subject: Subject, check_id: str, request: Any) -> None:
            report: dict[str, Any] = {"subject": conformance_subject.label, "check": check_id}
            request.node.user_properties.append((PROPERTY, report))
            outcome = asyncio.run(run_check(CHECKS_BY_ID[check_id], conformance_subject))
            report.update(
                status=outcome.status.value, detail=outcome.detail, exercised=list(outcome.exercised)
            )

    ConformanceTests.__name__ = ConformanceTests.__qualname__ = f"Conformance_{_name(connector)}_{role.value}"
    return ConformanceTests


def _name(connector: str | ConnectorSpec) -> str:
    return connector if isinstance(connector, str) else connector.name
