"""The ``faucet_conformance`` pytest plugin (``pytest11`` entry point): the table at the end of a run.

Every test built by :func:`faucet_dagster.conformance.conformance_tests` reports its connector role,
check and outcome in ``user_properties``; this plugin collects them and prints the table of checks by
connector in the terminal summary (pass, FAIL, n/a). ``--conformance-seed S`` and
``--conformance-examples N`` choose the generated scenarios (a failure prints both). It imports only
pytest and the standard-library table module: loading it costs nothing when no conformance test runs.
"""

from typing import Any

import pytest

from faucet_dagster.conformance.table import PROPERTY, Result, format_table

_results: list[Result] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("faucet conformance")
    group.addoption(
        "--conformance-seed",
        type=int,
        default=None,
        help="the seed of the battery's generated scenarios (replays a failure it printed)",
    )
    group.addoption(
        "--conformance-examples",
        type=int,
        default=None,
        help="how many scenarios of the seed each connector role runs",
    )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call":
        return
    for name, value in report.user_properties:
        if name == PROPERTY and isinstance(value, dict):
            status = "fail" if report.failed else str(value.get("status", "fail"))
            detail = str(value.get("detail", "")) if not report.failed else _first_line(report)
            exercised = tuple(str(item) for item in value.get("exercised", ()))
            _results.append(Result(str(value["subject"]), str(value["check"]), status, detail, exercised))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _results:
        terminalreporter.section("faucet conformance")
        terminalreporter.write_line(format_table(_results))


def _first_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    return str(getattr(crash, "message", report.longrepr)).splitlines()[0]
