"""The conformance battery on the SQL connector: SQLite, and PostgreSQL through SQLAlchemy and psycopg.

Each dialect the README names for the ``sql`` connector runs the battery here (and the SQL sink's suite,
``tests/connectors/test_sql_connector.py``). The PostgreSQL setup is the ``postgres`` connector's: the
same URL, table and modes, written by the ``sql`` connector instead.
"""

from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.targets import postgres_sink, sql_sink, sql_source

TestSqlSource = conformance_tests(source="sql", config=sql_source)
TestSqlSink = conformance_tests(sink="sql", config=sql_sink)
TestSqlSinkOnPostgresql = conformance_tests(sink="sql", config=postgres_sink)
