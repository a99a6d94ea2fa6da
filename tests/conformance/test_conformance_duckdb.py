"""The conformance battery on the DuckDB connector: bounded source and sink, streaming sink."""

from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.targets import duckdb_sink, duckdb_source, duckdb_streaming_sink

TestDuckDbSource = conformance_tests(source="duckdb", config=duckdb_source)
TestDuckDbSink = conformance_tests(sink="duckdb", config=duckdb_sink)
TestDuckDbStreamingSink = conformance_tests(streaming_sink="duckdb", config=duckdb_streaming_sink)
