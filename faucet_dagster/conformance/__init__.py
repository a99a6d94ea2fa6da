"""The conformance battery: the Faucet Connector Protocol and the streaming contract, executable.

A connector is conformant exactly when its role passes its suite (:data:`SUITES`). In a connector's
tests, one line builds the test class::

    TestPostgresSink = conformance_tests(sink="postgres", config=postgres_sink)

(``config`` is a config factory: see :mod:`.setup`; ours are in :mod:`.targets`). From the command
line, ``faucet conformance <connector>`` or ``--all`` runs the same checks against the test servers
and prints the table of checks by connector. The checks themselves are in :mod:`.bounded` (FCP 1-6)
and :mod:`.streaming` (the interruptions). Imports protocol, planner, pipeline; never Dagster.
"""

from faucet_dagster.conformance.harness import Subject
from faucet_dagster.conformance.options import (
    ConformanceFailure,
    ConformanceOptions,
    Outcome,
    ReplayDuplicates,
    Status,
)
from faucet_dagster.conformance.setup import ConfigFactory, SinkSetup, SourceSetup, make_rows
from faucet_dagster.conformance.suites import CHECKS, CHECKS_BY_ID, SUITES, Check, Suite, run_check

__all__ = [
    "CHECKS",
    "CHECKS_BY_ID",
    "SUITES",
    "Check",
    "ConfigFactory",
    "ConformanceFailure",
    "ConformanceOptions",
    "Outcome",
    "ReplayDuplicates",
    "SinkSetup",
    "SourceSetup",
    "Status",
    "Subject",
    "Suite",
    "conformance_tests",
    "make_rows",
    "run_check",
]


def __getattr__(name: str) -> object:
    # conformance_tests needs pytest: imported only when asked for.
    if name == "conformance_tests":
        from faucet_dagster.conformance.classes import conformance_tests

        return conformance_tests
    raise AttributeError(name)
