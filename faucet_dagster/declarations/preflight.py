"""Every pair checked when the definitions load: each connector config parsed, each pair planned.

``dg check defs``, ``dg dev`` and every code server load the definitions; a sync or stream whose
config is wrong or whose pair the planner refuses fails that load, with every problem of every
declaration in one :class:`ConfigError`, instead of failing its first run.

Nothing here does I/O: connector factories never connect, and the planner is pure. Environment
references (``{env: NAME}``, ``dg.EnvVar``) stay unread, as the definitions must not hold secrets:
each is replaced by a placeholder no validator takes for a URL or a number. An error at a field that
held a reference, or a whole-model error of a config that holds one, depends on the variable's value
and is left to the run, which reads it; a pair that cannot be built without such a value is planned by
its run. A connection given by resource key is only known at run time and is checked there too.
"""

import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any, Protocol

from pydantic import ValidationError

from faucet_dagster.declarations.code_location import declaring_line
from faucet_dagster.declarations.resources import FaucetEndpoint, env_name, merge_config
from faucet_dagster.pipeline import BadRowPolicy, ResourceSchema
from faucet_dagster.planner import plan
from faucet_dagster.protocol import (
    ConfigError,
    Delivery,
    FaucetError,
    Mode,
    PlanError,
    Role,
    Sink,
    Source,
    WritePolicy,
)
from faucet_dagster.runner.sync import run_sync

ENV_PLACEHOLDER = "<faucet: set from an environment variable at run time>"
"""What stands for a variable's value while the definitions load (never a valid URL or number)."""

FieldPath = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    """One problem of a declaration, and the field it is about (``("sink", "config", "tabel")``,
    relative to the declaration; empty when it is about the pair as a whole)."""

    text: str
    field: FieldPath = ()

    def __str__(self) -> str:
        return self.text

    def within(self, prefix: str | int) -> "Problem":
        return Problem(f"{prefix}: {self.text}", (prefix, *self.field))


Locate = Callable[["PairCheck", FieldPath], str | None]
"""Where a declaration's field was written (``defs.yaml:33``), or None."""


@dataclass(frozen=True)
class PairCheck:
    """What a bounded sync or a stream is checked with; ``where`` names it (``sync orders``)."""

    where: str
    mode: Mode
    source: FaucetEndpoint
    sink: FaucetEndpoint
    delivery: Delivery | None = None
    dead_letter: FaucetEndpoint | None = None
    policy: WritePolicy | None = None
    """A stream's policy; a bounded sink's own config chooses its mode."""
    key: tuple[str, ...] = ()
    routes_bad_rows: bool = False
    """A stream whose schemas dead-letter bad rows."""


class StreamDeclaration(Protocol):
    """What the check reads of a stream (a :class:`faucet_dagster.streams.sensor.FaucetStream`)."""

    @property
    def name(self) -> str: ...
    @property
    def source(self) -> FaucetEndpoint: ...
    @property
    def sink(self) -> FaucetEndpoint: ...
    @property
    def policy(self) -> WritePolicy: ...
    @property
    def key(self) -> tuple[str, ...]: ...
    @property
    def delivery(self) -> Delivery | None: ...
    @property
    def schemas(self) -> Mapping[str, ResourceSchema]: ...


def stream_check(stream: StreamDeclaration) -> PairCheck:
    """What the definitions' load checks of a stream: both roles' configs and the continuous pair."""
    return PairCheck(
        where=f"stream {stream.name}",
        mode=Mode.CONTINUOUS,
        source=stream.source,
        sink=stream.sink,
        delivery=stream.delivery,
        policy=stream.policy,
        key=stream.key,
        routes_bad_rows=any(
            schema.on_bad_row is BadRowPolicy.DEAD_LETTER for schema in stream.schemas.values()
        ),
    )


def check_streams(streams: Sequence[StreamDeclaration], *, declared_by: str) -> None:
    """Check streams declared in Python (``declared_by``: the function that builds them) as the
    component checks its own: one :class:`ConfigError` naming the file and line that called
    ``declared_by``, each stream and every problem."""
    line = declaring_line()
    where = declared_by if line is None else f"{declared_by} at {line[0]}:{line[1]}"
    check_pairs([stream_check(stream) for stream in streams], where=where)


