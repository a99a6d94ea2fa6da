"""The NATS JetStream connector: sources (continuous and bounded) over one stream, and sinks.

This entry module is thin (no nats-py import): the factories import the client when a connector is
built. See ``README.md`` beside it for delivery per policy, what an acknowledgement means, and how
duplicates are handled. The sink roles (continuous and bounded APPEND) live in
:mod:`faucet_nats.sink`.
"""

from faucet_dagster.protocol import (
    ConnectorRole,
    ConnectorSpec,
    Role,
    Sink,
    Source,
    StreamingSink,
    StreamSource,
)
from faucet_nats.config import RAW_SCHEMA, NatsConnectionConfig, NatsSourceConfig
from faucet_nats.sink_config import NatsSinkConfig


def _stream_source(config: NatsSourceConfig) -> StreamSource:
    from faucet_nats.source import NatsStreamSource

    return NatsStreamSource(config)


def _source(config: NatsSourceConfig) -> Source:
    from faucet_nats.bounded import NatsSource

    return NatsSource(config)


def _streaming_sink(config: NatsSinkConfig) -> StreamingSink:
    from faucet_nats.sink import NatsStreamingSink

    return NatsStreamingSink(config)


def _sink(config: NatsSinkConfig) -> Sink:
    from faucet_nats.sink import NatsSink

    return NatsSink(config)


CONNECTOR = ConnectorSpec(
    name="nats",
    roles={
        Role.STREAM_SOURCE: ConnectorRole(NatsSourceConfig, _stream_source),
        Role.SOURCE: ConnectorRole(NatsSourceConfig, _source),
        Role.STREAMING_SINK: ConnectorRole(NatsSinkConfig, _streaming_sink),
        Role.SINK: ConnectorRole(NatsSinkConfig, _sink),
    },
    description="NATS JetStream streams: a durable push consumer at the certified sequence, acknowledged "
    "cumulatively after certification.",
    docs={"readme": "connectors/faucet_nats/README.md"},
)

__all__ = ["CONNECTOR", "RAW_SCHEMA", "NatsConnectionConfig", "NatsSinkConfig", "NatsSourceConfig"]
