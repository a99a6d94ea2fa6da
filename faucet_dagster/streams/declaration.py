"""A continuous stream as declared: endpoints, resources, policy, epoch limits, lease and workers; its
runner spec and its sink asset. No sensor is built here (:mod:`.definitions` builds the definitions)."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from faucet_dagster.declarations.resources import FaucetEndpoint
from faucet_dagster.pipeline import ResourceSchema
from faucet_dagster.protocol import ConfigError, Delivery, ReadLimits, WritePolicy
from faucet_dagster.runner.continuous import DEFAULT_EPOCH_LIMITS, DEFAULT_LEASE_SECONDS, StreamSpec

AssetKeyLike = dg.AssetKey | str | Sequence[str]
"""What names the sink asset: an ``AssetKey``, a slash-free name, or its path segments."""


@dataclass(frozen=True)
class FaucetStream:
    """One continuous stream: read ``resources`` from ``source``, write them to ``sink`` with ``policy``.

    ``schemas`` declares resources' schemas (others are inferred). ``limits.age``, ``limits.records``
    and ``limits.bytes`` bound an epoch (by default it is sealed in the background at the first safe
    boundary after a second or 50,000 records; a tick reports it). ``state_url`` selects the state store
    (default: ``$FAUCET_STATE_URL``, else a SQLite file under ``$DAGSTER_HOME``). ``lease_seconds`` is
    how long a worker that died without releasing the stream holds it up (a live one renews its lease
    in the background). ``workers`` above 1 runs the stream in that many long-running Dagster runs
    (:mod:`faucet_dagster.streams.workers`), its partitions divided into ``groups`` partition groups
    (default: ``workers`` for a new stream, else the number it was certified with: fixed once
    certified). ``asset_per_resource`` gives each resource (each replicated table) its own sink asset,
    ``<asset key>/<resource>``; by default a change-data-capture stream of several tables does.
    """

    name: str
    source: FaucetEndpoint
    sink: FaucetEndpoint
    resources: tuple[str, ...]
    policy: WritePolicy = WritePolicy.APPEND
    key: tuple[str, ...] = ()
    delivery: Delivery | None = None
    schemas: Mapping[str, ResourceSchema] = field(default_factory=dict)
    limits: ReadLimits = DEFAULT_EPOCH_LIMITS
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    state_url: str | None = None
    description: str | None = None
    workers: int = 1
    groups: int | None = None
    asset_per_resource: bool | None = None
    """One sink asset per resource (a replica's tables) instead of one for the stream; default: for a
    change-data-capture stream (``apply_changes``) of several resources."""

    def __post_init__(self) -> None:
        if self.workers < 1 or (self.groups is not None and self.groups < 1):
            raise ConfigError(
                f"stream {self.name}: workers ({self.workers}) and groups ({self.groups}) must be at least 1",
                where=self.name,
            )

    @property
    def group_count(self) -> int:
        """How many partition groups the stream's workers divide its partitions into."""
        return self.groups or self.workers

    def build_spec(self, resources: Any = None) -> StreamSpec:
        """The runner's spec: connectors built from the endpoints (no I/O; secrets read now)."""
        source = self.source.resolve(resources)
        sink = self.sink.resolve(resources)
        return StreamSpec(
            name=self.name,
            source=source.spec().stream_source(source.resolved_config(self.source.config)),
            sink=sink.spec().streaming_sink(sink.resolved_config(self.sink.config)),
            resources=self.resources,
            policy=self.policy,
            key=self.key,
            schemas=self.schemas,
            delivery=self.delivery,
            limits=self.limits,
            lease_seconds=self.lease_seconds,
        )

    @property
    def assets_per_resource(self) -> bool:
        """Whether each resource is its own sink asset (see ``asset_per_resource``)."""
        if self.asset_per_resource is not None:
            return self.asset_per_resource
        return self.policy is WritePolicy.APPLY_CHANGES and len(self.resources) > 1

    def asset_targets(
        self, spec: dg.AssetSpec | None = None
    ) -> list[tuple[dg.AssetSpec, frozenset[str] | None]]:
        """The sink assets and the resources each stands for: ``spec`` (default :meth:`asset_spec`)
        for the stream, or with :attr:`assets_per_resource` one spec per resource, its key
        ``spec.key`` followed by the resource's dotted parts (``shop_replica/public/orders``)."""
        base = spec or self.asset_spec()
        if not self.assets_per_resource:
            return [(base, None)]
        return [
            (
                base.replace_attributes(
                    key=dg.AssetKey([*base.key.path, *(_key_part(part) for part in resource.split("."))]),
                    description=f"{resource}, replicated by faucet stream {self.name} "
                    f"({self.source.label} to {self.sink.label}).",
                ),
                frozenset([resource]),
            )
            for resource in self.resources
        ]

    def asset_spec(self, key: AssetKeyLike | None = None) -> dg.AssetSpec:
        """The sink asset the stream's certificates materialize (key ``[name]`` unless given)."""
        kinds = {"faucet"} | {c for c in (self.source.connector, self.sink.connector) if c is not None}
        return dg.AssetSpec(
            key=dg.AssetKey.from_coercible(key) if key is not None else dg.AssetKey([self.name]),
            description=self.description
            or f"Faucet continuous stream {self.name}: {self.source.label} to {self.sink.label}.",
            kinds=kinds,
            tags={
                "faucet/source": self.source.label,
                "faucet/sink": self.sink.label,
                "faucet/mode": "continuous",
            },
        )


def _key_part(text: str) -> str:
    """``text`` as an asset key part: letters, digits and underscores."""
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in text) or "_"


__all__ = ["AssetKeyLike", "FaucetStream"]
