"""``FaucetComponent``: declare faucet syncs in a ``defs.yaml``, without Python.

.. code-block:: yaml

    type: faucet_dagster.components.FaucetComponent
    attributes:
      connections:                      # shared connector configs, by name
        lake: {connector: files}
        warehouse:
          connector: duckdb
          config: {path: "{{ context.project_root }}/.faucet_data/warehouse.duckdb"}
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
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import dagster as dg
from pydantic import BaseModel, PrivateAttr

from faucet_dagster.declarations.code_location import with_code_reference
from faucet_dagster.declarations.preflight import FieldPath, PairCheck, check_pairs, stream_check
from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.declarations.yaml_models import (
    ConnectionModel,
    DeclarationError,
    EndpointModel,
    RefusedAttributes,
    StreamModel,
    SyncModel,
    _field,
    apply_asset_attributes,
    clean_errors,
)
from faucet_dagster.pipeline import ResourceSchema
from faucet_dagster.protocol import ConfigError, Delivery, ReadLimits, WritePolicy
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.definitions import build_stream_defs
from faucet_dagster.syncs.assets import FaucetTranslator, faucet_sync_assets
from faucet_dagster.syncs.declaration import FaucetSync, FaucetSyncData, SyncChecks
from faucet_dagster.syncs.partitions import faucet_partitions_sensor
from faucet_dagster.syncs.schedules import faucet_schedule
from faucet_dagster.syncs.verification import sync_verify_check

# Dagster 1.13's component loading rebuilds a component's asset checks with a beta parameter of its own
# (repository_data.py converts them back through AssetsDefinition(execution_type=...)): a BetaWarning on
# every load that no user code asked for. This one message only.
warnings.filterwarnings(
    "ignore",
    message=r"Parameter `execution_type` of function `AssetsDefinition.__init__` is currently in beta",
)


class FaucetComponentScaffolder(dg.Scaffolder[Any]):
    """``dg scaffold defs faucet_dagster.components.FaucetComponent <path>``: a ``defs.yaml`` with one
    files-to-SQLite sync to edit, named after its folder (``defs/landing`` declares the sync and the
    asset ``landing``, reading ``data/landing/*.csv`` into the table ``landing``), so that it does not
    take a name the project already uses, such as the example's ``orders``."""

    def scaffold(self, request: dg.ScaffoldRequest[Any]) -> None:
        folder = request.target_path.name.lower()
        name = "".join(c if c.isalnum() and c.isascii() else "_" for c in folder).strip("_") or "sync"
        if name[0].isdigit():
            name = f"sync_{name}"
        dg.scaffold_component(
            request,
            {
                "connections": {
                    "files": {"connector": "files"},
                    # The example project's warehouse, declared alike so both load in one project.
                    "warehouse": {
                        "connector": "duckdb",
                        "config": {"path": "{{ context.project_root }}/.faucet_data/warehouse.duckdb"},
                    },
                },
                "syncs": [
                    {
                        "name": name,
                        "source": {
                            "connection": "files",
                            "config": {"paths": [f"{{{{ context.project_root }}}}/data/{name}/*.csv"]},
                        },
                        "sink": {"connection": "warehouse", "config": {"table": name, "mode": "append"}},
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
    _positions: Any = PrivateAttr(default=None)
    """The ``defs.yaml`` source positions (Dagster's tree), when loaded from YAML."""

    @classmethod
    def get_model_cls(cls) -> type[BaseModel] | None:
        """Dagster's model of the attributes, refusing a value with readable errors (the field's own
        line, a suggestion for a misspelt key, no union noise: see
        :func:`~faucet_dagster.declarations.yaml_models.clean_errors`)."""
        model = super().get_model_cls()
        return None if model is None else clean_errors(model)

    @classmethod
    def load(cls, attributes: Any, context: dg.ComponentLoadContext) -> "FaucetComponent":
        """Dagster's loading, keeping where each sync and stream is declared (the loading context
        holds the YAML's source positions; ``build_defs``' does not). Attributes the model refused
        are one :class:`DeclarationError` naming each field's line."""
        tree = context.resolution_context.source_position_tree
        if isinstance(attributes, RefusedAttributes):
            raise DeclarationError(attributes.describe(tree), where=_declared_in(context))
        component = super().load(attributes, context)
        assert isinstance(component, FaucetComponent)
        component._lines = _declaration_lines(context)
        component._positions = tree
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
        try:
            self.check(_declared_in(context))
        except ConfigError as exc:  # shown as it is, without Dagster's drawing of the component tree
            raise DeclarationError(exc.message, where=exc.where) from None
        return dg.Definitions.merge(
            self.build_sync_defs(self._lines.get("syncs")),
            self.build_stream_defs(self._lines.get("streams")),
            dg.Definitions(resources=self._connections()),
        )

    def check(self, where: str = "FaucetComponent") -> None:
        """Parse every connector config and plan every pair of this component, without I/O; raise one
        ConfigError listing every problem (``where``: the component's file), each starting with the
        ``defs.yaml`` line of its field when the component was loaded from YAML."""
        connections = self._connections()
        problems: list[str] = []
        checks: list[PairCheck] = []
        paths: dict[str, tuple[str, int]] = {}
        for index, sync in enumerate(self.syncs):
            try:
                checks.append(self._sync(sync, connections).pair_check())
                paths[checks[-1].where] = ("syncs", index)
            except ConfigError as exc:
                problems.append(f"{self._line(('syncs', index))}sync {sync.name}: {exc.message}")
        for index, model in enumerate(self.streams):
            if not model.enabled:
                continue
            try:
                checks.append(stream_check(_stream(model, connections)))
                paths[checks[-1].where] = ("streams", index)
            except ConfigError as exc:
                problems.append(f"{self._line(('streams', index))}stream {model.name}: {exc.message}")

        def locate(check: PairCheck, field: FieldPath) -> str | None:
            declared = paths.get(check.where)
            return None if declared is None else self._line((*declared, *field)).removesuffix(" - ") or None

        check_pairs(checks, where=where, problems=problems, locate=locate)

    def _line(self, path: FieldPath) -> str:
        """``file:line - `` of the attribute at ``path`` (a connector config key written in the
        endpoint, else in its connection), or of its closest declared ancestor; empty without YAML."""
        tree = self._positions
        if tree is None:
            return ""
        attributes = ["attributes", *path]
        if len(path) >= 4 and path[3] == "config" and tree.lookup(attributes) is None:
            endpoint = getattr(getattr(self, str(path[0]))[int(path[1])], str(path[2]), None)
            connection = getattr(endpoint, "connection", None)
            if connection is not None and tree.lookup(["attributes", "connections", connection, *path[3:]]):
                attributes = ["attributes", "connections", connection, *path[3:]]
        position, _ = tree.lookup_closest_and_path(attributes, trace=None)
        return f"{position.filename}:{position.start.line} - "

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
            if isinstance(asset.partitions_def, dg.DynamicPartitionsDefinition):
                sensors.append(
                    faucet_partitions_sensor(
                        sync, asset_key=asset.key, run_new_partitions=model.run_new_partitions
                    )
                )
            if model.schedule is not None:
                status = dg.DefaultScheduleStatus.RUNNING if model.schedule_running else None
                schedules.append(
                    faucet_schedule(
                        asset,
                        model.schedule,
                        name=f"{asset.node_def.name}_schedule",
                        default_status=status or dg.DefaultScheduleStatus.STOPPED,
                    )
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
            retry_policy=None if model.retry_policy is None else model.retry_policy.policy(),
            pool=model.pool,
            checks=SyncChecks(
                no_dead_letters=model.checks.no_dead_letters,
                row_count_drop=model.checks.row_count_drop,
                bookmark_advances=model.checks.bookmark_advances,
            ),
            time_partitions=None if model.partitions is None else model.partitions.definition(),
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
            resource: ResourceSchema.from_columns(
                schema.columns, schema.key or model.key, schema.on_bad_row, schema.on_missing_field
            )
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
        asset_per_resource=model.asset_per_resource,
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


__all__ = ["FaucetComponent", "FaucetComponentScaffolder", "apply_asset_attributes"]
