"""faucet_delta: Delta Lake tables through delta-rs (the ``deltalake`` wheel).

Registered as the ``delta`` connector (``faucet.connectors`` entry point), with a bounded sink
(:mod:`faucet_delta.sink`): appends whose commit token is the table's own transaction identifier,
upserts through MERGE, replaces through one overwrite commit. Building the role does no I/O and
imports no deltalake: the factory imports its module when called.
"""

from typing import TYPE_CHECKING

from faucet_dagster.protocol import ConnectorRole, ConnectorSpec, Role
from faucet_delta.config import DeltaSinkConfig

if TYPE_CHECKING:
    from faucet_delta.sink import DeltaSink


def _sink(config: DeltaSinkConfig) -> "DeltaSink":
    from faucet_delta.sink import DeltaSink

    return DeltaSink(config)


CONNECTOR = ConnectorSpec(
    name="delta",
    roles={Role.SINK: ConnectorRole(DeltaSinkConfig, _sink)},
    description="Delta Lake tables: appends watermarked by transaction ids, MERGE upserts, overwrites.",
    docs={"readme": "connectors/faucet_delta/README.md"},
)

__all__ = ["CONNECTOR", "DeltaSinkConfig"]
