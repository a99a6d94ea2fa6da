"""What every broken connector is built with: a shipped connector's spec with one role replaced.

The specs are picklable (module-level classes and :class:`Wrap` values, never lambdas): the battery
sends a spec to the worker processes it runs the connector in.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from faucet_dagster.protocol import (
    ConnectorRole,
    ConnectorSpec,
    Role,
    get_connector,
)


@functools.cache
def real_role(name: str, role: Role) -> ConnectorRole:
    """The installed connector ``name``'s ``role`` (looked up once per process)."""
    return get_connector(name).roles[role]


def spec_with(
    name: str, role: Role, build: Callable[[Any], object], config_model: Any = None
) -> ConnectorSpec:
    """Connector ``name`` with its ``role`` built by ``build(config)`` (the real config model)."""
    real = real_role(name, role)
    return ConnectorSpec(name, {role: ConnectorRole(config_model or real.config_model, build)})


@dataclass(frozen=True)
class Wrap:
    """A factory: the real connector ``name`` in ``role``, built from the config, then wrapped as
    ``wrapper(inner, *args)`` (``wrapper`` a module-level class or function, so it pickles)."""

    name: str
    role: Role
    wrapper: Callable[..., object]
    args: tuple[Any, ...] = ()

    def __call__(self, config: Any) -> object:
        return self.wrapper(real_role(self.name, self.role).factory(config), *self.args)


def wrapping(name: str, role: Role, wrapper: Callable[..., object], *args: Any) -> ConnectorSpec:
    """Connector ``name`` whose ``role`` is the real connector wrapped by ``wrapper(inner, *args)``."""
    return spec_with(name, role, Wrap(name, role, wrapper, args))


_OPENED = [0]


def _next_open() -> int:
    """A number per session opened: what an attempt-based identity would be built from."""
    _OPENED[0] += 1
    return _OPENED[0]
