"""The attributes of ``FaucetComponent`` in a ``defs.yaml``: connections, syncs, streams, and how a
mistake in them is reported.

Every refusal names the file and line of the field (``defs.yaml:33 - attributes.syncs.1.shedule``),
never its value (it may be a secret), and a misspelt key says which field it likely meant
(``did you mean `schedule`?``). Dagster lets every field hold a template string, so its model makes
each field a union with ``str``; :func:`clean_errors` keeps only the errors of the branch the value
took (a list's, not "syncs.str: Input should be a valid string" beside it) and removes the union's
labels from each error's path, so Dagster finds the line of the field itself.
"""

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import dagster as dg

# What Dagster shows as is, without drawing its component tree first (1.13 exports it from here only).
from dagster.components.core.component_tree import ComponentTreeException
from dagster.components.resolved.context import ResolutionContext
from dagster.components.resolved.core_models import resolve_asset_spec_update_kwargs_to_mapping
from dagster.components.resolved.errors import ResolutionException
from pydantic import BaseModel, Field, ValidationError, ValidatorFunctionWrapHandler, model_validator
from pydantic_core import InitErrorDetails

from faucet_dagster.protocol import ConfigError
from faucet_dagster.runner.bounded_values import DEFAULT_BATCH_SIZE
from faucet_dagster.runner.continuous import DEFAULT_EPOCH_LIMITS, DEFAULT_LEASE_SECONDS
from faucet_dagster.syncs.declaration import DEFAULT_RETRY_POLICY

DeliveryName = Literal["effectively_once", "at_least_once"]


def _field(description: str, **kwargs: Any) -> dg.Resolver:
    """A plain field with its description (shown by editors and ``dg`` docs)."""
    resolver: dg.Resolver = dg.Resolver.default(description=description, **kwargs)
    return resolver


class DeclarationError(ConfigError, ComponentTreeException):
    """A ``defs.yaml`` the component refuses: every problem on its own line, starting with the
    ``file:line`` of its field. A ``ComponentTreeException`` to Dagster, which then shows it as it is,
    without first drawing the component tree and its own stack."""


class AttributeRefused(DeclarationError, ResolutionException):
    """A value of the component's attributes refused while it was resolved (Dagster's
    ``ResolutionException`` too)."""


class _Located(dg.Resolvable):
    """Resolution that names where a value was refused: a pydantic error while a model is resolved
    becomes :class:`AttributeRefused` naming each field's YAML path and its ``file:line``, never the
    value (it may be a secret: pydantic and Dagster's snippets echo it)."""

    @classmethod
    def resolve_from_model(cls, context: ResolutionContext, model: BaseModel) -> Any:
        if not isinstance(model, BaseModel):
            # A scalar where a mapping belongs (Dagster iterates a string given for a list).
            path = _declared_path(context, context.path)
            raise AttributeRefused(
                f"{_line(context, path)}{'.'.join(map(str, path))}: expected a mapping of "
                f"{cls.__name__} fields, not a {type(model).__name__}"
            )
        try:
            return super().resolve_from_model(context, model)
        except ValidationError as exc:
            raise AttributeRefused(_refusal(context, cls.__name__, exc)) from None


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


class RetryPolicyModel(dg.Model):
    """Dagster's ``RetryPolicy`` for the retryable errors of a sync's runs."""

    max_retries: Annotated[int, Field(description="Retries after the first attempt.")] = (
        DEFAULT_RETRY_POLICY.max_retries
    )
    delay: Annotated[float, Field(description="Seconds before the first retry.")] = float(
        DEFAULT_RETRY_POLICY.delay or 0
    )
    backoff: Annotated[
        Literal["exponential", "linear"] | None, Field(description="How the delay grows (null: constant).")
    ] = "exponential"
    jitter: Annotated[
        Literal["full", "plus_minus"] | None, Field(description="Random variation of the delay (null: none).")
    ] = "plus_minus"

    def policy(self) -> dg.RetryPolicy:
        return dg.RetryPolicy(
            max_retries=self.max_retries,
            delay=self.delay,
            backoff=None if self.backoff is None else dg.Backoff(self.backoff.upper()),
            jitter=None if self.jitter is None else dg.Jitter(self.jitter.upper()),
        )


class SyncChecksModel(dg.Model):
    """Asset checks a sync opts in to, each evaluated after every run."""

    no_dead_letters: Annotated[bool, Field(description="Fail when a run dead-lettered rows.")] = False
    row_count_drop: Annotated[
        float | None,
        Field(description="Fail when the table lost more than this fraction of its rows (0: any drop)."),
    ] = None
    bookmark_advances: Annotated[bool, Field(description="Warn when a run found nothing new.")] = False


