"""Which connectors ``faucet conformance NAME`` can test: installed connectors with a conformance setup.

A connector package registers its connector in the ``faucet.connectors`` entry-point group and, under
the same name, its conformance setup in ``faucet.conformance``: a :class:`ConformanceSetup` naming,
per role, the config factory (see :mod:`.setup`) and the :class:`ConformanceOptions`::

    [project.entry-points."faucet.connectors"]
    example = "faucet_example:CONNECTOR"

    [project.entry-points."faucet.conformance"]
    example = "faucet_example.conformance:SETUP"

This repository's own connectors have theirs in :mod:`.targets` (used when no entry point of the same
name is installed). Nothing here imports a connector until its setup is asked for.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from faucet_dagster.conformance.options import DEFAULT_OPTIONS, ConformanceOptions
from faucet_dagster.conformance.setup import ConfigFactory
from faucet_dagster.protocol import ConfigError, Role

CONFORMANCE_ENTRY_POINT_GROUP = "faucet.conformance"


@dataclass(frozen=True)
class ConformanceSetup:
    """A connector's conformance setup: the config factory of each role it has, and options per role
    (a role without options runs with the defaults)."""

    factories: Mapping[Role, ConfigFactory]
    options: Mapping[Role, ConformanceOptions] = field(default_factory=dict)

    def roles(self) -> dict[Role, tuple[ConfigFactory, ConformanceOptions]]:
        return {
            role: (factory, self.options.get(role, DEFAULT_OPTIONS))
            for role, factory in self.factories.items()
        }


def conformance_setups() -> dict[str, ConformanceSetup]:
    """Every conformance setup known: this repository's, then the installed entry points (which win)."""
    from faucet_dagster.conformance.targets import TARGETS

    found = {
        name: ConformanceSetup(
            {role: factory for role, (factory, _) in roles.items()},
            {role: options for role, (_, options) in roles.items()},
        )
        for name, roles in TARGETS.items()
    }
    for entry_point in entry_points(group=CONFORMANCE_ENTRY_POINT_GROUP):
        setup = entry_point.load()
        if not isinstance(setup, ConformanceSetup):
            raise ConfigError(
                f"entry point {entry_point.name!r} does not name a ConformanceSetup",
                where=CONFORMANCE_ENTRY_POINT_GROUP,
            )
        found[entry_point.name] = setup
    return found


__all__ = ["CONFORMANCE_ENTRY_POINT_GROUP", "ConformanceSetup", "conformance_setups"]
