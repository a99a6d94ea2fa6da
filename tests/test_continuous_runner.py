"""The continuous runner's commit order and its failure paths, with faults injected at exact points.

The source and sink are the in-memory doubles of ``stream_doubles``; the state store is real (SQLite).
End-to-end delivery against NATS and PostgreSQL is in ``test_stream_nats_postgres.py``.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from stream_doubles import MemoryDestination, MemoryLog, MemorySink, MemorySource, SinkFaults, SourceFaults

from faucet_dagster.cli.main import main
from faucet_dagster.pipeline import ResourceSchema
from faucet_dagster.protocol import (
    ConnectionFailed,
    DataError,
    EpochId,
    IncarnationChanged,
    IntegrityError,
    OwnershipLost,
    PlanError,
    ReadLimits,
    StreamingSinkSession,
    UncertainOutcome,
)
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.runner.loop import BackgroundLoop
from faucet_dagster.state import StateStore

T = TypeVar("T")
LIMITS = ReadLimits(records=100, idle=0.05)


def run(factory: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await factory()

    return asyncio.run(main())


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    return StateStore(f"sqlite:///{tmp_path / 'state.db'}")


def runner(
    store: StateStore,
    source: MemorySource,
    sink: MemorySink,
    *,
    lease_seconds: float = 30.0,
    worker: str = "w1",
    schemas: dict[str, ResourceSchema] | None = None,
) -> StreamRunner:
    spec = StreamSpec(
        name="s",
        source=source,
        sink=sink,
        resources=("items",),
        limits=LIMITS,
        lease_seconds=lease_seconds,
        schemas=schemas or {},
    )
    return StreamRunner(spec, store, worker_id=worker)


def ids_of(destination: MemoryDestination) -> list[int]:
    return [row["id"] for row in destination.rows]


def test_epochs_commit_certify_then_acknowledge_contiguously(store: StateStore) -> None:
    log = MemoryLog()
    log.append(250)
    source, sink = MemorySource(log), MemorySink()
    stream = runner(store, source, sink)

    async def scenario() -> None:
        certificates = await stream.run_epochs(budget_seconds=10)
        assert [c.sequence for c in certificates] == [1, 2, 3]
        assert [c.row_counts for c in certificates] == [{"items": 100}, {"items": 100}, {"items": 50}]
        log.append(20)
        assert (await stream.run_epoch()) is not None
        assert await stream.run_epoch() is None  # nothing new: nothing certified
        await stream.close()

    run(scenario)
    assert ids_of(sink.destination) == list(range(1, 271))
    stored = store.certificates("s")
    assert [(c.coverage[0].start, c.coverage[0].end) for c in stored] == [
        (None, "100"),
        ("100", "200"),
        ("200", "250"),
        ("250", "270"),
    ]
    assert log.acknowledgements == [100, 200, 250, 270]
    assert all(c.fencing_token == 1 and c.worker == "w1" for c in stored)
    assert sink.destination.calls[:4] == ["begin 1", "apply 1 100", "commit 1", "begin 2"]
    assert store.status("s")[0].owner is None  # close gave the lease up


def test_coverage_past_the_last_boundary_is_refused_and_nothing_is_certified(store: StateStore) -> None:
    log = MemoryLog()
    log.append(10)
    source = MemorySource(log, SourceFaults(coverage_past_boundary=3))
    sink = MemorySink()
    stream = runner(store, source, sink)
    with pytest.raises(IntegrityError, match="past the last accepted boundary"):
        run(stream.run_epoch)
    assert sink.destination.calls[-1] == "abort 1" and not sink.destination.rows
    assert store.certificates("s") == [] and log.acknowledgements == []
    assert source.sessions[0].closed  # rewound: the next epoch reopens at the certified positions


def test_a_failed_commit_aborts_and_the_next_epoch_resumes_from_the_certified_positions(
    store: StateStore,
) -> None:
    log = MemoryLog()
    log.append(150)
    faults = SinkFaults()
    source, sink = MemorySource(log), MemorySink(faults=faults)
    stream = runner(store, source, sink)

    async def scenario() -> None:
        assert await stream.run_epoch() is not None
        faults.commit_error = ConnectionFailed("connection reset during COPY", where="memory")
        with pytest.raises(ConnectionFailed):
            await stream.run_epoch()
        faults.commit_error = None
        assert (await stream.run_epoch()) is not None

    run(scenario)
    assert "abort 2" in sink.destination.calls
    assert ids_of(sink.destination) == list(range(1, 151))
    assert [str(p[0].value) for p in source.opened_at[1:]] == ["100"]
    assert log.acknowledgements == [100, 150]


class SinkThatFailsToOpen(MemorySink):
    """A sink whose next ``open`` fails (the destination is unreachable), after the source was opened."""

    def __init__(self, source: MemorySource) -> None:
        super().__init__()
        self.source = source
        self.fail = True

    async def open(self, *args: Any, **kwargs: Any) -> StreamingSinkSession:
        if self.fail:
            self.fail = False
            # The source is opened beside the sink; fail once it has its session.
            while not self.source.sessions:
                await asyncio.sleep(0.01)
            raise ConnectionFailed("connection refused", where="memory")
        return await super().open(*args, **kwargs)


def test_a_source_opened_beside_a_sink_that_fails_to_open_is_closed_and_opened_again(
    store: StateStore,
) -> None:
    log = MemoryLog()
    log.append(50)
    source = MemorySource(log)
    sink = SinkThatFailsToOpen(source)
    stream = runner(store, source, sink)

    async def scenario() -> None:
        with pytest.raises(ConnectionFailed):
            await stream.run_epoch()
        assert await stream.run_epoch() is not None

    run(scenario)
    # The session opened beside the failed sink was closed, not leaked; the next epoch opened another.
    assert len(source.sessions) == 2 and source.sessions[0].closed and not source.sessions[1].closed
    assert ids_of(sink.destination) == list(range(1, 51))
    assert log.acknowledgements == [50]


def test_cancellation_during_a_read_certifies_nothing_and_the_next_epoch_loses_nothing(
    store: StateStore,
) -> None:
    log = MemoryLog()
    log.append(100)
    faults = SourceFaults(transaction_size=40, block_after_rows=50)
    source, sink = MemorySource(log, faults, chunk=10), MemorySink()
    stream = runner(store, source, sink)

    async def scenario() -> None:
        assert (await stream.run_epoch(ReadLimits(records=40))) is not None  # the first transaction
        task = asyncio.create_task(stream.run_epoch())
        # The read applies the transaction 41..80, then blocks inside the next one (at row 90).
        while "apply 2 40" not in sink.destination.calls:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        stream.cancel()
        assert await task is None
        assert store.last_certificate("s") is not None and len(store.certificates("s")) == 1
        assert log.acknowledgements == [40]
        faults.block_after_rows = None
        certificates = await stream.run_epochs(5)
        assert [(c.coverage[0].start, c.coverage[0].end) for c in certificates] == [("40", "100")]

    run(scenario)
    assert "abort 2" in sink.destination.calls
    assert ids_of(sink.destination) == list(range(1, 101))
    assert log.acknowledgements == [40, 100]


def test_ownership_lost_before_the_acknowledgement_refuses_it(store: StateStore) -> None:
    log = MemoryLog()
    log.append(30)
    faults = SourceFaults()
    source, sink = MemorySource(log, faults), MemorySink()
    old = runner(store, source, sink, worker="old")

    async def take_over() -> None:
        store.release("s")  # an operator frees the stream; another worker takes it at once
        store.acquire_lease("s", "new", 30)

    faults.before_acknowledge = take_over
    with pytest.raises(OwnershipLost, match="leased to new"):
        run(old.run_epoch)
    assert log.acknowledgements == []  # the acknowledgement was refused
    assert [c.worker for c in store.certificates("s")] == ["old"]  # the commit was certified first
    faults.before_acknowledge = None
    log.append(10)
    new = runner(store, MemorySource(log), sink, worker="new")
    certificate = run(new.run_epoch)
    assert certificate is not None and certificate.fencing_token == 2
    assert certificate.coverage[0].start == "30" and log.acknowledgements == [40]
    assert ids_of(sink.destination) == list(range(1, 41))


def test_a_crash_between_commit_and_certificate_is_recovered_without_duplicates(store: StateStore) -> None:
    log = MemoryLog()
    log.append(60)
    destination = MemoryDestination()
    crashing = MemorySink(
        destination, SinkFaults(commit_then_error=UncertainOutcome("COMMIT sent, no reply"))
    )
    stream = runner(store, MemorySource(log), crashing, lease_seconds=0.3, worker="crashed")
    with pytest.raises(UncertainOutcome):
        run(lambda: stream.run_epoch(ReadLimits(records=50)))
    assert ids_of(destination) == list(range(1, 51)) and store.certificates("s") == []
    assert destination.last_epoch == EpochId("s", 1, 1)
    assert log.acknowledgements == []

    run(lambda: asyncio.sleep(0.4))  # the crashed worker's lease expires
    source = MemorySource(log)
    recovering = runner(store, source, MemorySink(destination), worker="next")
    certificate = run(lambda: recovering.run_epoch(ReadLimits(records=20)))
    assert certificate is not None and certificate.sequence == 1
    # The recovery read on to the destination's watermark (50) although the target was 20 records.
    assert certificate.coverage[0].end == "60"
    assert certificate.receipts[0].rows_skipped == 50 and certificate.receipts[0].rows_written == 10
    assert ids_of(destination) == list(range(1, 61))
    assert log.acknowledgements == [60]


def test_an_uncertain_close_blocks_takeover_until_released(store: StateStore, tmp_path: Path) -> None:
    log = MemoryLog()
    log.append(5)
    sink = MemorySink(faults=SinkFaults(close_error=UncertainOutcome("a COPY may still land")))
    stream = runner(store, MemorySource(log), sink)

    async def first() -> None:
        assert await stream.run_epoch() is not None
        await stream.close()

    with pytest.raises(UncertainOutcome, match="may still land"):
        run(first)
    assert store.status("s")[0].uncertain
    log.append(5)
    other = runner(store, MemorySource(log), MemorySink(sink.destination), worker="w2")
    with pytest.raises(UncertainOutcome, match="faucet streams release s"):
        run(other.run_epoch)
    assert main(["streams", "release", "s", "--state-url", f"sqlite:///{tmp_path / 'state.db'}"]) == 0
    assert run(other.run_epoch) is not None
    assert ids_of(sink.destination) == list(range(1, 11))


def test_a_recreated_source_is_refused_before_anything_is_written(store: StateStore) -> None:
    log = MemoryLog()
    log.append(5)
    sink = MemorySink()
    first = runner(store, MemorySource(log), sink)
    assert run(first.run_epoch) is not None
    run(first.close)
    log.incarnation = "inc-2"
    log.append(5)
    with pytest.raises(IncarnationChanged):
        run(runner(store, MemorySource(log), sink, worker="w2", lease_seconds=30).run_epoch)
    assert ids_of(sink.destination) == list(range(1, 6)) and len(store.certificates("s")) == 1


def test_the_sink_and_the_certificates_must_agree(store: StateStore) -> None:
    log = MemoryLog()
    log.append(5)
    destination = MemoryDestination()
    assert run(runner(store, MemorySource(log), MemorySink(destination)).run_epoch) is not None
    destination.last_epoch = EpochId("s", 3, 1)  # the destination claims epochs no certificate knows
    with pytest.raises(IntegrityError, match="lost or restored"):
        run(runner(store, MemorySource(log), MemorySink(destination), worker="w1").run_epoch)
    destination.last_epoch = EpochId("s", 1, 1)
    destination.watermarks = {key: 4 for key in destination.watermarks}
    with pytest.raises(IntegrityError, match="differs from the certified position"):
        run(runner(store, MemorySource(log), MemorySink(destination), worker="w1").run_epoch)


def test_a_row_that_does_not_fit_halts_the_stream_or_is_dead_lettered(store: StateStore) -> None:
    log = MemoryLog()
    log.append(3)
    log.rows.append({"id": "four", "name": "bad"})
    sink = MemorySink()
    declared = {"items": ResourceSchema.from_columns({"id": "int64", "name": "string"})}
    with pytest.raises(DataError, match="does not fit"):
        run(runner(store, MemorySource(log), sink, schemas=declared).run_epoch)
    assert not sink.destination.rows and store.certificates("s") == [] and log.acknowledgements == []
    routed = {
        "items": ResourceSchema.from_columns({"id": "int64", "name": "string"}, on_bad_row="dead_letter")
    }
    stream = runner(store, MemorySource(log), sink, schemas=routed)
    certificate = run(stream.run_epoch)
    assert certificate is not None and certificate.dead_lettered == {"items": 1}
    assert certificate.row_counts == {"items": 3} and ids_of(sink.destination) == [1, 2, 3]
    assert [letter["event"] for letter in store.dead_letters("s")] == ["memory/items/0/inc-1@4#0"]
    assert stream.plan.delivery.value == "at_least_once"  # a dead-letter route rules the watermark out


def test_a_pair_the_planner_refuses_never_runs(store: StateStore) -> None:
    from faucet_dagster.protocol import WritePolicy

    spec = StreamSpec("s", MemorySource(MemoryLog()), MemorySink(), ("items",), policy=WritePolicy.UPSERT)
    with pytest.raises(PlanError):
        StreamRunner(spec, store)


def test_the_lease_is_renewed_in_the_background_between_epochs(store: StateStore) -> None:
    log = MemoryLog()
    log.append(10)
    stream = runner(store, MemorySource(log), MemorySink(), lease_seconds=0.6)

    async def scenario() -> None:
        assert await stream.run_epoch() is not None
        await asyncio.sleep(1.5)  # two and a half leases without an epoch: the keeper renews
        with pytest.raises(OwnershipLost, match="leased to w1"):
            store.acquire_lease("s", "other", 30)
        await stream.close()
        assert store.status("s")[0].owner is None

    run(scenario)


def test_a_newer_worker_takes_the_stream_over_from_a_live_holder_in_seconds(store: StateStore) -> None:
    log = MemoryLog()
    log.append(30)
    destination = MemoryDestination()
    old_source = MemorySource(log)
    old = runner(store, old_source, MemorySink(destination), worker="old")
    loop = BackgroundLoop("old-worker")  # the old process: its keeper runs while it is not ticked
    try:
        assert loop.run(old.run_epoch()) is not None
        log.append(20)
        new = runner(store, MemorySource(log), MemorySink(destination), worker="new")
        started = time.monotonic()
        certificate = run(new.run_epoch)
        took = time.monotonic() - started
        assert certificate is not None and certificate.worker == "new" and certificate.fencing_token == 2
        assert certificate.coverage[0].start == "30" and certificate.coverage[0].end == "50"
        assert took < 5, f"the hand-over took {took:.1f}s"
        assert store.status("s")[0].owner == "new"
        # The old holder closed its sessions and cannot certify or acknowledge any more.
        assert all(session.closed for session in old_source.sessions)
        log.append(5)
        with pytest.raises(OwnershipLost):
            loop.run(old.run_epoch())
        run(new.close)
    finally:
        loop.close()
    assert ids_of(destination) == list(range(1, 51))
    assert log.acknowledgements == [30, 50]
