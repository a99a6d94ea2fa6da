"""What every broken connector is built with: a shipped connector's spec with one role replaced."""

from collections.abc import Callable
from typing import Any

from faucet_dagster.protocol import (
    ConnectorRole,
    ConnectorSpec,
    Role,
    get_connector,
)


def spec_with(
    name: str, role: Role, build: Callable[[Any], object], config_model: Any = None
) -> ConnectorSpec:
    """Connector ``name`` with its ``role`` built by ``build(config)`` (the real config model)."""
    real = get_connector(name).roles[role]
    return ConnectorSpec(name, {role: ConnectorRole(config_model or real.config_model, build)})


def wrapping(name: str, role: Role, wrap: Callable[[Any], object]) -> ConnectorSpec:
    """Connector ``name`` whose ``role`` is the real connector wrapped by ``wrap``."""
    real = get_connector(name).roles[role]
    return spec_with(name, role, lambda config: wrap(real.factory(config)))


_OPENED = [0]


def _next_open() -> int:
    """A number per session opened: what an attempt-based identity would be built from."""
    _OPENED[0] += 1
    return _OPENED[0]
