"""``FaucetComponent``: declare faucet syncs in a ``defs.yaml``, without Python.

.. code-block:: yaml

    type: faucet_dagster.components.FaucetComponent
    attributes:
      connections:                      # shared connector configs, by name
        lake: {connector: files}
        warehouse:
          connector: sql
          config: {url: "sqlite:///{{ context.project_root }}/.faucet_data/warehouse.db"}
      syncs:                            # bounded syncs: one asset each
        - name: orders
          source: {connection: lake, config: {paths: [data/orders/*.csv], shard_by_file: true}}
          sink: {connection: warehouse, config: {table: orders, mode: append}}
          delivery: effectively_once    # optional: refuse to run unless the plan reaches it
          batch_size: 50000
          evolve_schema: false
          dead_letter: {connection: warehouse, config: {table: orders_rejected}}
          schedule: "0 * * * *"         # optional cron schedule
          asset: {key: raw/orders, group: raw, owners: [team:data], tags: {tier: bronze}}

An endpoint (``source``, ``sink``, ``dead_letter``) names a ``connection`` of this component, or an
installed ``connector`` directly; its ``config`` is merged over the connection's. Secrets are written
``{env: NAME}`` and read from the environment only when a run builds the connector; a
``{{ env.NAME }}`` template would instead be rendered into the definitions when they load.

The attributes are grouped by kind (``connections``, ``syncs``) so that other kinds of declarations,
continuous ``streams``, sit beside ``syncs`` and share the same ``connections``:

.. code-block:: yaml

      streams:                          # continuous streams: a sink asset, its check and a sensor each
        - name: events
          enabled: "{{ env.EVENTS_NATS_URL is not none }}"   # optional: declared only where configured
          source: {connector: nats, config: {servers: [{env: EVENTS_NATS_URL}], stream: EVENTS}}
          sink: {connection: warehouse, config: {table: events}}
          resources: [EVENTS]
"""

from collections.abc import Mapping
from typing import Any, Literal

import dagster as dg

from faucet_dagster.assets import FaucetSync, FaucetSyncData, FaucetTranslator, faucet_sync_assets
from faucet_dagster.pipeline import ResourceSchema
from faucet_dagster.protocol import ConfigError, Delivery, ReadLimits, WritePolicy
from faucet_dagster.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.runner.bounded import DEFAULT_BATCH_SIZE
from faucet_dagster.runner.continuous import DEFAULT_EPOCH_LIMITS
from faucet_dagster.schedules import faucet_schedule
from faucet_dagster.sensors import FaucetStream, build_stream_defs

DeliveryName = Literal["effectively_once", "at_least_once"]


class ConnectionModel(dg.Model, dg.Resolvable):
    """A named connector config shared by endpoints."""

    connector: str
    config: dict[str, Any] = {}


class EndpointModel(dg.Model, dg.Resolvable):
    """One side of a sync: a ``connection`` of this component or an installed ``connector``."""

    connection: str | None = None
    connector: str | None = None
    config: dict[str, Any] = {}


class AssetAttributesModel(dg.Model, dg.Resolvable):
    """Overrides of the asset a sync becomes (``key`` is slash-separated: ``raw/orders``)."""

    key: str | None = None
    group: str | None = None
    description: str | None = None
    owners: list[str] = []
    tags: dict[str, str] = {}
    deps: list[str] | None = None

    def apply(self, spec: dg.AssetSpec) -> dg.AssetSpec:
        """``spec`` with these attributes applied over it (a sync's or a stream's asset)."""
        changes: dict[str, Any] = {}
        if self.key is not None:
            changes["key"] = dg.AssetKey.from_user_string(self.key)
        if self.group is not None:
            changes["group_name"] = self.group
        if self.description is not None:
            changes["description"] = self.description
        if self.owners:
            changes["owners"] = self.owners
        if self.deps is not None:
            changes["deps"] = [dg.AssetKey.from_user_string(dep) for dep in self.deps]
        spec = spec.replace_attributes(**changes)
        return spec.merge_attributes(tags=self.tags) if self.tags else spec


class SyncModel(dg.Model, dg.Resolvable):
    """A bounded sync: one asset, materialized by reading ``source`` and writing ``sink``."""

    name: str
    source: EndpointModel
    sink: EndpointModel
    delivery: DeliveryName | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    evolve_schema: bool = False
    dead_letter: EndpointModel | None = None
    description: str | None = None
    schedule: str | None = None
    asset: AssetAttributesModel = AssetAttributesModel()


