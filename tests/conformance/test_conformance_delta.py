"""The conformance battery on the Delta Lake sink (local tables)."""

from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.targets import delta_sink

TestDeltaSink = conformance_tests(sink="delta", config=delta_sink)
