"""The epoch pipeline: Arrow conversion, bad rows, integrity, controls and the completion rule."""

import asyncio
import datetime as dt
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pytest
from stream_doubles import MemoryDestination, MemorySinkSession, SinkFaults, domain

from faucet_dagster.pipeline import (
    BadRowPolicy,
    EpochPipeline,
    Pipeline,
    PipelineOptions,
    ResourceSchema,
    check_batch,
)
from faucet_dagster.protocol import (
    ConfigError,
    ConnectionFailed,
    Coverage,
    DataError,
    DomainCoverage,
    EpochId,
    EventIdentity,
    Identities,
    IncarnationChanged,
    IntegrityError,
    LifecycleError,
    Position,
    ProgressBoundary,
    RejectedRecord,
    SinkBatch,
    TransactionBegin,
    TransactionEnd,
)
from faucet_dagster.runner.continuous import StoreDeadLetterRoute
from faucet_dagster.state import StateStore

T = TypeVar("T")
EPOCH = EpochId("s", 1, 1)
DOMAIN = domain()
SCHEMA = ResourceSchema.from_columns({"id": "int64", "name": "string"}, key=["id"])


def run(factory: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await factory()

    return asyncio.run(main())


def rows(first: int, last: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"id": i, "name": f"row-{i}", **extra} for i in range(first, last + 1)]


def ids(first: int, last: int) -> Identities:
    return Identities([str(i) for i in range(first, last + 1)])


def coverage(end: int, start: int | None = None) -> Coverage:
    return Coverage((DomainCoverage(DOMAIN, None if start is None else str(start), str(end)),))


def begin(
    pipeline: Pipeline, faults: SinkFaults | None = None, starts: tuple[Position, ...] = ()
) -> tuple[EpochPipeline, MemorySinkSession]:
    session = MemorySinkSession(MemoryDestination(), faults or SinkFaults())
    session.active = EPOCH
    return pipeline.begin(EPOCH, session, starts), session


def applied_rows(session: MemorySinkSession) -> list[dict[str, Any]]:
    return [row for batch in session.pending for row in batch.records.to_pylist()]


def test_rows_become_checked_batches_and_the_seal_vouches_for_the_coverage() -> None:
    async def scenario() -> None:
        epoch, session = begin(Pipeline({"items": SCHEMA}, options=PipelineOptions(batch_rows=40)))
        await epoch.write(DOMAIN, rows(1, 50), ids(1, 50))
        await epoch.write(DOMAIN, rows(51, 100), ids(51, 100))
        await epoch.control(ProgressBoundary(DOMAIN, "100"))
        sealed = await epoch.seal(coverage(100))
        assert sealed.row_counts == {"items": 100}
        assert sealed.dead_lettered == {}
        assert [row["id"] for row in applied_rows(session)] == list(range(1, 101))
        assert all(batch.records.schema.equals(SCHEMA.schema) for batch in session.pending)
        assert [p for batch in session.pending for p in batch.identities.positions] == [
            str(i) for i in range(1, 101)
        ]
        assert sealed.digest.startswith("blake2b-256:")

    run(scenario)


def test_the_digest_covers_the_encoded_rows() -> None:
    async def digest(data: list[dict[str, Any]]) -> str:
        epoch, _ = begin(Pipeline({"items": SCHEMA}))
        await epoch.write(DOMAIN, data, ids(1, len(data)))
        await epoch.control(ProgressBoundary(DOMAIN, str(len(data))))
        return (await epoch.seal(coverage(len(data)))).digest

    same = run(lambda: digest(rows(1, 10)))
    assert run(lambda: digest(rows(1, 10))) == same
    changed = rows(1, 10)
    changed[3]["name"] = "changed"
    assert run(lambda: digest(changed)) != same


