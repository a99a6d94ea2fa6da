"""faucet-dagster: move data between systems inside Dagster with delivery guarantees it can prove.

The package in layers, each importing only the layers below it (docs/architecture.md):

* ``cli/``: every ``faucet`` command;
* the Dagster integration, the only code that imports ``dagster``: ``syncs/`` (bounded syncs as
  assets), ``streams/`` (continuous streams as sensors), ``declarations/`` (what both share) and
  ``components.py`` (``defs.yaml``);
* the engine: ``planner``, ``pipeline/``, ``runner/``, ``state/``;
* ``protocol/``: the Faucet Connector Protocol, the only part a connector imports.

``conformance/`` (the battery) and ``testing/`` (servers and fault injection for tests) stand beside
them. Importing this package imports none of them: the public names below load on first use.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    # Dagster integration: bounded syncs
    "FaucetSync": "faucet_dagster.syncs.declaration",
    "FaucetSyncData": "faucet_dagster.syncs.declaration",
    "FaucetSyncs": "faucet_dagster.syncs.assets",
    "FaucetTranslator": "faucet_dagster.syncs.assets",
    "faucet_assets": "faucet_dagster.syncs.assets",
    "faucet_sync_assets": "faucet_dagster.syncs.assets",
    "faucet_schedule": "faucet_dagster.syncs.schedules",
    "faucet_partitions_sensor": "faucet_dagster.syncs.partitions",
    "refresh_partitions": "faucet_dagster.syncs.partitions",
    # Dagster integration: continuous streams
    "FaucetStream": "faucet_dagster.streams.declaration",
    "build_stream_defs": "faucet_dagster.streams.definitions",
    "faucet_stream_sensor": "faucet_dagster.streams.sensor",
    # Dagster integration: shared declarations and the component
    "FaucetConnection": "faucet_dagster.declarations.resources",
    "FaucetEndpoint": "faucet_dagster.declarations.resources",
    "FaucetAssetAttributes": "faucet_dagster.declarations.yaml_models",
    "FaucetComponent": "faucet_dagster.components",
    # The values a declaration names (no Dagster import)
    "BadRowPolicy": "faucet_dagster.pipeline",
    "ResourceSchema": "faucet_dagster.pipeline",
    "Delivery": "faucet_dagster.protocol",
    "FaucetError": "faucet_dagster.protocol",
    "ConfigError": "faucet_dagster.protocol",
    "Mode": "faucet_dagster.protocol",
    "ReadLimits": "faucet_dagster.protocol",
    "WritePolicy": "faucet_dagster.protocol",
}
"""Public name -> the module defining it, imported on first use."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'faucet_dagster' has no attribute {name!r}")
    return getattr(import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
