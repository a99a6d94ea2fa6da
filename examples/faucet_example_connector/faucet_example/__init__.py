"""faucet_example: a bounded source of JSON Lines files, written as an outside author would.

Registered as the ``jsonl_example`` connector (``faucet.connectors`` entry point) with its conformance
setup (``faucet.conformance``). It imports only ``faucet_dagster.protocol``.
"""

from faucet_dagster.protocol import ConnectorRole, ConnectorSpec, Role
from faucet_example.source import JsonLinesConfig, JsonLinesSource

CONNECTOR = ConnectorSpec(
    name="jsonl_example",
    roles={Role.SOURCE: ConnectorRole(JsonLinesConfig, JsonLinesSource)},
    description="JSON Lines files, one record per line (the connector authoring guide's example).",
)

__all__ = ["CONNECTOR", "JsonLinesConfig", "JsonLinesSource"]
