"""The source/sink pairs the fault harness breaks, on real servers.

A pair is a :class:`SourceSide` (NATS JetStream, Kafka, files, a PostgreSQL table read by change
data capture) and a :class:`SinkSide` (PostgreSQL, NATS JetStream) in a mode and a write policy. A
side creates its stream, topic, directory, table or target, configures its connector as a user
would, and reads back what it holds. Every record produced is ``{"id", "producer", "seq"}``: its key
for the oracle is ``(producer, seq)``, and the source tells where it stored it (:class:`Produced`:
resource, partition, position) so certificates can be mapped back to records. A change source
(:class:`PostgresChangesSource`) also inserts, updates, deletes and re-keys rows; its destination is
judged by its final state against the source table's (:meth:`SourceSide.state`), not record by record.

The controller calls these from plain threads (no event loop of its own); NATS calls run on a
private loop per call.
"""

from dataclasses import dataclass

from faucet_dagster.planner import Plan, plan
from faucet_dagster.protocol import Mode, WritePolicy, get_connector
from faucet_dagster.testing.faults.sides import (
    CHANGES_TABLE,
    KAFKA_PARTITIONS,
    KAFKA_PURGE,
    RECORD_COLUMNS,
    STREAM_SINK_TIMEOUTS,
    Key,
    Produced,
    Row,
    Servers,
)
from faucet_dagster.testing.faults.sink_sides import (
    NatsSinkSide,
    PostgresMultisetSinkSide,
    PostgresSinkSide,
    PostgresStreamSinkSide,
    SinkSide,
)
from faucet_dagster.testing.faults.source_sides import (
    FilesSource,
    KafkaSource,
    NatsSource,
    PostgresChangesSource,
    PostgresSnapshotChangesSource,
    PostgresUnkeyedChangesSource,
    SourceSide,
)
from faucet_dagster.testing.faults.spec import Endpoint


@dataclass(frozen=True)
class Pair:
    """A source side and a sink side in one mode; ``name`` is how the command line selects it.
    ``policy`` is a continuous stream's write policy (a bounded sink chooses its own)."""

    name: str
    mode: Mode
    source: type[SourceSide]
    sink: type[SinkSide]
    policy: WritePolicy = WritePolicy.APPEND

    @property
    def label(self) -> str:
        suffix = " (bounded)" if self.mode is Mode.BOUNDED else ""
        if self.policy is not WritePolicy.APPEND:
            suffix += f" ({self.policy.value.replace('_', ' ')})"
        return f"{self.source.label} -> {self.sink.label}{suffix}"

    @property
    def servers_used(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.source.servers_used, *self.sink.servers_used)))

    def plan(self, source: Endpoint, sink: Endpoint) -> Plan:
        """What the planner promises for this pair with these configs (durable state, no dead-letter
        route): the oracle's rule for duplicates comes from here, never from this harness."""
        if self.mode is Mode.CONTINUOUS:
            source_caps = get_connector(source.connector).stream_source(source.config).capabilities()
            sink_caps = get_connector(sink.connector).streaming_sink(sink.config).capabilities()
            return plan(source_caps, sink_caps, Mode.CONTINUOUS, self.policy, durable_state=True)
        bounded_sink = get_connector(sink.connector).sink(sink.config)
        policy, key = bounded_sink.write_mode()
        source_caps = get_connector(source.connector).source(source.config).capabilities()
        return plan(source_caps, bounded_sink.capabilities(), Mode.BOUNDED, policy, key, durable_state=True)


PAIRS: tuple[Pair, ...] = (
    Pair("nats-postgres", Mode.CONTINUOUS, NatsSource, PostgresStreamSinkSide),
    Pair("kafka-postgres", Mode.CONTINUOUS, KafkaSource, PostgresStreamSinkSide),
    Pair("kafka-nats", Mode.CONTINUOUS, KafkaSource, NatsSinkSide),
    Pair("nats-nats", Mode.CONTINUOUS, NatsSource, NatsSinkSide),
    Pair(
        "cdc-postgres",
        Mode.CONTINUOUS,
        PostgresChangesSource,
        PostgresStreamSinkSide,
        WritePolicy.APPLY_CHANGES,
    ),
    Pair(
        "cdc-snapshot-postgres",
        Mode.CONTINUOUS,
        PostgresSnapshotChangesSource,
        PostgresStreamSinkSide,
        WritePolicy.APPLY_CHANGES,
    ),
    Pair(
        "cdc-unkeyed-postgres",
        Mode.CONTINUOUS,
        PostgresUnkeyedChangesSource,
        PostgresMultisetSinkSide,
        WritePolicy.APPLY_CHANGES,
    ),
    Pair("files-postgres-bounded", Mode.BOUNDED, FilesSource, PostgresSinkSide),
    Pair("kafka-postgres-bounded", Mode.BOUNDED, KafkaSource, PostgresSinkSide),
    Pair("nats-postgres-bounded", Mode.BOUNDED, NatsSource, PostgresSinkSide),
)
"""Every pair the harness runs, in table order."""


def pair_named(name: str) -> Pair:
    for pair in PAIRS:
        if pair.name == name:
            return pair
    raise KeyError(f"no pair {name!r} (pairs: {', '.join(pair.name for pair in PAIRS)})")


__all__ = [
    "CHANGES_TABLE",
    "KAFKA_PARTITIONS",
    "KAFKA_PURGE",
    "PAIRS",
    "RECORD_COLUMNS",
    "STREAM_SINK_TIMEOUTS",
    "FilesSource",
    "KafkaSource",
    "Key",
    "NatsSinkSide",
    "NatsSource",
    "Pair",
    "PostgresChangesSource",
    "PostgresSinkSide",
    "PostgresSnapshotChangesSource",
    "PostgresStreamSinkSide",
    "PostgresUnkeyedChangesSource",
    "Produced",
    "Row",
    "Servers",
    "SinkSide",
    "SourceSide",
    "pair_named",
]
