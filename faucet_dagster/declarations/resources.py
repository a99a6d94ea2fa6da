"""Connector configs as Dagster resources, with secrets read from the environment at run time.

A :class:`FaucetConnection` names an installed connector (``files``, ``sql``, ``postgres``) and holds
the part of its config that several syncs share (a database URL, credentials). It is a Dagster
``ConfigurableResource``: bind it under a key in ``Definitions(resources=...)`` and name that key in
a sync, or hand the object to a sync directly. A sync adds its own part (a table, file paths) through
:meth:`FaucetConnection.using`.

Secrets never sit in a definition. Write them as ``dg.EnvVar("PG_PASSWORD")`` in Python or
``{env: PG_PASSWORD}`` in YAML (the form Dagster itself turns an ``EnvVar`` into); either is replaced
by the variable's value only when a connector is built for a run, and the connector's pydantic model
keeps it as a ``SecretStr`` from there on. What Dagster shows of the resource is the variable's name.
"""

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from faucet_dagster.protocol import ConfigError, ConnectorSpec, Sink, Source, get_connector
from faucet_dagster.runner.replication import setup_change_source


class FaucetConnection(dg.ConfigurableResource["FaucetConnection"]):
    """An installed faucet connector and the config its syncs share.

    ``config`` is the connector's config (its pydantic model validates it when a connector is built);
    a sync's own settings are merged over it, key by key, with nested mappings merged recursively.
    Values written as ``dg.EnvVar(NAME)`` or ``{"env": NAME}`` are read from the environment when a
    connector is built; a variable that is not set raises :class:`ConfigError` naming it.
    """

    connector: str
    config: dict[str, Any] = {}

    def using(self, **config: Any) -> "FaucetEndpoint":
        """This connection with a sync's own settings (``table="orders"``, ``paths=[...]``)."""
        return FaucetEndpoint(self, dict(config))

    def spec(self) -> ConnectorSpec:
        """The installed connector this connection names (raises ConfigError when none is)."""
        return get_connector(self.connector)

    def resolved_config(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The merged config with every environment reference replaced by its value."""
        merged = merge_config(self.config, overrides or {})
        resolved: dict[str, Any] = _resolve_env(merged, f"{self.connector} config")
        return resolved

    def build_source(self, overrides: Mapping[str, Any] | None = None) -> Source:
        """Build the connector's source from the merged config (no I/O: factories do not connect)."""
        return self.spec().source(self.resolved_config(overrides))

    def build_sink(self, overrides: Mapping[str, Any] | None = None) -> Sink:
        """Build the connector's sink from the merged config (no I/O: factories do not connect)."""
        return self.spec().sink(self.resolved_config(overrides))

    def setup_replication(self, tables: Sequence[str] = (), **config: Any) -> dict[str, Any]:
        """Create the replication slot and publication this connection's change source reads, as
        ``faucet cdc setup`` does (idempotent; blocks until done). ``config`` adds the source's own
        settings (``slot=``, ``publication=``); ``tables`` default to the config's. Returns what the
        setup found or made (slot, publication, tables, incarnation, created_lsn, ...).

        Raises ConfigError naming the problem (``wal_level`` is not ``logical``, a table is missing).
        """
        return setup_change_source(self.connector, self.resolved_config(config), tables)


@dataclass(frozen=True)
class FaucetEndpoint:
    """One side of a sync: a connection (an object, or the key of a resource bound in Definitions)
    and the sync's own config merged over the connection's."""

    connection: FaucetConnection | str
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def resource_key(self) -> str | None:
        """The resource key this endpoint names, or ``None`` when it holds its connection."""
        return self.connection if isinstance(self.connection, str) else None

    @property
    def connector(self) -> str | None:
        """The connector's name when known at definition time (not for a resource key)."""
        return None if isinstance(self.connection, str) else self.connection.connector

    @property
    def label(self) -> str:
        """The connector's name, or the resource key when the connector is only known at run time."""
        return self.connection if isinstance(self.connection, str) else self.connection.connector

    def resolve(self, resources: Any) -> FaucetConnection:
        """The connection, looking a resource key up in ``resources`` (a Dagster context's resources)."""
        if not isinstance(self.connection, str):
            return self.connection
        found = getattr(resources, self.connection, None)
        if not isinstance(found, FaucetConnection):
            raise ConfigError(
                f"resource {self.connection!r} is not a FaucetConnection (got {type(found).__name__})",
                where=f"resource {self.connection}",
            )
        return found


def merge_config(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` over ``base`` key by key, nested mappings merged (an env reference is a value)."""
    merged = dict(base)
    for key, value in overrides.items():
        current = merged.get(key)
        if isinstance(current, Mapping) and isinstance(value, Mapping) and not env_name(value):
            merged[key] = merge_config(current, value)
        else:
            merged[key] = value
    return merged


def env_name(value: object) -> str | None:
    """The variable an ``EnvVar`` or an ``{"env": NAME}`` mapping refers to, else ``None``."""
    if isinstance(value, dg.EnvVar):
        return value.env_var_name
    if isinstance(value, Mapping) and len(value) == 1 and isinstance(value.get("env"), str):
        return str(value["env"])
    return None


def _resolve_env(value: Any, where: str) -> Any:
    name = env_name(value)
    if name is not None:
        resolved = os.environ.get(name)
        if resolved is None:
            raise ConfigError(f"environment variable {name} is not set", where=where)
        return resolved
    if isinstance(value, Mapping):
        return {key: _resolve_env(item, where) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_resolve_env(item, where) for item in value]
    return value
