"""The Kafka connector: a continuous StreamSource and a bounded Source over Kafka-protocol topics.

This entry module is thin (no confluent-kafka import): the factories import the client when a
connector is built. See ``README.md`` beside it for delivery per policy, what an acknowledgement
means, and how duplicates are handled.
"""

from faucet_dagster.protocol import ConnectorRole, ConnectorSpec, Role, Source, StreamSource
from faucet_kafka.config import KafkaSourceConfig


def _stream_source(config: KafkaSourceConfig) -> StreamSource:
    from faucet_kafka.source import KafkaStreamSource

    return KafkaStreamSource(config)


def _source(config: KafkaSourceConfig) -> Source:
    from faucet_kafka.bounded import KafkaSource

    return KafkaSource(config)


CONNECTOR = ConnectorSpec(
    name="kafka",
    roles={
        Role.STREAM_SOURCE: ConnectorRole(KafkaSourceConfig, _stream_source),
        Role.SOURCE: ConnectorRole(KafkaSourceConfig, _source),
    },
    description="Kafka-protocol topics: partitions assigned by lease, offsets committed after certification.",
    docs={"readme": "connectors/faucet_kafka/README.md"},
)

__all__ = ["CONNECTOR", "KafkaSourceConfig"]