def check_pairs(
    checks: Sequence[PairCheck],
    *,
    where: str,
    problems: Sequence[str] = (),
    locate: Locate | None = None,
) -> None:
    """Raise one :class:`ConfigError` listing every problem of ``checks`` (``where``: the file or
    function that declared them) after the ``problems`` already found, or return when there are none:
    every config parses and every pair is accepted. ``locate`` says where each problem's field was
    written (``defs.yaml:33``), which then starts its line."""
    problems = list(problems)
    for check in checks:
        for problem in located_problems(check):
            line = None if locate is None else locate(check, problem.field)
            problems.append(f"{line + ' - ' if line else ''}{check.where}: {problem}")
    if problems:
        raise ConfigError(
            f"{len(problems)} problem(s) in the faucet declarations:\n"
            + "\n".join(f"  - {p}" for p in problems),
            where=where,
        )


def pair_problems(check: PairCheck) -> list[str]:
    """Every problem of one declaration: configs that do not parse, then the planner's violations."""
    return [str(problem) for problem in located_problems(check)]


def located_problems(check: PairCheck) -> list[Problem]:
    """:func:`pair_problems`, each with the field it is about."""
    bounded = check.mode is Mode.BOUNDED
    built: list[Any] = []
    try:
        source, source_problems = build_offline(check.source, Role.SOURCE if bounded else Role.STREAM_SOURCE)
        sink, sink_problems = build_offline(check.sink, Role.SINK if bounded else Role.STREAMING_SINK)
        built = [source, sink]
        problems = [p.within("source") for p in source_problems] + [p.within("sink") for p in sink_problems]
        dead_letter = None
        if check.dead_letter is not None:
            dead_letter, dead_letter_problems = build_offline(check.dead_letter, Role.SINK)
            built.append(dead_letter)
            problems.extend(p.within("dead_letter") for p in dead_letter_problems)
            if (
                isinstance(dead_letter, Sink)
                and WritePolicy.APPEND not in dead_letter.supported_write_modes()
            ):
                problems.append(Problem("dead_letter: the dead-letter sink cannot append", ("dead_letter",)))
        if source is None or sink is None or (check.dead_letter is not None and dead_letter is None):
            return problems  # not buildable now (a problem above, or a value only the run knows)
        return problems + [Problem(text) for text in _plan_problems(check, source, sink)]
    finally:
        _close(connector for connector in built if connector is not None)


def _plan_problems(check: PairCheck, source: Any, sink: Any) -> list[str]:
    if check.mode is Mode.BOUNDED:
        assert isinstance(sink, Sink)
        policy, key = sink.write_mode()
        sink_capabilities = sink.capabilities()
        # A shardable source makes a partitioned asset: each run moves one shard.
        sharded = source.capabilities().shardable
        if sharded and policy is WritePolicy.REPLACE:
            return [
                "replace swaps in the whole table, so a run over one partition (shard) would drop "
                "every other shard's rows: use append or upsert for a shardable source"
            ]
        if sharded and sink_capabilities.atomic_watermark and not sink.scope_watermark("preflight"):
            # As the runner does: shards share the destination, one watermark holds one sequence.
            sink_capabilities = replace(sink_capabilities, atomic_watermark=False)
    else:
        policy, key, sink_capabilities = check.policy or WritePolicy.APPEND, check.key, sink.capabilities()
    try:
        plan(
            source.capabilities(),
            sink_capabilities,
            check.mode,
            policy,
            key,
            delivery=check.delivery,
            durable_state=True,
            dead_letter=check.dead_letter is not None or check.routes_bad_rows,
        )
    except PlanError as exc:
        return [f"refused by the planner: [{v.code}] rule {v.rule}: {v.message}" for v in exc.violations]
    return []


