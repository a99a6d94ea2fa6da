"""What this process declared: every faucet sync and stream its definitions built, for ``faucet check``.

``faucet_assets``, ``build_stream_defs`` and the component record each declaration here as they build
it; ``faucet check`` imports a code location, then checks what was recorded. Nothing reads this while
definitions load or runs execute. Entries are read through the small protocols below, so this module
knows nothing of the syncs' and streams' own modules.
"""

from dataclasses import dataclass, field
from typing import Protocol

from faucet_dagster.declarations.preflight import PairCheck, StreamDeclaration
from faucet_dagster.declarations.resources import FaucetEndpoint


class SyncDeclaration(Protocol):
    """What ``faucet check`` reads of a bounded sync (a
    :class:`faucet_dagster.syncs.declaration.FaucetSync`)."""

    @property
    def source(self) -> FaucetEndpoint: ...
    @property
    def sink(self) -> FaucetEndpoint: ...
    @property
    def dead_letter(self) -> FaucetEndpoint | None: ...
    def pair_check(self) -> PairCheck: ...


@dataclass
class Declared:
    """The syncs and streams declared so far, in declaration order, by name."""

    syncs: dict[str, SyncDeclaration] = field(default_factory=dict)
    streams: dict[str, StreamDeclaration] = field(default_factory=dict)


DECLARED = Declared()
"""This process's declarations (a later one of the same name replaces an earlier one)."""


__all__ = ["DECLARED", "Declared", "SyncDeclaration"]