def test_an_inferred_schema_is_kept_and_a_row_that_does_not_fit_halts() -> None:
    async def scenario() -> None:
        pipeline = Pipeline()
        epoch, session = begin(pipeline)
        await epoch.write(DOMAIN, rows(1, 3), ids(1, 3))
        await epoch.control(ProgressBoundary(DOMAIN, "3"))
        assert pipeline.converter("items").schema == pa.schema([("id", pa.int64()), ("name", pa.string())])
        await epoch.write(DOMAIN, [{"id": 4, "name": "ok"}, {"id": "five", "name": "bad"}], ids(4, 5))
        with pytest.raises(DataError) as raised:
            await epoch.control(ProgressBoundary(DOMAIN, "5"))
        assert "memory/items/0/inc-1@5#0" in str(raised.value.where)
        assert len(applied_rows(session)) == 3  # the failing batch was not applied

    run(scenario)


def test_bad_rows_go_to_the_dead_letter_route_with_their_identity(tmp_path: Path) -> None:
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    spec = ResourceSchema.from_columns(
        {"id": "int64", "name": "string"}, key=["id"], on_bad_row="dead_letter"
    )
    pipeline = Pipeline({"items": spec}, dead_letters=StoreDeadLetterRoute(store, "s"))

    async def scenario() -> None:
        epoch, session = begin(pipeline)
        data = rows(1, 6)
        data[1]["id"] = "not a number"  # position 2: wrong type
        data[3]["color"] = "red"  # position 4: a field outside the schema
        data[4]["id"] = None  # position 5: a null key
        await epoch.write(DOMAIN, data, ids(1, 6))
        await epoch.control(ProgressBoundary(DOMAIN, "6"))
        sealed = await epoch.seal(coverage(6))
        assert sealed.row_counts == {"items": 3}
        assert sealed.dead_lettered == {"items": 3}
        assert [row["id"] for row in applied_rows(session)] == [1, 3, 6]
        assert [p for batch in session.pending for p in batch.identities.positions] == ["1", "3", "6"]

    run(scenario)
    letters = store.dead_letters("s")
    assert sorted(letter["event"] for letter in letters) == [f"memory/items/0/inc-1@{p}#0" for p in (2, 4, 5)]
    reasons = {letter["event"][-3]: letter["reason"] for letter in letters}
    assert "color" in reasons["4"] and "null" in reasons["5"]
    # A replayed epoch routes the same rows again and stores nothing twice.
    run(scenario)
    assert len(store.dead_letters("s")) == 3


def test_a_dead_letter_holds_its_row_as_json_any_reader_decodes(tmp_path: Path) -> None:
    """Bytes as \\x hex and a NaN as its name: Python's ``str`` wrote ``b'...'`` and json wrote a
    ``NaN`` token, which is not JSON."""
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    spec = ResourceSchema.from_columns({"id": "int64", "name": "string"}, on_bad_row="dead_letter")
    pipeline = Pipeline({"items": spec}, dead_letters=StoreDeadLetterRoute(store, "s"))
    bad = {
        "id": 2,
        "name": "two",
        "blob": b"\x00\xff",
        "score": float("nan"),
        "at": dt.date(2024, 2, 29),
        "tags": {b"\xfe": 1, 2: "two"},
    }

    async def scenario() -> None:
        epoch, _ = begin(pipeline)
        await epoch.write(DOMAIN, [{"id": 1, "name": "one"}, bad], ids(1, 2))
        await epoch.control(ProgressBoundary(DOMAIN, "2"))
        assert (await epoch.seal(coverage(2))).dead_lettered == {"items": 1}

    run(scenario)
    (letter,) = store.dead_letters("s")

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    assert json.loads(letter["payload"], parse_constant=no_constants) == {
        "id": 2,
        "name": "two",
        "blob": "\\x00ff",
        "score": "NaN",
        "at": "2024-02-29",
        "tags": {"\\xfe": 1, "2": "two"},
    }


def test_a_dead_letter_policy_without_a_route_is_refused() -> None:
    with pytest.raises(ConfigError):
        Pipeline({"items": ResourceSchema(on_bad_row=BadRowPolicy.DEAD_LETTER)})


