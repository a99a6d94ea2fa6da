"""Position codec of JetStream: a stream sequence (1, 2, ...) within one stream incarnation."""

from faucet_dagster.protocol import IntegerPositionCodec


class NatsStreamSequenceCodec(IntegerPositionCodec):
    """A JetStream stream sequence; the first message of a stream has sequence 1."""

    name = "nats.stream_sequence"
    minimum = 1