class StreamSchemaModel(dg.Model, dg.Resolvable):
    """A resource's declared schema: ``columns`` maps names to Arrow types (``int64 not null``);
    without ``columns`` the schema is inferred. ``on_bad_row``: ``halt`` or ``dead_letter``."""

    columns: dict[str, str] | None = None
    key: list[str] = []
    on_bad_row: Literal["halt", "dead_letter"] = "halt"


class StreamEpochModel(dg.Model, dg.Resolvable):
    """Targets for where an epoch ends: the first safe boundary after any of them is reached."""

    records: int | None = DEFAULT_EPOCH_LIMITS.records
    bytes: int | None = DEFAULT_EPOCH_LIMITS.bytes
    idle_seconds: float | None = DEFAULT_EPOCH_LIMITS.idle
    age_seconds: float | None = DEFAULT_EPOCH_LIMITS.age


class StreamModel(dg.Model, dg.Resolvable):
    """A continuous stream: a sensor runs its epochs, their certificates materialize the sink asset.

    ``resources`` are what the source reads (a NATS stream, Kafka topics); ``policy`` and ``key`` how
    the sink applies them; ``running`` starts the sensor without a click in the UI. ``enabled: false``
    leaves the stream out of the definitions (no asset, check or sensor): a template such as
    ``"{{ env.EVENTS_URL is not none }}"`` declares a stream only where its servers are configured.
    """

    name: str
    enabled: bool = True
    source: EndpointModel
    sink: EndpointModel
    resources: list[str]
    policy: Literal["append", "upsert", "versioned_upsert", "apply_changes", "delete"] = "append"
    key: list[str] = []
    delivery: DeliveryName | None = None
    schemas: dict[str, StreamSchemaModel] = {}
    epoch: StreamEpochModel = StreamEpochModel()
    lease_seconds: float = 120.0
    state_url: str | None = None
    minimum_interval_seconds: int = 30
    budget_seconds: float | None = None
    running: bool = False
    description: str | None = None
    asset: AssetAttributesModel = AssetAttributesModel()


class FaucetComponentScaffolder(dg.Scaffolder[Any]):
    """``dg scaffold defs faucet_dagster.components.FaucetComponent <path>``: a ``defs.yaml`` with one
    files-to-SQLite sync to edit."""

    def scaffold(self, request: dg.ScaffoldRequest[Any]) -> None:
        dg.scaffold_component(
            request,
            {
                "connections": {
                    "files": {"connector": "files"},
                    "warehouse": {
                        "connector": "sql",
                        "config": {"url": "sqlite:///{{ context.project_root }}/.faucet_data/warehouse.db"},
                    },
                },
                "syncs": [
                    {
                        "name": "orders",
                        "source": {
                            "connection": "files",
                            "config": {"paths": ["{{ context.project_root }}/data/orders/*.csv"]},
                        },
                        "sink": {"connection": "warehouse", "config": {"table": "orders", "mode": "append"}},
                    }
                ],
            },
        )


