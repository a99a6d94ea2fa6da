"""FCP check 5, truthful capabilities, for each role: each capability claimed works, each one denied
is refused by the planner (planning the capabilities of the connector built from the spec under
test) or by the call itself.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from faucet_dagster.conformance.bounded.common import (
    ANY_SINK,
    CAPABILITY_RULE,
    expect_unsupported,
    planner_refuses,
    read_all,
)
from faucet_dagster.conformance.harness import (
    QUIET,
    STREAM,
    WORKER,
    StreamDriver,
    Subject,
    ids_of,
    pairs,
    quietly_close,
    rows_batch,
)
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.planner import Code, plan
from faucet_dagster.protocol import (
    AddColumn,
    CommitToken,
    Delivery,
    FaucetError,
    Mode,
    Ordering,
    PlanError,
    Replay,
    Role,
    SchemaError,
    Sink,
    Source,
    UnsupportedOperation,
    WritePolicy,
    default_codec_registry,
)


async def capabilities(subject: Subject) -> Outcome:
    """Every capability claimed true works; every one denied is refused (honest branch)."""
    check = {
        Role.SOURCE: _source_capabilities,
        Role.SINK: _sink_capabilities,
        Role.STREAM_SOURCE: _stream_source_capabilities,
        Role.STREAMING_SINK: _streaming_sink_capabilities,
    }[subject.role]
    proven = await check(subject)
    return Outcome.passed("; ".join(proven), exercised=tuple(proven))


async def _source_capabilities(subject: Subject) -> list[str]:
    size = subject.options.batch_size
    rows = make_rows(1, 2 * size + 5)
    await subject.source_setup.add_rows(rows)
    expected = [row["id"] for row in rows]
    source = subject.source()
    caps = source.capabilities()
    proven: list[str] = []
    if not caps.bounded:
        raise ConformanceFailure(CAPABILITY_RULE, "a bounded Source declares bounded=False")
    pages = await read_all(subject, source, size, CAPABILITY_RULE)
    read = [i for page in pages for i in ids_of(page.records)]
    if sorted(read) != expected:
        raise ConformanceFailure(
            CAPABILITY_RULE, f"a bounded read returned {len(read)} of {len(expected)} rows"
        )
    proven.append("bounded read ends")
    if caps.ordering is Ordering.STRICT_GLOBAL:
        if read != expected:
            raise ConformanceFailure(
                CAPABILITY_RULE,
                "ordering is strict_global but rows came in another order than they were added",
            )
        proven.append("strict global order")
    if caps.columns is not None:
        for page in pages:
            names = (
                page.records.schema.names
                if isinstance(page.records, pa.RecordBatch)
                else list(page.records[0])
            )
            missing = [column for column in caps.columns if column not in names]
            if missing:
                raise ConformanceFailure(
                    CAPABILITY_RULE, f"declared columns {missing} are not in the records"
                )
        proven.append(f"columns {list(caps.columns)}")
    if caps.deterministic:
        again = await read_all(subject, subject.source(), size, CAPABILITY_RULE)
        if [ids_of(page.records) for page in again] != [ids_of(page.records) for page in pages]:
            raise ConformanceFailure(
                CAPABILITY_RULE, "deterministic is True but a second read gave other pages or another order"
            )
        proven.append("deterministic re-read")
    else:
        await planner_refuses(
            subject,
            Mode.BOUNDED,
            WritePolicy.APPEND,
            Code.EFFECTIVELY_ONCE_UNREACHABLE,
            CAPABILITY_RULE,
            source_caps=caps,
            delivery=Delivery.EFFECTIVELY_ONCE,
        )
        proven.append("not deterministic: watermark delivery refused")
    if caps.discover:
        found = await subject.within(source.discover(), CAPABILITY_RULE, "discover")
        if not found:
            raise ConformanceFailure(CAPABILITY_RULE, "discover is True but discover() found no dataset")
        proven.append(f"discover found {len(found)}")
    else:
        await expect_unsupported(source.discover, "discover()")
    if caps.shardable:
        proven.append(await _shards(subject, source, expected))
    else:
        await expect_unsupported(source.enumerate_shards, "enumerate_shards()")
        await expect_unsupported(lambda: subject.source().apply_shard("any"), "apply_shard()")
    if not caps.continuous:
        await planner_refuses(
            subject,
            Mode.CONTINUOUS,
            WritePolicy.APPEND,
            Code.SOURCE_NOT_CONTINUOUS,
            CAPABILITY_RULE,
            source_caps=caps,
        )
        proven.append("not continuous: refused")
    return proven


async def _shards(subject: Subject, source: Source, expected: list[int]) -> str:
    shards = await subject.within(source.enumerate_shards(), CAPABILITY_RULE, "enumerate_shards")
    if not shards or len(set(shards)) != len(shards):
        raise ConformanceFailure(
            CAPABILITY_RULE, f"shardable is True but enumerate_shards() gave {list(shards)}"
        )
    seen: list[int] = []
    for shard in shards:
        part = subject.source()
        part.apply_shard(shard)
        seen.extend(
            i for page in await read_all(subject, part, 0, CAPABILITY_RULE) for i in ids_of(page.records)
        )
    if sorted(seen) != expected:
        raise ConformanceFailure(
            CAPABILITY_RULE,
            f"the {len(shards)} shards together returned {len(seen)} rows ({len(set(seen))} distinct), "
            f"the dataset has {len(expected)}: shards must partition it",
        )
    return f"{len(shards)} shards partition the dataset"


async def _sink_capabilities(subject: Subject) -> list[str]:
    setup = subject.sink_setup
    sink = subject.sink()
    caps = sink.capabilities()
    proven: list[str] = []
    try:
        policy, key = sink.write_mode()
        if (
            not sink.supported_write_modes() <= caps.bounded_policies
            or policy not in sink.supported_write_modes()
        ):
            raise ConformanceFailure(
                CAPABILITY_RULE,
                f"the configured mode {policy} is not among supported_write_modes() "
                f"{sorted(sink.supported_write_modes())} within the bounded policies",
            )
        rows = make_rows(1, 20)
        await subject.within(sink.write_batch(rows_batch(rows)), CAPABILITY_RULE, "write_batch")
        await subject.within(sink.flush(), CAPABILITY_RULE, "flush")
        await subject.within(sink.finish(), CAPABILITY_RULE, "finish")
        if pairs(await setup.read_back()) != pairs(rows):
            raise ConformanceFailure(
                CAPABILITY_RULE, f"a {policy} write of {len(rows)} rows did not land as written"
            )
        proven.append(f"{policy} writes")
        _dedups_as_configured(sink, policy, key)
        if setup.configure is not None:
            proven.append(await _dedups_follow_the_config(subject, setup.configure))
        if sink.supports_schema_evolution():
            change = [AddColumn("conformance_extra", pa.string())]
            for _ in range(2):  # ADD COLUMN IF NOT EXISTS: repeating it is harmless
                await subject.within(sink.evolve_schema(change), CAPABILITY_RULE, "evolve_schema")
            schema = await subject.within(sink.current_schema(), CAPABILITY_RULE, "current_schema")
            if schema is None or "conformance_extra" not in schema.names:
                raise ConformanceFailure(
                    CAPABILITY_RULE, "schema evolution is claimed but evolve_schema() did not add the column"
                )
            proven.append("schema evolution adds a column")
        else:
            try:
                await sink.evolve_schema([AddColumn("conformance_extra", pa.string())])
            except (SchemaError, UnsupportedOperation):
                proven.append("no schema evolution: refused")
            else:
                raise ConformanceFailure(
                    CAPABILITY_RULE, "schema evolution is denied but evolve_schema() returned"
                )
        if caps.partial_results and setup.refused_rows is not None:
            proven.append(await _partial(subject, sink, setup.refused_rows))
        unsupported = sorted(set(WritePolicy) - sink.supported_write_modes())
        if unsupported:
            await planner_refuses(
                subject,
                Mode.BOUNDED,
                unsupported[0],
                Code.POLICY_NOT_SUPPORTED,
                CAPABILITY_RULE,
                sink_caps=caps,
            )
            proven.append(f"{unsupported[0]} refused")
    finally:
        await subject.within(sink.close(), CAPABILITY_RULE, "Sink.close")
    if not sink.supports_idempotent_writes():
        try:
            await sink.write_batch_idempotent(rows_batch(make_rows(100, 1)), CommitToken(1))
        except FaucetError:
            proven.append("no watermark: idempotent write refused")
        else:
            raise ConformanceFailure(
                CAPABILITY_RULE, "idempotent writes are denied but write_batch_idempotent() wrote"
            )
        finally:
            await sink.close()
    return proven


_KEYED_POLICIES = (WritePolicy.UPSERT, WritePolicy.DELETE, WritePolicy.VERSIONED_UPSERT)


def _dedups_as_configured(sink: Sink, policy: WritePolicy, key: Sequence[str]) -> None:
    keyed = policy in _KEYED_POLICIES and bool(key)
    if sink.dedups_by_key() != keyed:
        raise ConformanceFailure(
            CAPABILITY_RULE,
            f"dedups_by_key() is {sink.dedups_by_key()} for mode {policy} with key {list(key)}: it must "
            "reflect the live config (an upsert or delete with a non-empty key)",
        )


async def _dedups_follow_the_config(
    subject: Subject, configure: Callable[[WritePolicy, tuple[str, ...]], Mapping[str, Any]]
) -> str:
    """dedups_by_key() of sinks built from configs that tell a mode from a key: append with a key,
    each keyed policy with and without one. A config the connector refuses (ConfigError) is fine."""
    keys: tuple[tuple[str, ...], ...] = (("id",), ())
    variants = [(WritePolicy.APPEND, keys[0]), *((policy, key) for policy in _KEYED_POLICIES for key in keys)]
    built: list[str] = []
    for policy, key in variants:
        try:
            sink = subject.sink(dict(configure(policy, key)))
        except FaucetError:
            continue  # the connector refuses this config: nothing to claim
        try:
            configured = sink.write_mode()
            if configured != (policy, key):
                raise ConformanceFailure(
                    CAPABILITY_RULE,
                    f"a sink configured for {policy} with key {list(key)} reports write_mode() {configured}",
                )
            _dedups_as_configured(sink, policy, key)
        finally:
            await subject.within(sink.close(), CAPABILITY_RULE, "Sink.close")
        built.append(f"{policy}{list(key)}")
    return f"dedups_by_key() follows the config ({', '.join(built)})"


async def _partial(subject: Subject, sink: Sink, rows: Sequence[Mapping[str, Any]]) -> str:
    before = pairs(await subject.sink_setup.read_back())
    result = await subject.within(
        sink.write_batch_partial(rows_batch(rows)), CAPABILITY_RULE, "write_batch_partial"
    )
    refused = {rows[rejected.index]["id"] for rejected in result.rejected}
    landed = [row for row in rows if row["id"] not in refused]
    after = pairs(await subject.sink_setup.read_back())
    if not refused or result.written != len(landed) or after != sorted([*before, *pairs(landed)]):
        raise ConformanceFailure(
            CAPABILITY_RULE,
            f"partial_results is claimed but write_batch_partial() reported {result.written} written and "
            f"{len(refused)} refused of {len(rows)}, and the destination does not hold exactly the rest",
        )
    return f"partial results refused {len(refused)} row(s)"


async def _stream_source_capabilities(subject: Subject) -> list[str]:
    source = subject.stream_source()
    caps = source.capabilities()
    proven: list[str] = []
    registry = default_codec_registry()
    for codec in source.codecs():
        if type(registry.get(codec.name)) is not type(codec):
            raise ConformanceFailure(
                CAPABILITY_RULE, f"codec {codec.name!r} is not the one registered under its name"
            )
    proven.append(f"codecs {[codec.name for codec in source.codecs()]} registered")
    rows = make_rows(1, 30)
    await subject.source_setup.add_rows(rows)
    driver = StreamDriver(subject, CAPABILITY_RULE)
    try:
        seen = await driver.read_until({row["id"] for row in rows}, QUIET)
        if sorted(seen) != [row["id"] for row in rows]:
            raise ConformanceFailure(
                CAPABILITY_RULE, f"the stream delivered {len(seen)} of {len(rows)} rows once each"
            )
        if caps.ordering is Ordering.STRICT_GLOBAL and seen != [row["id"] for row in rows]:
            raise ConformanceFailure(
                CAPABILITY_RULE, "ordering is strict_global but rows came in another order"
            )
        identities = [event[:3] for event in driver.events]
        if caps.event_identity and len(set(identities)) != len(identities):
            raise ConformanceFailure(CAPABILITY_RULE, "event_identity is True but two rows share an identity")
        kinds = {type(control).__name__ for control in driver.controls}
        if caps.transaction_boundaries and not {"TransactionBegin", "TransactionEnd"} <= kinds:
            raise ConformanceFailure(
                CAPABILITY_RULE, f"transaction_boundaries is True but the reads sent only {sorted(kinds)}"
            )
        if caps.bounded:
            assert driver.session is not None
            if not driver.session.exhausted:
                raise ConformanceFailure(
                    CAPABILITY_RULE, "bounded is True but the session never became exhausted"
                )
            proven.append("bounded session exhausted")
    finally:
        await driver.close()
    proven.append(f"{len(seen)} rows with {'stable ' if caps.event_identity else ''}identities")
    if not caps.bounded:
        try:
            plan(caps, ANY_SINK, Mode.BOUNDED, WritePolicy.APPEND)
        except PlanError as exc:
            if Code.SOURCE_NOT_BOUNDED not in exc.codes:
                raise ConformanceFailure(
                    CAPABILITY_RULE, f"bounded mode was refused for {exc.codes}"
                ) from exc
        else:
            raise ConformanceFailure(
                CAPABILITY_RULE, "the planner accepted a bounded read of a non-bounded source"
            )
        proven.append("not bounded: refused")
    if caps.ordering is not Ordering.STRICT_GLOBAL:
        await planner_refuses(
            subject,
            Mode.CONTINUOUS,
            WritePolicy.UPSERT,
            Code.ORDER_DEPENDENT_POLICY,
            CAPABILITY_RULE,
            source_caps=caps,
            key=("id",),
        )
        proven.append(f"{caps.ordering} order: order-dependent upsert refused")
    if caps.replay is not Replay.REPLAYABLE_AT_LEAST_ONCE or not caps.continuous:
        code = Code.SOURCE_NOT_CONTINUOUS if not caps.continuous else Code.SOURCE_NOT_REPLAYABLE
        await planner_refuses(
            subject, Mode.CONTINUOUS, WritePolicy.APPEND, code, CAPABILITY_RULE, source_caps=caps
        )
        proven.append(f"{code} refused")
    return proven


async def _streaming_sink_capabilities(subject: Subject) -> list[str]:
    """The honest branches: every continuous policy the sink does not declare is refused by the
    planner and by ``open``; without a watermark or deduplication, effectively-once is refused. What
    the declared policies, the watermark, the receipts and owner fencing do is the scenarios' work."""
    caps = subject.streaming_sink().capabilities()
    proven: list[str] = []
    for policy in sorted(set(WritePolicy) - caps.continuous_policies):
        await planner_refuses(
            subject,
            Mode.CONTINUOUS,
            policy,
            Code.POLICY_NOT_SUPPORTED,
            CAPABILITY_RULE,
            sink_caps=caps,
            key=("id",),
        )
        try:
            refused = await subject.streaming_sink().open(STREAM, policy, ("id",), WORKER)
        except FaucetError:
            continue
        await quietly_close(refused)
        raise ConformanceFailure(
            CAPABILITY_RULE, f"{policy} is not a continuous policy but open() accepted it"
        )
    proven.append("undeclared policies refused")
    if not caps.atomic_watermark and not caps.dedup_by_event_identity:
        await planner_refuses(
            subject,
            Mode.CONTINUOUS,
            WritePolicy.APPEND,
            Code.EFFECTIVELY_ONCE_UNREACHABLE,
            CAPABILITY_RULE,
            sink_caps=caps,
            delivery=Delivery.EFFECTIVELY_ONCE,
        )
        proven.append("no mechanism: effectively-once refused")
    return proven
