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
          asset: {key: raw/orders, group_name: raw, owners: [team:data], tags: {tier: bronze}}

An endpoint (``source``, ``sink``, ``dead_letter``) names a ``connection`` of this component, or an
installed ``connector`` directly; its ``config`` is merged over the connection's. Each connection is
also a resource of the code location under its name (a ``FaucetConnection``: ``dg list defs`` lists
it, and a Python sync can name it by key); two components may declare the same connection only with
the same config. Secrets are written
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

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import dagster as dg
from dagster.components.resolved.context import ResolutionContext
from dagster.components.resolved.core_models import resolve_asset_spec_update_kwargs_to_mapping
from dagster.components.resolved.errors import ResolutionException
from pydantic import BaseModel, Field, PrivateAttr, ValidationError

from faucet_dagster.declarations.code_location import with_code_reference
from faucet_dagster.declarations.preflight import PairCheck, check_pairs, stream_check
from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.pipeline import ResourceSchema
from faucet_dagster.protocol import ConfigError, Delivery, ReadLimits, WritePolicy
from faucet_dagster.runner.bounded_values import DEFAULT_BATCH_SIZE
from faucet_dagster.runner.continuous import DEFAULT_EPOCH_LIMITS, DEFAULT_LEASE_SECONDS
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.definitions import build_stream_defs
from faucet_dagster.syncs.assets import FaucetTranslator, faucet_sync_assets
from faucet_dagster.syncs.declaration import FaucetSync, FaucetSyncData
from faucet_dagster.syncs.partitions import faucet_partitions_sensor
from faucet_dagster.syncs.schedules import faucet_schedule
from faucet_dagster.syncs.verification import sync_verify_check

DeliveryName = Literal["effectively_once", "at_least_once"]


def _field(description: str, **kwargs: Any) -> dg.Resolver:
    """A plain field with its description (shown by editors and ``dg`` docs)."""
    resolver: dg.Resolver = dg.Resolver.default(description=description, **kwargs)
    return resolver


class _Located(dg.Resolvable):
    """Resolution that names where a value was refused: a pydantic error while a model is resolved
    becomes Dagster's :class:`ResolutionException` naming each field's YAML path and its
    ``file:line``, never the value (it may be a secret: pydantic and Dagster's snippets echo it)."""

    @classmethod
    def resolve_from_model(cls, context: ResolutionContext, model: BaseModel) -> Any:
        if not isinstance(model, BaseModel):
            # A scalar where a mapping belongs (Dagster iterates a string given for a list).
            path = _declared_path(context, context.path)
            raise ResolutionException(
                f"{_line(context, path)}{'.'.join(map(str, path))}: expected a mapping of "
                f"{cls.__name__} fields, not a {type(model).__name__}"
            )
        try:
            return super().resolve_from_model(context, model)
        except ValidationError as exc:
            raise ResolutionException(_refusal(context, cls.__name__, exc)) from None


def _refusal(context: ResolutionContext, model: str, exc: ValidationError) -> str:
    """Each problem as ``file:line - yaml.path: message``, without the input."""
    lines = []
    for error in exc.errors(include_input=False, include_url=False):
        path = [*context.path, *error["loc"]]
        lines.append(f"{_line(context, path)}{'.'.join(map(str, path))}: {error['msg']}")
    return f"invalid {model}:\n" + "\n".join(lines)


def _declared_path(context: ResolutionContext, path: Sequence[str | int]) -> list[str | int]:
    """The longest prefix of ``path`` the YAML declares (all of it without source positions)."""
    tree = context.source_position_tree
    found = list(path)
    while tree is not None and found and tree.lookup(found) is None:
        found.pop()
    return found


def _line(context: ResolutionContext, path: Sequence[str | int]) -> str:
    """``file:line - `` of ``path`` (or of its closest declared ancestor); empty without positions."""
    tree = context.source_position_tree
    if tree is None:
        return ""
    position, _ = tree.lookup_closest_and_path(list(path), trace=None)
    return f"{position.filename}:{position.start.line} - "