@dg.scaffold_with(FaucetComponentScaffolder)
class FaucetComponent(dg.Component, dg.Model, dg.Resolvable):
    """Faucet syncs and streams declared in YAML: each sync becomes a partition-aware asset, each stream
    a sink asset with its certificate check and sensor (see the module doc)."""

    connections: dict[str, ConnectionModel] = {}
    syncs: list[SyncModel] = []
    streams: list[StreamModel] = []

    @classmethod
    def get_spec(cls) -> dg.ComponentTypeSpec:
        return dg.ComponentTypeSpec(
            description=(
                "Bounded faucet syncs as Dagster assets, bookmarks in run storage; continuous streams "
                "as sensors that certify epochs."
            ),
            tags=["faucet", "ingestion"],
            produces=["asset", "schedule", "sensor", "asset_check"],
        )

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return dg.Definitions.merge(self.build_sync_defs(), self.build_stream_defs())

    def build_stream_defs(self) -> dg.Definitions:
        """The sink asset, certificate check and sensor of each enabled one of ``streams``."""
        connections = {
            name: FaucetConnection(connector=model.connector, config=dict(model.config))
            for name, model in self.connections.items()
        }
        defs = []
        for model in (model for model in self.streams if model.enabled):
            stream = _stream(model, connections)
            status = dg.DefaultSensorStatus.RUNNING if model.running else dg.DefaultSensorStatus.STOPPED
            defs.append(
                build_stream_defs(
                    [stream],
                    asset_specs={stream.name: model.asset.apply(stream.asset_spec())},
                    minimum_interval_seconds=model.minimum_interval_seconds,
                    budget_seconds=model.budget_seconds,
                    default_status=status,
                )
            )
        return dg.Definitions.merge(*defs) if defs else dg.Definitions()

    def build_sync_defs(self) -> dg.Definitions:
        """The assets (and schedules) of ``syncs``."""
        connections = {
            name: FaucetConnection(connector=model.connector, config=dict(model.config))
            for name, model in self.connections.items()
        }
        translator = _AttributesTranslator({sync.name: sync.asset for sync in self.syncs})
        schedules = []
        assets = []
        for model in self.syncs:
            [asset] = faucet_sync_assets([self._sync(model, connections)], translator=translator)
            assets.append(asset)
            if model.schedule is not None:
                schedules.append(
                    faucet_schedule(asset, model.schedule, name=f"{asset.node_def.name}_schedule")
                )
        return dg.Definitions(assets=assets, schedules=schedules)

    def _sync(self, model: SyncModel, connections: Mapping[str, FaucetConnection]) -> FaucetSync:
        where = f"sync {model.name}"
        return FaucetSync(
            name=model.name,
            source=_endpoint(model.source, connections, f"{where} source"),
            sink=_endpoint(model.sink, connections, f"{where} sink"),
            delivery=None if model.delivery is None else Delivery(model.delivery),
            batch_size=model.batch_size,
            evolve_schema=model.evolve_schema,
            dead_letter=None
            if model.dead_letter is None
            else _endpoint(model.dead_letter, connections, f"{where} dead_letter"),
            description=model.description,
        )


def _endpoint(
    model: EndpointModel, connections: Mapping[str, FaucetConnection], where: str
) -> FaucetEndpoint:
    if (model.connection is None) == (model.connector is None):
        raise ConfigError("an endpoint names exactly one of `connection` or `connector`", where=where)
    if model.connector is not None:
        return FaucetEndpoint(FaucetConnection(connector=model.connector), dict(model.config))
    try:
        connection = connections[str(model.connection)]
    except KeyError:
        raise ConfigError(
            f"no connection named {model.connection!r} "
            f"(declared: {', '.join(sorted(connections)) or 'none'})",
            where=where,
        ) from None
    return FaucetEndpoint(connection, dict(model.config))


def _stream(model: StreamModel, connections: Mapping[str, FaucetConnection]) -> FaucetStream:
    where = f"stream {model.name}"
    return FaucetStream(
        name=model.name,
        source=_endpoint(model.source, connections, f"{where} source"),
        sink=_endpoint(model.sink, connections, f"{where} sink"),
        resources=tuple(model.resources),
        policy=WritePolicy(model.policy),
        key=tuple(model.key),
        delivery=None if model.delivery is None else Delivery(model.delivery),
        schemas={
            resource: ResourceSchema.from_columns(schema.columns, schema.key or model.key, schema.on_bad_row)
            for resource, schema in model.schemas.items()
        },
        limits=ReadLimits(
            records=model.epoch.records,
            bytes=model.epoch.bytes,
            idle=model.epoch.idle_seconds,
            age=model.epoch.age_seconds,
        ),
        lease_seconds=model.lease_seconds,
        state_url=model.state_url,
        description=model.description,
    )


class _AttributesTranslator(FaucetTranslator):
    """The default translation, with each sync's ``asset`` attributes from the YAML applied over it."""

    def __init__(self, attributes: Mapping[str, AssetAttributesModel]) -> None:
        self.attributes = dict(attributes)

    def get_asset_spec(self, data: FaucetSyncData) -> dg.AssetSpec:
        spec = super().get_asset_spec(data)
        attributes = self.attributes.get(data.sync.name)
        return spec if attributes is None else attributes.apply(spec)


__all__ = ["FaucetComponent", "FaucetComponentScaffolder"]
