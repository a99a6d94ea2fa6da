"""Config factories for the connectors of this repository, against the real test servers.

Each factory creates what its connector needs on the server (a database table, a replication slot, a
JetStream stream, a Kafka topic, a directory of files), starting empty, and returns the setup with the
hooks the battery uses: add rows the way real data arrives, read a destination back through the
system's own client, a config whose endpoint does not answer, a record the source cannot turn into a
row, and the provider's acknowledgement state. :data:`TARGETS` lists them by connector and role, with
the options each needs (``faucet conformance --all`` runs exactly these).

Client libraries (psycopg, nats-py, confluent-kafka) are imported inside the factories.
"""

from collections.abc import Mapping

from faucet_dagster.conformance.options import DEFAULT_OPTIONS, ConformanceOptions
from faucet_dagster.conformance.setup import ConfigFactory
from faucet_dagster.conformance.targets._common import closed_port
from faucet_dagster.conformance.targets.delta import (
    DELTA_STREAMING_OPTIONS,
    delta_s3_sink,
    delta_s3_streaming_sink,
    delta_sink,
    delta_streaming_sink,
)
from faucet_dagster.conformance.targets.duckdb import duckdb_sink, duckdb_source, duckdb_streaming_sink
from faucet_dagster.conformance.targets.kafka import kafka_source
from faucet_dagster.conformance.targets.local import files_source, sql_sink, sql_source
from faucet_dagster.conformance.targets.nats import nats_sink, nats_source
from faucet_dagster.conformance.targets.postgres import (
    postgres_cdc_source,
    postgres_sink,
    postgres_source,
    postgres_streaming_sink,
)
from faucet_dagster.protocol import Role

TARGETS: Mapping[str, Mapping[Role, tuple[ConfigFactory, ConformanceOptions]]] = {
    "files": {Role.SOURCE: (files_source, DEFAULT_OPTIONS)},
    "sql": {Role.SOURCE: (sql_source, DEFAULT_OPTIONS), Role.SINK: (sql_sink, DEFAULT_OPTIONS)},
    "postgres": {
        Role.SOURCE: (postgres_source, DEFAULT_OPTIONS),
        Role.SINK: (postgres_sink, DEFAULT_OPTIONS),
        Role.STREAM_SOURCE: (postgres_cdc_source, DEFAULT_OPTIONS),
        Role.STREAMING_SINK: (postgres_streaming_sink, DEFAULT_OPTIONS),
    },
    "nats": {
        Role.SOURCE: (nats_source, DEFAULT_OPTIONS),
        Role.SINK: (nats_sink, DEFAULT_OPTIONS),
        Role.STREAM_SOURCE: (nats_source, DEFAULT_OPTIONS),
        Role.STREAMING_SINK: (nats_sink, ConformanceOptions(replay_duplicates="within_window")),
    },
    "duckdb": {
        Role.SOURCE: (duckdb_source, DEFAULT_OPTIONS),
        Role.SINK: (duckdb_sink, DEFAULT_OPTIONS),
        Role.STREAMING_SINK: (duckdb_streaming_sink, DEFAULT_OPTIONS),
    },
    "delta": {
        Role.SINK: (delta_sink, DEFAULT_OPTIONS),
        Role.STREAMING_SINK: (delta_streaming_sink, DELTA_STREAMING_OPTIONS),
    },
    "kafka": {
        Role.SOURCE: (kafka_source, DEFAULT_OPTIONS),
        Role.STREAM_SOURCE: (kafka_source, DEFAULT_OPTIONS),
    },
}
"""Every connector role of this repository with its config factory and options."""


def target(connector: str, role: Role) -> tuple[ConfigFactory, ConformanceOptions]:
    return TARGETS[connector][role]


__all__ = [
    "DELTA_STREAMING_OPTIONS",
    "TARGETS",
    "closed_port",
    "delta_s3_sink",
    "delta_s3_streaming_sink",
    "delta_sink",
    "delta_streaming_sink",
    "duckdb_sink",
    "duckdb_source",
    "duckdb_streaming_sink",
    "files_source",
    "kafka_source",
    "nats_sink",
    "nats_source",
    "postgres_cdc_source",
    "postgres_sink",
    "postgres_source",
    "postgres_streaming_sink",
    "sql_sink",
    "sql_source",
    "target",
]