class TimePartitionsModel(dg.Model):
    """One partition per time window: ``daily`` from ``start`` (``2024-01-01``)."""

    schedule: Annotated[
        Literal["hourly", "daily", "weekly", "monthly"], Field(description="The windows' length.")
    ]
    start: Annotated[str, Field(description="The first window's start: `2024-01-01` (or with a time).")]
    timezone: Annotated[str | None, Field(description="The windows' time zone (default UTC).")] = None
    end_offset: Annotated[
        int, Field(description="Windows past the current one (0: up to the last complete one).")
    ] = 0

    def definition(self) -> dg.TimeWindowPartitionsDefinition:
        kinds: Mapping[str, Any] = {
            "hourly": dg.HourlyPartitionsDefinition,
            "daily": dg.DailyPartitionsDefinition,
            "weekly": dg.WeeklyPartitionsDefinition,
            "monthly": dg.MonthlyPartitionsDefinition,
        }
        definition: dg.TimeWindowPartitionsDefinition = kinds[self.schedule](
            start_date=self.start, timezone=self.timezone, end_offset=self.end_offset
        )
        return definition


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
    schedule_running: Annotated[
        bool, _field("Start the schedule without a click in the UI (Dagster's default: stopped).")
    ] = False
    retry_policy: Annotated[
        RetryPolicyModel | None,
        _field("How a run failing on a retryable error (a refused connection) is retried; null: never."),
    ] = RetryPolicyModel()
    pool: Annotated[
        str | None, _field("Dagster's concurrency pool the sync's runs take a slot of (`dg` instance pools).")
    ] = None
    checks: Annotated[SyncChecksModel, _field("Asset checks evaluated after every run (opt-in).")] = (
        SyncChecksModel()
    )
    run_new_partitions: Annotated[
        bool, _field("A partitioned sync: run each new partition as soon as its sensor adds it.")
    ] = False
    partitions: Annotated[
        TimePartitionsModel | None,
        _field("Time-window partitions of a source read by a time cursor (the sql connector's `cursor`)."),
    ] = None
    asset: AssetAttributes = {}


class StreamSchemaModel(dg.Model, _Located):
    """A resource's declared schema: ``columns`` maps names to Arrow types (``int64 not null``);
    without ``columns`` the schema is inferred. ``on_bad_row``: ``halt`` or ``dead_letter``.
    ``on_missing_field``: a record lacking a field lands with null there (``null``, counted in the
    certificate) or does not fit (``refuse``: a strict schema)."""

    columns: Annotated[
        dict[str, str] | None, _field("Column name to Arrow type (`int64 not null`); none: inferred.")
    ] = None
    key: Annotated[list[str], _field("The resource's key columns (default: the stream's key).")] = []
    on_bad_row: Annotated[
        Literal["halt", "dead_letter"], _field("A row that does not fit: halt the stream or dead-letter it.")
    ] = "halt"
    on_missing_field: Annotated[
        Literal["null", "refuse"], _field("A record lacking a field: null there (counted), or a bad row.")
    ] = "null"


class StreamEpochModel(dg.Model, _Located):
    """How big an epoch gets. Under the sensor, an epoch is sealed in the background at the first safe
    boundary after it is ``age_seconds`` old (a second by default: how long a row waits to become
    visible) or holds ``records`` or ``bytes``; a tick reports it. ``idle_seconds`` caps each read
    into it (at most 0.5 s)."""

    records: Annotated[int | None, _field("Records an open epoch holds at most.")] = (
        DEFAULT_EPOCH_LIMITS.records
    )
    bytes: Annotated[int | None, _field("Bytes an open epoch holds at most.")] = DEFAULT_EPOCH_LIMITS.bytes
    idle_seconds: Annotated[float | None, _field("Seconds without a record.")] = DEFAULT_EPOCH_LIMITS.idle
    age_seconds: Annotated[float | None, _field("Seconds an epoch reads before it is sealed.")] = (
        DEFAULT_EPOCH_LIMITS.age
    )


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
        int | None,
        _field("Partition groups the workers divide (default: workers; then fixed by the certificates)."),
    ] = None
    asset_per_resource: Annotated[
        bool | None,
        _field("One sink asset per resource (default: for a CDC stream of several tables)."),
    ] = None
    asset: AssetAttributes = {}


# -- errors: the field's own line, a suggestion, no union noise --------------------------------------

_INJECTED_LABELS = ("str",)
HIDDEN = "<not shown>"
"""What stands for a refused value in an error (it may be a secret)."""


@dataclass(frozen=True)
class RefusedAttributes:
    """Attributes that did not validate, and why: what the cleaned model hands to the component's
    ``load`` instead of a model, so that it raises one :class:`DeclarationError` naming each field's
    line (it has the YAML's source positions; a validator does not)."""

    errors: tuple[InitErrorDetails, ...]

    def describe(self, tree: Any) -> str:
        """Each error as ``file:line - attributes.path: message``."""
        lines = []
        for error in self.errors:
            path = ["attributes", *error["loc"]]
            where = ""
            if tree is not None:
                position, _ = tree.lookup_closest_and_path(path, trace=None)
                where = f"{position.filename}:{position.start.line} - "
            lines.append(f"  - {where}{'.'.join(map(str, path))}: {_message(error)}")
        return f"{len(lines)} problem(s) in the component's attributes:\n" + "\n".join(lines)


