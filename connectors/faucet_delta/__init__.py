"""faucet_delta: Delta Lake tables through delta-rs (the ``deltalake`` wheel).

Registered as the ``delta`` connector (``faucet.connectors`` entry point), with a bounded sink
(:mod:`faucet_delta.sink`): appends whose commit token is the table's own transaction identifier,
upserts through MERGE, replaces through one overwrite commit; and a streaming sink
(:mod:`faucet_delta.stream_sink`): one Delta commit per epoch with its watermarks and owner fence as
transaction identifiers. Building the role does no I/O and
imports no deltalake: the factory imports its module when called.
"""

from typing import TYPE_CHECKING

from faucet_dagster.protocol import ConnectorRole, ConnectorSpec, Role
from faucet_delta.config import DeltaSinkConfig
from faucet_delta.stream_config import DeltaStreamingSinkConfig

if TYPE_CHECKING:
    from faucet_delta.sink import DeltaSink
    from faucet_delta.stream_sink import DeltaStreamingSink


def _sink(config: DeltaSinkConfig) -> "DeltaSink":
    from faucet_delta.sink import DeltaSink

    return DeltaSink(config)


def _streaming_sink(config: DeltaStreamingSinkConfig) -> "DeltaStreamingSink":
    from faucet_delta.stream_sink import DeltaStreamingSink

    return DeltaStreamingSink(config)


CONNECTOR = ConnectorSpec(
    name="delta",
    roles={
        Role.SINK: ConnectorRole(DeltaSinkConfig, _sink),
        Role.STREAMING_SINK: ConnectorRole(DeltaStreamingSinkConfig, _streaming_sink),
    },
    description="Delta Lake tables: appends watermarked by transaction ids, MERGE upserts, overwrites.",
    docs={"readme": "connectors/faucet_delta/README.md"},
)

__all__ = ["CONNECTOR", "DeltaSinkConfig", "DeltaStreamingSinkConfig"]
