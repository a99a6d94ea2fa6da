"""Connectors by name, from the ``faucet.connectors`` entry points.

Each entry point names a :class:`ConnectorSpec`: the connector's name and, per role it plays, its
config model and a factory. Loading a spec imports only the connector's thin entry module; heavy
clients are imported when a factory builds a connector.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from importlib.metadata import entry_points
from typing import Any

from faucet_dagster.protocol.bounded import Sink, Source
from faucet_dagster.protocol.config import ConnectorConfig
from faucet_dagster.protocol.errors import ConfigError
from faucet_dagster.protocol.streaming import StreamingSink, StreamSource

CONNECTOR_ENTRY_POINT_GROUP = "faucet.connectors"


class Role(StrEnum):
    SOURCE = "source"
    SINK = "sink"
    STREAM_SOURCE = "stream_source"
    STREAMING_SINK = "streaming_sink"


ROLE_TYPES: Mapping[Role, type] = {
    Role.SOURCE: Source,
    Role.SINK: Sink,
    Role.STREAM_SOURCE: StreamSource,
    Role.STREAMING_SINK: StreamingSink,
}


@dataclass(frozen=True)
class ConnectorRole:
    """One role of a connector: the config it takes and how to build it from that config."""

    config_model: type[ConnectorConfig]
    factory: Callable[[Any], object]


@dataclass(frozen=True)
class ConnectorSpec:
    """A connector's registration: its stable name and the roles it plays."""

    name: str
    roles: Mapping[Role, ConnectorRole]
    description: str = ""
    docs: Mapping[str, str] = field(default_factory=dict)

    def build(self, role: Role, raw_config: Any) -> object:
        """Validate ``raw_config`` and build this connector in ``role``; a ConfigError says why not.

        Building never connects: factories do no I/O, so capabilities can be read offline.
        """
        try:
            spec = self.roles[role]
        except KeyError:
            raise ConfigError(
                f"connector {self.name!r} has no {role.value} role "
                f"(it has: {', '.join(sorted(r.value for r in self.roles))})",
                where=self.name,
            ) from None
        config = spec.config_model.parse(raw_config, where=f"{self.name} {role.value} config")
        built = spec.factory(config)
        expected = ROLE_TYPES[role]
        if not isinstance(built, expected):
            raise ConfigError(
                f"the {self.name} {role.value} factory built a {type(built).__name__}, "
                f"not a {expected.__name__}",
                where=self.name,
            )
        return built

    def source(self, raw_config: Any) -> Source:
        built = self.build(Role.SOURCE, raw_config)
        assert isinstance(built, Source)
        return built

    def sink(self, raw_config: Any) -> Sink:
        built = self.build(Role.SINK, raw_config)
        assert isinstance(built, Sink)
        return built

    def stream_source(self, raw_config: Any) -> StreamSource:
        built = self.build(Role.STREAM_SOURCE, raw_config)
        assert isinstance(built, StreamSource)
        return built

    def streaming_sink(self, raw_config: Any) -> StreamingSink:
        built = self.build(Role.STREAMING_SINK, raw_config)
        assert isinstance(built, StreamingSink)
        return built


def load_connectors() -> dict[str, ConnectorSpec]:
    """Every installed connector, by name."""
    specs: dict[str, ConnectorSpec] = {}
    for entry_point in entry_points(group=CONNECTOR_ENTRY_POINT_GROUP):
        spec = entry_point.load()
        if not isinstance(spec, ConnectorSpec):
            raise ConfigError(
                f"entry point {entry_point.name!r} does not name a ConnectorSpec",
                where=CONNECTOR_ENTRY_POINT_GROUP,
            )
        specs[spec.name] = spec
    return specs


def get_connector(name: str) -> ConnectorSpec:
    specs = load_connectors()
    try:
        return specs[name]
    except KeyError:
        raise ConfigError(
            f"no connector is installed as {name!r} (installed: {', '.join(sorted(specs)) or 'none'})",
            where=CONNECTOR_ENTRY_POINT_GROUP,
        ) from None