def test_arrow_batches_are_cast_and_batches_of_other_columns_do_not_fit() -> None:
    async def scenario() -> None:
        epoch, session = begin(Pipeline({"items": SCHEMA}))
        batch = pa.RecordBatch.from_pydict({"name": ["a", "b"], "id": pa.array([1, 2], pa.int32())})
        await epoch.write(DOMAIN, batch, ids(1, 2))
        await epoch.control(ProgressBoundary(DOMAIN, "2"))
        assert applied_rows(session) == [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]
        await epoch.write(DOMAIN, pa.RecordBatch.from_pydict({"other": [1]}), ids(3, 3))
        with pytest.raises(DataError, match="other are not in the schema"):
            await epoch.control(ProgressBoundary(DOMAIN, "3"))

    run(scenario)


def test_coverage_past_the_last_accepted_boundary_is_refused() -> None:
    async def scenario() -> None:
        epoch, _ = begin(Pipeline({"items": SCHEMA}))
        await epoch.write(DOMAIN, rows(1, 10), ids(1, 10))
        await epoch.control(ProgressBoundary(DOMAIN, "10"))
        with pytest.raises(IntegrityError, match="past the last accepted boundary"):
            await epoch.seal(coverage(12))

    run(scenario)


def test_coverage_short_of_the_rows_written_is_refused() -> None:
    async def scenario() -> None:
        epoch, _ = begin(Pipeline({"items": SCHEMA}))
        await epoch.write(DOMAIN, rows(1, 5), ids(1, 5))
        await epoch.control(ProgressBoundary(DOMAIN, "5"))
        await epoch.write(DOMAIN, rows(6, 10), ids(6, 10))
        await epoch.control(ProgressBoundary(DOMAIN, "10"))
        with pytest.raises(IntegrityError, match="before the last accepted boundary"):
            await epoch.seal(coverage(5))

    run(scenario)


def test_coverage_without_any_evidence_and_uncovered_rows_are_refused() -> None:
    async def scenario() -> None:
        epoch, _ = begin(Pipeline({"items": SCHEMA}))
        with pytest.raises(IntegrityError, match="accepted no boundary"):
            await epoch.seal(coverage(3))
        epoch, _ = begin(Pipeline({"items": SCHEMA}))
        await epoch.write(DOMAIN, rows(1, 2), ids(1, 2))
        await epoch.control(ProgressBoundary(DOMAIN, "2"))
        with pytest.raises(IntegrityError, match="not in the coverage"):
            await epoch.seal(Coverage())

    run(scenario)


def test_rows_after_the_last_boundary_block_the_seal() -> None:
    async def scenario() -> None:
        epoch, _ = begin(Pipeline({"items": SCHEMA}))
        await epoch.write(DOMAIN, rows(1, 5), ids(1, 5))
        await epoch.control(ProgressBoundary(DOMAIN, "5"))
        await epoch.write(DOMAIN, rows(6, 7), ids(6, 7))
        with pytest.raises(IntegrityError, match="rows follow the last accepted boundary"):
            await epoch.seal(coverage(5))

    run(scenario)


def test_rows_at_or_behind_an_accepted_boundary_are_refused() -> None:
    async def scenario() -> None:
        epoch, _ = begin(Pipeline({"items": SCHEMA}))
        await epoch.control(ProgressBoundary(DOMAIN, "10"))
        for behind in (5, 10):
            with pytest.raises(IntegrityError, match="at or before the accepted boundary 10"):
                await epoch.write(DOMAIN, rows(behind, behind), ids(behind, behind))
        await epoch.write(DOMAIN, rows(11, 12), ids(11, 12))
        await epoch.control(ProgressBoundary(DOMAIN, "12"))
        sealed = await epoch.seal(coverage(12))
        assert sealed.row_counts == {"items": 2}

    run(scenario)


