"""The conformance battery on the PostgreSQL connector: bounded source and sink, streaming sink, CDC."""

from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.targets import (
    postgres_cdc_source,
    postgres_sink,
    postgres_source,
    postgres_streaming_sink,
)

TestPostgresSource = conformance_tests(source="postgres", config=postgres_source)
TestPostgresSink = conformance_tests(sink="postgres", config=postgres_sink)
TestPostgresStreamingSink = conformance_tests(streaming_sink="postgres", config=postgres_streaming_sink)
TestPostgresCdcSource = conformance_tests(stream_source="postgres", config=postgres_cdc_source)
