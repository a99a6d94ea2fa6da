"""The conformance battery on the SQL connector (SQLite)."""

from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.targets import sql_sink, sql_source

TestSqlSource = conformance_tests(source="sql", config=sql_source)
TestSqlSink = conformance_tests(sink="sql", config=sql_sink)