def test_an_open_transaction_blocks_the_seal_and_controls_must_pair() -> None:
    async def scenario() -> None:
        epoch, _ = begin(Pipeline({"items": SCHEMA}))
        await epoch.control(TransactionBegin(DOMAIN, "t1"))
        await epoch.write(DOMAIN, rows(1, 3), ids(1, 3))
        await epoch.control(TransactionEnd(DOMAIN, "t1", "3"))
        await epoch.control(TransactionBegin(DOMAIN, "t2"))
        await epoch.write(DOMAIN, rows(4, 4), ids(4, 4))
        with pytest.raises(IntegrityError, match="inside open transaction"):
            await epoch.control(ProgressBoundary(DOMAIN, "4"))
        with pytest.raises(IntegrityError, match="the open one is t2"):
            await epoch.control(TransactionEnd(DOMAIN, "t9", "4"))
        with pytest.raises(IntegrityError, match="still open"):
            await epoch.seal(coverage(3))

    run(scenario)


def test_positions_only_move_forward_from_the_certified_start() -> None:
    start = (Position(DOMAIN, "10"),)

    async def scenario() -> None:
        epoch, _ = begin(Pipeline({"items": SCHEMA}), starts=start)
        with pytest.raises(IntegrityError, match="at or before the certified position"):
            await epoch.write(DOMAIN, rows(10, 11), ids(10, 11))
        epoch, _ = begin(Pipeline({"items": SCHEMA}), starts=start)
        await epoch.write(DOMAIN, rows(11, 15), ids(11, 15))
        with pytest.raises(IntegrityError, match="went back"):
            await epoch.write(DOMAIN, rows(12, 12), ids(12, 12))
        with pytest.raises(IntegrityError, match="before the last row"):
            await epoch.control(ProgressBoundary(DOMAIN, "14"))
        await epoch.control(ProgressBoundary(DOMAIN, "15"))
        with pytest.raises(IntegrityError, match="certified position is 10"):
            await epoch.seal(coverage(15, start=None))
        sealed = await epoch.seal(coverage(15, start=10))
        assert sealed.row_counts == {"items": 5}
        with pytest.raises(LifecycleError):
            await epoch.write(DOMAIN, rows(16, 16), ids(16, 16))

    run(scenario)


def test_inside_a_transaction_resources_may_interleave_but_never_go_before_it() -> None:
    """A group of source transactions: each resource's rows in order, the resources in any order."""

    async def scenario() -> None:
        epoch, session = begin(Pipeline({"items": SCHEMA, "other": SCHEMA}))
        await epoch.write(DOMAIN, rows(1, 2), ids(1, 2))
        await epoch.control(ProgressBoundary(DOMAIN, "2"))
        await epoch.control(TransactionBegin(DOMAIN, "group"))
        await epoch.write(DOMAIN, rows(3, 3) + rows(5, 5), Identities(["3", "5"]), resource="items")
        await epoch.write(DOMAIN, rows(4, 4), ids(4, 4), resource="other")
        with pytest.raises(IntegrityError, match="went back"):
            await epoch.write(DOMAIN, rows(1, 1), ids(1, 1), resource="other")
        with pytest.raises(IntegrityError, match="before the last row"):
            await epoch.control(TransactionEnd(DOMAIN, "group", "4"))
        await epoch.control(TransactionEnd(DOMAIN, "group", "5"))
        sealed = await epoch.seal(coverage(5))
        assert sealed.row_counts == {"items": 4, "other": 1}
        assert len(applied_rows(session)) == 5

    run(scenario)


def test_an_inferred_arrow_schema_follows_the_source_one_batch_per_schema() -> None:
    """A column added at the source: the inferred schema follows it, and rows read under each schema
    reach the sink in batches of their own, in order (the sink decides what the change means)."""

    async def scenario() -> None:
        pipeline = Pipeline()
        epoch, session = begin(pipeline)
        old = pa.RecordBatch.from_pydict({"id": pa.array([1, 2], pa.int64())})
        new = pa.RecordBatch.from_pydict(
            {"id": pa.array([3], pa.int64()), "priority": pa.array([7], pa.int32())}
        )
        await epoch.control(TransactionBegin(DOMAIN, "t"))
        await epoch.write(DOMAIN, old, ids(1, 2))
        await epoch.write(DOMAIN, new, ids(3, 3))
        await epoch.control(TransactionEnd(DOMAIN, "t", "3"))
        assert [batch.records.schema.names for batch in session.pending] == [["id"], ["id", "priority"]]
        assert pipeline.converter("items").schema == pa.schema([("id", pa.int64()), ("priority", pa.int32())])

    run(scenario)