def build_offline(endpoint: FaucetEndpoint, role: Role) -> tuple[object | None, list[Problem]]:
    """The connector in ``role``, built without I/O and without reading environment references
    (``None`` when it cannot be built now), and its config's problems (each with its field, under
    ``config``; a misspelt key with the field it likely meant). The caller closes it."""
    if isinstance(endpoint.connection, str):
        return None, []  # a resource key: its connection is only known at run time
    connection = endpoint.connection
    try:
        spec = connection.spec()
    except ConfigError as exc:
        return None, [Problem(exc.message, ("connector",))]
    role_spec = spec.roles.get(role)
    if role_spec is None:
        roles = ", ".join(sorted(r.value for r in spec.roles))
        return None, [
            Problem(f"connector {spec.name!r} has no {role.value} role (it has: {roles})", ("connector",))
        ]
    raw = merge_config(connection.config, endpoint.config)
    env_paths: list[FieldPath] = []
    placeheld = _placehold(raw, (), env_paths)
    try:
        config = role_spec.config_model.model_validate(placeheld)
    except ValidationError as exc:
        errors = [e for e in exc.errors(include_input=False) if not _env_bound(tuple(e["loc"]), env_paths)]
        missing = {str(e["loc"][-1]) for e in errors if e["type"] == "missing" and e["loc"]}
        problems = []
        for error in errors:
            loc = tuple(error["loc"])
            hint = ""
            if error["type"] == "extra_forbidden" and loc:
                hint = did_you_mean(str(loc[-1]), missing or _fields_at(role_spec.config_model, loc[:-1]))
            problems.append(
                Problem(
                    f"{spec.name} {role.value} config: {'.'.join(str(p) for p in loc) or '<root>'}: "
                    f"{error['msg']}{hint}",
                    ("config", *loc),
                )
            )
        return None, problems
    try:
        return role_spec.factory(config), []
    except FaucetError as exc:
        return None, [] if env_paths else [Problem(exc.message, ("config",))]


def did_you_mean(word: str, candidates: Iterator[str] | Sequence[str] | set[str]) -> str:
    """`` (did you mean `table`?)`` when one of ``candidates`` is close to ``word``, else empty."""
    found = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=0.6)
    return f" (did you mean `{found[0]}`?)" if found else ""


def _fields_at(model: Any, loc: FieldPath) -> list[str]:
    """The field names of the (nested) pydantic model at ``loc`` of ``model`` (empty when unknown)."""
    for part in loc:
        fields = getattr(model, "model_fields", {})
        info = fields.get(part) if isinstance(part, str) else None
        annotation = getattr(info, "annotation", None)
        model = next(
            (
                arg
                for arg in (annotation, *getattr(annotation, "__args__", ()))
                if hasattr(arg, "model_fields")
            ),
            None,
        )
        if model is None:
            return []
    fields = getattr(model, "model_fields", {})
    return [*fields, *(info.alias for info in fields.values() if info.alias)]


def _placehold(value: Any, path: FieldPath, found: list[FieldPath]) -> Any:
    """``value`` with each environment reference replaced by :data:`ENV_PLACEHOLDER` (paths in ``found``)."""
    if env_name(value) is not None:
        found.append(path)
        return ENV_PLACEHOLDER
    if isinstance(value, Mapping):
        return {key: _placehold(item, (*path, key), found) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_placehold(item, (*path, index), found) for index, item in enumerate(value)]
    return value


def _env_bound(loc: FieldPath, env_paths: Sequence[FieldPath]) -> bool:
    """Whether a validation error at ``loc`` may come from a placeholder: a whole-model error of a
    config holding a reference, or an error at (or inside) a field that held one. A union's tag in
    ``loc`` (``auth.user_password.config``) is skipped over by matching the path as a subsequence."""
    if not env_paths:
        return False
    if not loc:
        return True
    return any(_subsequence(env_path, loc) or _subsequence(loc, env_path) for env_path in env_paths)


def _subsequence(short: FieldPath, long: FieldPath) -> bool:
    remaining = iter(long)
    return all(any(part == item for item in remaining) for part in short)


def _close(connectors: Iterator[object]) -> None:
    """Release whatever building allocated (no connection was opened; nothing to report)."""
    closable = [c for c in connectors if isinstance(c, Source | Sink)]  # stream connectors hold nothing
    if not closable:
        return

    async def close_all() -> None:
        for connector in closable:
            with suppress(FaucetError):
                await connector.close()

    run_sync(close_all())


__all__ = [
    "ENV_PLACEHOLDER",
    "Locate",
    "PairCheck",
    "Problem",
    "StreamDeclaration",
    "build_offline",
    "check_pairs",
    "check_streams",
    "did_you_mean",
    "located_problems",
    "pair_problems",
    "stream_check",
]