def _message(error: InitErrorDetails) -> str:
    refused = ValidationError.from_exception_data("attributes", [error])
    return str(refused.errors(include_url=False)[0]["msg"]).removeprefix("Value error, ")


def clean_errors(model: type[BaseModel]) -> type[BaseModel]:
    """``model`` (Dagster's model of the component's attributes) validating with readable errors:
    the errors of a value's ``str`` branch dropped where another branch met it (Dagster makes every
    field a union with ``str`` for templates), union labels removed from each path so the field's own
    ``defs.yaml`` line is found, and a misspelt key given the field it likely meant. Attributes that do
    not validate become :class:`RefusedAttributes`, which the component's ``load`` raises."""

    def readable(cls: type[BaseModel], data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(data)
        except ValidationError as exc:
            return RefusedAttributes(tuple(_readable_errors(model, exc)))

    def json_schema(cls: type[BaseModel], *args: Any, **kwargs: Any) -> dict[str, Any]:
        return readable_schema(model.model_json_schema(*args, **kwargs))

    validator: Any = model_validator(mode="wrap")
    cleaned: type[BaseModel] = type(
        model.__name__,
        (model,),
        {"_readable": validator(classmethod(readable)), "model_json_schema": classmethod(json_schema)},
    )
    return cleaned


def readable_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema ``dg check yaml`` and editors read: every field documented as Dagster derives
    it, but no value refused by it. A JSON-schema refusal of a list reads "is not valid under any of
    the given schemas" with the whole list echoed, its secrets too, at the list's first line; the
    component's own check (:func:`clean_errors`, when the definitions load: ``dg check defs``) names
    the field's line and the key it likely meant, never the value."""
    properties = {
        name: {"anyOf": [field, {}], "description": field.get("description", "")}
        for name, field in schema.get("properties", {}).items()
    }
    return {**schema, "properties": properties}


def _readable_errors(model: type[BaseModel], exc: ValidationError) -> list[InitErrorDetails]:
    errors = exc.errors(include_url=False)
    paths = {tuple(_plain(error["loc"])) for error in errors if not _is_injected(error["loc"])}
    readable: list[InitErrorDetails] = []
    seen: set[tuple[Any, ...]] = set()
    for error in errors:
        loc = tuple(_plain(error["loc"]))
        if _is_injected(error["loc"]) and any(other[: len(loc)] == loc and other != loc for other in paths):
            continue  # the value took another branch; this one only says it is not a string
        if _is_injected(error["loc"]) and loc in paths:
            continue
        if (loc, error["msg"]) in seen:
            continue
        seen.add((loc, error["msg"]))
        found = []
        if error["type"] == "extra_forbidden" and loc:
            found = difflib.get_close_matches(str(loc[-1]), _fields(model, loc[:-1]), n=1, cutoff=0.6)
        if found:  # a built-in type whose message carries ours: Dagster rebuilds messages from types
            hint = f"{error['msg']} (did you mean `{found[0]}`?)"
            readable.append(
                InitErrorDetails(type="value_error", loc=loc, input=HIDDEN, ctx={"error": ValueError(hint)})
            )
        else:
            details = InitErrorDetails(type=error["type"], loc=loc, input=HIDDEN)
            if "ctx" in error:
                details["ctx"] = error["ctx"]
            readable.append(details)
    return readable


def _is_injected(loc: Sequence[Any]) -> bool:
    return bool(loc) and loc[-1] in _INJECTED_LABELS


def _plain(loc: Sequence[Any]) -> list[Any]:
    """``loc`` without pydantic's union labels (``tuple[SyncModelModel, ...]``, ``EndpointModelModel``)."""
    return [part for part in loc if isinstance(part, int) or not _is_label(part)]


def _is_label(part: str) -> bool:
    return part in _INJECTED_LABELS or "[" in part or part.endswith("Model") or part.startswith("function-")


def _fields(model: Any, loc: Sequence[Any]) -> list[str]:
    """The field names at ``loc`` of the attributes' model (empty when unknown)."""
    for part in loc:
        if isinstance(part, int):
            continue
        info = getattr(model, "model_fields", {}).get(part)
        if info is None:
            return []
        model = _model_in(info.annotation)
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}))


def _model_in(annotation: Any) -> Any:
    """The pydantic model inside a (list, tuple, dict, optional or union) annotation."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


__all__ = [
    "AssetAttributes",
    "AttributeRefused",
    "ConnectionModel",
    "DeclarationError",
    "DeliveryName",
    "EndpointModel",
    "FaucetAssetAttributes",
    "RefusedAttributes",
    "RetryPolicyModel",
    "StreamEpochModel",
    "StreamModel",
    "StreamSchemaModel",
    "SyncChecksModel",
    "SyncModel",
    "TimePartitionsModel",
    "apply_asset_attributes",
    "clean_errors",
]