class ConnectionModel(dg.Model, _Located):
    """A named connector config shared by endpoints."""

    connector: Annotated[str, _field("An installed faucet connector: files, sql, postgres, kafka, nats.")]
    config: Annotated[
        dict[str, Any],
        _field("The connector's config shared by its endpoints; secrets as {env: NAME}, read at run time."),
    ] = {}


class EndpointModel(dg.Model, _Located):
    """One side of a sync: a ``connection`` of this component or an installed ``connector``."""

    connection: Annotated[str | None, _field("A connection of this component, by name.")] = None
    connector: Annotated[str | None, _field("An installed connector, when no connection is named.")] = None
    config: Annotated[
        dict[str, Any], _field("This endpoint's own config, merged key by key over the connection's.")
    ] = {}


class FaucetAssetAttributes(dg.AssetAttributesModel):  # type: ignore[misc,valid-type]
    """Dagster's asset attributes (as in ``AssetSpec``), applied over the asset a sync or stream
    becomes: ``key``, ``key_prefix``, ``group_name``, ``description``, ``metadata``, ``tags``,
    ``kinds``, ``owners``, ``deps``, ``code_version``, ``automation_condition``,
    ``freshness_policy``, ``skippable``. ``tags`` and ``metadata`` are merged, the others replace
    faucet's defaults. ``group`` is the older spelling of ``group_name``."""

    key: str | None = Field(None, description="The asset key, slash-separated: `raw/orders`.")
    group: str | None = Field(None, description="The older spelling of group_name.")
    partitions_def: None = Field(
        None, description="Not settable: a sync's partitions are its source's shards."
    )


def _resolve_asset(context: dg.ResolutionContext, model: Any) -> Mapping[str, Any]:
    resolved = dict(resolve_asset_spec_update_kwargs_to_mapping(context, model))
    if getattr(model, "group", None) is not None:
        resolved.setdefault("group_name", model.group)
    return resolved


AssetAttributes = Annotated[
    Mapping[str, Any],
    dg.Resolver(
        _resolve_asset,
        model_field_type=FaucetAssetAttributes,
        description="Dagster asset attributes applied over the default spec (see FaucetAssetAttributes).",
    ),
]


def apply_asset_attributes(spec: dg.AssetSpec, attributes: Mapping[str, Any]) -> dg.AssetSpec:
    """``spec`` with resolved asset ``attributes`` applied as Dagster's components apply a
    ``translation``: ``tags`` and ``metadata`` merged, ``key_prefix`` prefixing the key, the rest
    replaced. ``partitions_def`` stays faucet's (a sync's partitions are its source's shards)."""
    changes = {name: value for name, value in attributes.items() if name != "partitions_def"}
    if "code_version" in changes:
        changes["code_version"] = str(changes["code_version"])
    prefix = changes.pop("key_prefix", None)
    if prefix is not None:
        changes["key"] = dg.AssetKey.from_coercible(changes.get("key", spec.key)).with_prefix(prefix)
    merged = {name: changes.pop(name) for name in ("tags", "metadata") if name in changes}
    spec = spec.replace_attributes(**changes)
    return spec.merge_attributes(**merged) if merged else spec


class SyncModel(dg.Model, _Located):
    """A bounded sync: one asset, materialized by reading ``source`` and writing ``sink``."""

    name: Annotated[str, _field("The sync's name: its asset key unless `asset.key` says otherwise.")]
    source: Annotated[EndpointModel, _field("What the sync reads.")]
    sink: Annotated[EndpointModel, _field("What the sync writes; its config's `mode` is the write policy.")]
    delivery: Annotated[
        DeliveryName | None,
        _field("The guarantee to insist on: the definitions fail to load when the plan cannot reach it."),
    ] = None
    batch_size: Annotated[int, _field("Rows a page (0: one page).")] = DEFAULT_BATCH_SIZE
    evolve_schema: Annotated[
        bool, _field("Add new source columns to the destination instead of failing the run.")
    ] = False
    dead_letter: Annotated[
        EndpointModel | None, _field("Where rows that cannot be converted or written go (it must append).")
    ] = None
    description: Annotated[str | None, _field("The asset's description.")] = None
    schedule: Annotated[str | None, _field("A cron schedule materializing the sync (every partition).")] = (
        None
    )
    asset: AssetAttributes = {}


