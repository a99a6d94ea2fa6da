"""The conformance battery on the NATS JetStream connector: every role."""

from faucet_dagster.conformance import ConformanceOptions
from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.targets import nats_sink, nats_source

TestNatsStreamSource = conformance_tests(stream_source="nats", config=nats_source)
TestNatsSource = conformance_tests(source="nats", config=nats_source)
TestNatsStreamingSink = conformance_tests(
    streaming_sink="nats", config=nats_sink, options=ConformanceOptions(replay_duplicates="within_window")
)
TestNatsSink = conformance_tests(sink="nats", config=nats_sink)
