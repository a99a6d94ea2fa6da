"""faucet-dagster: move data between systems inside Dagster with delivery guarantees it can prove.

Importing this package does not import Dagster: the protocol (``faucet_dagster.protocol``) is what
connectors import, and it must stay light. The Dagster-facing names below are loaded on first use.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "FaucetConnection": "faucet_dagster.resources",
    "FaucetEndpoint": "faucet_dagster.resources",
    "FaucetSync": "faucet_dagster.assets",
    "FaucetSyncData": "faucet_dagster.assets",
    "FaucetSyncs": "faucet_dagster.assets",
    "FaucetTranslator": "faucet_dagster.assets",
    "faucet_assets": "faucet_dagster.assets",
    "faucet_sync_assets": "faucet_dagster.assets",
    "faucet_schedule": "faucet_dagster.schedules",
    "faucet_partitions_sensor": "faucet_dagster.partitions",
    "refresh_partitions": "faucet_dagster.partitions",
    "FaucetAssetAttributes": "faucet_dagster.components",
    "FaucetComponent": "faucet_dagster.components",
    "FaucetStream": "faucet_dagster.sensors",
    "faucet_stream_sensor": "faucet_dagster.sensors",
    "build_stream_defs": "faucet_dagster.sensors",
}
"""Public Dagster-facing name -> the module defining it (filled as those modules land)."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'faucet_dagster' has no attribute {name!r}")
    return getattr(import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