class StreamSchemaModel(dg.Model, _Located):
    """A resource's declared schema: ``columns`` maps names to Arrow types (``int64 not null``);
    without ``columns`` the schema is inferred. ``on_bad_row``: ``halt`` or ``dead_letter``."""

    columns: Annotated[
        dict[str, str] | None, _field("Column name to Arrow type (`int64 not null`); none: inferred.")
    ] = None
    key: Annotated[list[str], _field("The resource's key columns (default: the stream's key).")] = []
    on_bad_row: Annotated[
        Literal["halt", "dead_letter"], _field("A row that does not fit: halt the stream or dead-letter it.")
    ] = "halt"


class StreamEpochModel(dg.Model, _Located):
    """How big an epoch gets. Under the sensor, an epoch is sealed by a tick, or at the first safe
    boundary after ``records`` or ``bytes`` (without waiting for the tick, which reports it);
    ``idle_seconds`` and ``age_seconds`` cap each read into it (at most 0.5 s idle, 1 s long)."""

    records: Annotated[int | None, _field("Records an open epoch holds at most.")] = (
        DEFAULT_EPOCH_LIMITS.records
    )
    bytes: Annotated[int | None, _field("Bytes an open epoch holds at most.")] = DEFAULT_EPOCH_LIMITS.bytes
    idle_seconds: Annotated[float | None, _field("Seconds without a record.")] = DEFAULT_EPOCH_LIMITS.idle
    age_seconds: Annotated[float | None, _field("Seconds since the read began.")] = DEFAULT_EPOCH_LIMITS.age


