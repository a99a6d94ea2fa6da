"""What the FCP checks share: the rule each check enforces, a whole read of a bounded source, and
the planner's refusals (the honest branch of a capability a connector denies).
"""

from collections.abc import Awaitable, Callable

from faucet_dagster.conformance.harness import Subject
from faucet_dagster.conformance.options import ConformanceFailure
from faucet_dagster.planner import Code, plan
from faucet_dagster.protocol import (
    Delivery,
    Durability,
    Emits,
    FaucetError,
    Mode,
    Operation,
    Ordering,
    Page,
    PlanError,
    Replay,
    Sink,
    SinkCapabilities,
    Source,
    SourceCapabilities,
    UnsupportedOperation,
    WritePolicy,
)

SCHEMA_RULE = "FCP 3 config schema (check 1)"
MEMORY_RULE = "FCP 2.2 bounded memory (check 2)"
CAPABILITY_RULE = "FCP 2.4/3.3 truthful capabilities (check 5)"
PANIC_RULE = "FCP 2.1/4 no panic (check 6)"


async def read_all(subject: Subject, source: Source, batch_size: int, rule: str) -> list[Page]:
    """Every page of one read (held: for checks whose datasets are small)."""

    async def collect() -> list[Page]:
        return [page async for page in source.stream_pages({}, batch_size)]

    try:
        return await subject.within(collect(), rule, f"stream_pages(batch_size={batch_size})")
    finally:
        await subject.within(source.close(), rule, "Source.close")


async def expect_unsupported(call: Callable[[], object], what: str) -> None:
    try:
        result = call()
        if isinstance(result, Awaitable):
            await result
    except UnsupportedOperation:
        return
    except FaucetError as exc:
        raise ConformanceFailure(
            CAPABILITY_RULE, f"{what} is declared unsupported but raised {type(exc).__name__}: {exc}"
        ) from exc
    raise ConformanceFailure(CAPABILITY_RULE, f"{what} is declared unsupported but it returned")


ANY_SOURCE = SourceCapabilities(
    emits=Emits.ROWS,
    operations=frozenset({Operation.INSERT}),
    ordering=Ordering.STRICT_GLOBAL,
    replay=Replay.REPLAYABLE_AT_LEAST_ONCE,
    bounded=True,
    continuous=True,
    deterministic=True,
    event_identity=True,
)
"""The counterpart of a sink under test when the planner is asked: a source that breaks no rule."""

ANY_SINK = SinkCapabilities(
    bounded_policies=frozenset(WritePolicy),
    continuous_policies=frozenset(WritePolicy) - {WritePolicy.REPLACE},
    durability=Durability.TRANSACTIONAL,
    atomic_watermark=True,
)
"""The counterpart of a source under test: a sink that accepts every policy and has a watermark."""


def policy_of(sink: Sink) -> WritePolicy:
    return sink.write_mode()[0]


async def planner_refuses(
    subject: Subject,
    mode: Mode,
    policy: WritePolicy,
    code: Code,
    rule: str,
    *,
    source_caps: SourceCapabilities | None = None,
    sink_caps: SinkCapabilities | None = None,
    delivery: Delivery | None = None,
    key: tuple[str, ...] = (),
) -> None:
    """The planner must refuse the pair with ``code`` (the honest branch).

    The subject's side is the capabilities of the connector built from the spec under test (never a
    lookup of an installed connector by name); the other side is :data:`ANY_SOURCE` /
    :data:`ANY_SINK`.
    """
    source = source_caps or ANY_SOURCE
    sink = sink_caps or ANY_SINK
    try:
        accepted = plan(source, sink, mode, policy, key, delivery=delivery)
    except PlanError as exc:
        if code not in exc.codes:
            raise ConformanceFailure(
                rule, f"the planner refused {mode} {policy} for {exc.codes}, not {code}"
            ) from exc
    else:
        raise ConformanceFailure(
            rule,
            f"the planner accepted {mode} {policy} ({accepted.delivery}) though the capabilities "
            f"deny it ({code})",
        )