def test_a_domain_of_another_incarnation_than_the_certified_start_is_refused() -> None:
    async def scenario() -> None:
        epoch, _ = begin(Pipeline({"items": SCHEMA}), starts=(Position(domain("inc-0"), "10"),))
        with pytest.raises(IncarnationChanged):
            await epoch.write(DOMAIN, rows(1, 1), ids(1, 1))

    run(scenario)


def test_a_control_waits_for_every_preceding_sink_write() -> None:
    async def scenario() -> None:
        faults = SinkFaults(apply_delay=0.05)
        epoch, session = begin(Pipeline({"items": SCHEMA}, options=PipelineOptions(batch_rows=10)), faults)
        started = time.perf_counter()
        await epoch.write(DOMAIN, rows(1, 30), ids(1, 30))  # fills three builders' worth
        await epoch.write(DOMAIN, rows(31, 35), ids(31, 35))
        assert len(session.pending) < 4  # the last batch is not even converted yet
        await epoch.control(ProgressBoundary(DOMAIN, "35"))
        assert len(applied_rows(session)) == 35
        assert time.perf_counter() - started >= 0.05 * 2

    run(scenario)


def test_a_failed_sink_write_surfaces_at_the_next_control() -> None:
    async def scenario() -> None:
        faults = SinkFaults(apply_error=ConnectionFailed("destination went away", where="memory"))
        epoch, _ = begin(Pipeline({"items": SCHEMA}, options=PipelineOptions(batch_rows=5)), faults)
        await epoch.write(DOMAIN, rows(1, 5), ids(1, 5))  # flushed, applied in the background
        with pytest.raises(ConnectionFailed, match="went away"):
            await epoch.control(ProgressBoundary(DOMAIN, "5"))

    run(scenario)


def test_a_rejected_record_is_routed_and_counts_as_read(tmp_path: Path) -> None:
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    record = RejectedRecord(EventIdentity(DOMAIN, "2"), "not JSON", b"\xff", "memory items 2", "items")

    async def scenario() -> None:
        epoch, _ = begin(Pipeline({"items": SCHEMA}, dead_letters=StoreDeadLetterRoute(store, "s")))
        await epoch.write(DOMAIN, rows(1, 1), ids(1, 1))
        await epoch.reject(record)
        await epoch.control(ProgressBoundary(DOMAIN, "2"))
        sealed = await epoch.seal(coverage(2))
        assert sealed.row_counts == {"items": 1} and sealed.dead_lettered == {"items": 1}
        without_route, _ = begin(Pipeline({"items": SCHEMA}))
        with pytest.raises(DataError, match="no dead-letter route"):
            await without_route.reject(record)

    run(scenario)
    [letter] = store.dead_letters("s")
    assert letter["payload"] == b"\xff" and letter["origin"] == "memory items 2"


def test_check_batch_refuses_batches_that_break_their_promises() -> None:
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False)])
    good = pa.RecordBatch.from_pydict({"id": [1, 2]}, schema=schema)
    check_batch(SinkBatch(EPOCH, "items", DOMAIN, good, ids(1, 2)), schema, frozenset({"id"}))
    with pytest.raises(IntegrityError, match="identities"):
        check_batch(SinkBatch(EPOCH, "items", DOMAIN, good, ids(1, 3)), schema, frozenset({"id"}))
    nulls = pa.RecordBatch.from_pydict({"id": [1, None]})
    with pytest.raises(IntegrityError, match="hold nulls"):
        check_batch(SinkBatch(EPOCH, "items", DOMAIN, nulls, ids(1, 2)), nulls.schema, frozenset({"id"}))
    with pytest.raises(IntegrityError, match="schema"):
        check_batch(SinkBatch(EPOCH, "items", DOMAIN, nulls, ids(1, 2)), schema, frozenset())
