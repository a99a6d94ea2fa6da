"""Position codec of Kafka: a partition offset within one topic incarnation (cluster id + topic id)."""

from faucet_dagster.protocol import IntegerPositionCodec


class KafkaOffsetCodec(IntegerPositionCodec):
    """A Kafka partition offset; the first record of a partition has offset 0."""

    name = "kafka.offset"
    minimum = 0
