"""The conformance battery on the Delta Lake sinks, bounded and streaming (local tables)."""

from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.targets import DELTA_STREAMING_OPTIONS, delta_sink, delta_streaming_sink

TestDeltaSink = conformance_tests(sink="delta", config=delta_sink)
TestDeltaStreamingSink = conformance_tests(
    streaming_sink="delta", config=delta_streaming_sink, options=DELTA_STREAMING_OPTIONS
)