class StreamModel(dg.Model, _Located):
    """A continuous stream: a sensor runs its epochs, their certificates materialize the sink asset.

    ``resources`` are what the source reads (a NATS stream, Kafka topics); ``policy`` and ``key`` how
    the sink applies them; ``running`` starts the sensor without a click in the UI. ``enabled: false``
    leaves the stream out of the definitions (no asset, check or sensor): a template such as
    ``"{{ env.EVENTS_URL is not none }}"`` declares a stream only where its servers are configured.
    """

    name: Annotated[str, _field("The stream's name: its sink asset's key unless `asset.key` says otherwise.")]
    enabled: Annotated[bool, _field("false leaves the stream out of the definitions.")] = True
    source: Annotated[EndpointModel, _field("What the stream reads.")]
    sink: Annotated[EndpointModel, _field("What the stream writes.")]
    resources: Annotated[list[str], _field("What the source reads: NATS streams, Kafka topics, tables.")]
    policy: Annotated[
        Literal["append", "upsert", "versioned_upsert", "apply_changes", "delete"],
        _field("How the sink applies records."),
    ] = "append"
    key: Annotated[list[str], _field("Key columns (upsert, apply_changes, delete).")] = []
    delivery: Annotated[
        DeliveryName | None,
        _field("The guarantee to insist on: the definitions fail to load when the plan cannot reach it."),
    ] = None
    schemas: Annotated[dict[str, StreamSchemaModel], _field("Declared schemas, by resource.")] = {}
    epoch: Annotated[StreamEpochModel, _field("Where an epoch ends.")] = StreamEpochModel()
    lease_seconds: Annotated[
        float, _field("How long a stopped holder's lease lives without renewal (renewed while it lives).")
    ] = DEFAULT_LEASE_SECONDS
    state_url: Annotated[
        str | None, _field("The state store (default: $FAUCET_STATE_URL, else SQLite under $DAGSTER_HOME).")
    ] = None
    minimum_interval_seconds: Annotated[int, _field("Seconds between two sensor ticks.")] = 30
    budget_seconds: Annotated[
        float | None, _field("Seconds a tick may run epochs for, commits included (default: shared).")
    ] = None
    running: Annotated[bool, _field("Start the sensor without a click in the UI.")] = False
    description: Annotated[str | None, _field("The sink asset's description.")] = None
    workers: Annotated[
        int, _field("Long-running Dagster runs dividing the stream's partitions (1: the sensor runs it).")
    ] = 1
    groups: Annotated[
        int | None, _field("Partition groups the workers divide (default: workers; fixed once certified).")
    ] = None
    asset: AssetAttributes = {}


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
    """Faucet syncs and streams in YAML: an asset per sync; a sink asset, check and sensor per stream."""

    connections: Annotated[
        dict[str, ConnectionModel],
        _field(
            "Connector configs shared by endpoints, by name; each is also a resource of the code location "
            "under its name (a FaucetConnection, listed by `dg list defs`)."
        ),
    ] = {}
    syncs: Annotated[list[SyncModel], _field("Bounded syncs: an asset each.")] = []
    streams: Annotated[
        list[StreamModel],
        _field("Continuous streams: a sink asset, its certificate check and a sensor each."),
    ] = []

    _lines: dict[str, dict[int, tuple[str, int]]] = PrivateAttr(default_factory=dict)
    """The ``defs.yaml`` line of each sync and stream, by kind and index, when loaded from YAML."""

    @classmethod
    def load(cls, attributes: Any, context: dg.ComponentLoadContext) -> "FaucetComponent":
        """Dagster's loading, keeping where each sync and stream is declared (the loading context
        holds the YAML's source positions; ``build_defs``' does not)."""
        component = super().load(attributes, context)
        assert isinstance(component, FaucetComponent)
        component._lines = _declaration_lines(context)
        return component

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
        """Every sync's and stream's definitions, after every config was parsed and every pair planned
        (no I/O): one mistake anywhere fails the load, naming this file, the declaration and each
        problem."""
        where = _declared_in(context)
        self.check(where)
        return dg.Definitions.merge(
            self.build_sync_defs(self._lines.get("syncs")),
            self.build_stream_defs(self._lines.get("streams")),
            dg.Definitions(resources=self._connections()),
        )

    def check(self, where: str = "FaucetComponent") -> None:
        """Parse every connector config and plan every pair of this component, without I/O; raise one
        ConfigError listing every problem (``where``: the component's file)."""
        connections = self._connections()
        problems: list[str] = []
        checks: list[PairCheck] = []
        for sync in self.syncs:
            try:
                checks.append(self._sync(sync, connections).pair_check())
            except ConfigError as exc:
                problems.append(f"sync {sync.name}: {exc.message}")
        for model in (model for model in self.streams if model.enabled):
            try:
                checks.append(stream_check(_stream(model, connections)))
            except ConfigError as exc:
                problems.append(f"stream {model.name}: {exc.message}")
        check_pairs(checks, where=where, problems=problems)

    def _connections(self) -> dict[str, FaucetConnection]:
        return {name: _shared_connection(model) for name, model in self.connections.items()}

    def build_stream_defs(self, lines: Mapping[int, tuple[str, int]] | None = None) -> dg.Definitions:
        """The sink asset, certificate check and sensor of each enabled one of ``streams``; ``lines``
        are the YAML lines that declared them, by index (their code references)."""
        connections = self._connections()
        defs = []
        enabled = sum(1 for model in self.streams if model.enabled)
        for index, model in enumerate(self.streams):
            if not model.enabled:
                continue
            stream = _stream(model, connections)
            status = dg.DefaultSensorStatus.RUNNING if model.running else dg.DefaultSensorStatus.STOPPED
            spec = with_code_reference(
                apply_asset_attributes(stream.asset_spec(), model.asset),
                (lines or {}).get(index),
            )
            defs.append(
                build_stream_defs(
                    [stream],
                    asset_specs={stream.name: spec},
                    minimum_interval_seconds=model.minimum_interval_seconds,
                    budget_seconds=model.budget_seconds,
                    default_status=status,
                    streams_sharing=enabled,
                )
            )
        return dg.Definitions.merge(*defs) if defs else dg.Definitions()

    def build_sync_defs(self, lines: Mapping[int, tuple[str, int]] | None = None) -> dg.Definitions:
        """The assets of ``syncs``, their schedules, and a partitions sensor for each partitioned one;
        ``lines`` are the YAML lines that declared them, by index (their code references)."""
        connections = self._connections()
        translator = _AttributesTranslator(
            {sync.name: sync.asset for sync in self.syncs},
            {sync.name: (lines or {}).get(index) for index, sync in enumerate(self.syncs)},
        )
        schedules = []
        sensors = []
        assets = []
        checks = []
        for model in self.syncs:
            sync = self._sync(model, connections)
            [asset] = faucet_sync_assets([sync], translator=translator)
            assets.append(asset)
            checks.append(sync_verify_check(sync, asset.key))
            if asset.partitions_def is not None:
                sensors.append(faucet_partitions_sensor(sync))
            if model.schedule is not None:
                schedules.append(
                    faucet_schedule(asset, model.schedule, name=f"{asset.node_def.name}_schedule")
                )
        return dg.Definitions(assets=assets, asset_checks=checks, schedules=schedules, sensors=sensors)

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


_SHARED_CONNECTIONS: dict[str, FaucetConnection] = {}
"""One ``FaucetConnection`` object per distinct declaration, so that components declaring the same
connection under the same name merge as one resource (Dagster merges a resource key only when the
objects are the same)."""


def _shared_connection(model: ConnectionModel) -> FaucetConnection:
    identity = json.dumps([model.connector, model.config], sort_keys=True, default=repr)
    connection = _SHARED_CONNECTIONS.get(identity)
    if connection is None:
        connection = FaucetConnection(connector=model.connector, config=dict(model.config))
        _SHARED_CONNECTIONS[identity] = connection
    return connection


def _declared_in(context: dg.ComponentLoadContext) -> str:
    """The component's file, relative to the project root when it is inside it."""
    path = Path(context.path)
    if path.is_dir():
        path = path / "defs.yaml"
    try:
        return str(path.relative_to(context.project_root))
    except ValueError:
        return str(path)


def _declaration_lines(context: dg.ComponentLoadContext) -> dict[str, dict[int, tuple[str, int]]]:
    """The ``defs.yaml`` file and line of each sync and stream, by kind and index (none when the
    component was not loaded from YAML)."""
    tree = context.resolution_context.source_position_tree
    attributes = None if tree is None else tree.children.get("attributes")
    found: dict[str, dict[int, tuple[str, int]]] = {}
    for kind in ("syncs", "streams"):
        declared = None if attributes is None else attributes.children.get(kind)
        for index, child in declared.children.items() if declared is not None else []:
            if isinstance(index, int):
                found.setdefault(kind, {})[index] = (child.position.filename, child.position.start.line)
    return found


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
        workers=model.workers,
        groups=model.groups,
    )


class _AttributesTranslator(FaucetTranslator):
    """The default translation, with each sync's ``asset`` attributes from the YAML applied over it."""

    def __init__(
        self,
        attributes: Mapping[str, Mapping[str, Any]],
        lines: Mapping[str, tuple[str, int] | None],
    ) -> None:
        self.attributes = dict(attributes)
        self.lines = dict(lines)

    def get_asset_spec(self, data: FaucetSyncData) -> dg.AssetSpec:
        spec = with_code_reference(super().get_asset_spec(data), self.lines.get(data.sync.name))
        attributes = self.attributes.get(data.sync.name)
        return spec if not attributes else apply_asset_attributes(spec, attributes)


__all__ = ["FaucetAssetAttributes", "FaucetComponent", "FaucetComponentScaffolder", "apply_asset_attributes"]
