"""Epochs that span ticks (``StreamRunner.tick``): read between ticks, sealed when a tick asks.

The source and sink are the in-memory doubles of ``stream_doubles`` (a transaction's end is held back
by the test where it says so); the state store is real (SQLite). Each runner lives on a
:class:`BackgroundLoop`, as in a code server: its reader runs there between the ticks the test sends.
"""

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from stream_doubles import MemoryDestination, MemoryLog, MemorySession, MemorySink, MemorySource, domain

from faucet_dagster.protocol import (
    CancelToken,
    Coverage,
    DomainCoverage,
    Identities,
    ReadLimits,
    StreamRecordSink,
    TransactionBegin,
    TransactionEnd,
)
from faucet_dagster.runner.continuous import Pending, StreamRunner, StreamSpec
from faucet_dagster.runner.loop import BackgroundLoop
from faucet_dagster.runner.open_epoch import READ_SLICE_SECONDS, SEAL_SLICE_SECONDS
from faucet_dagster.state import Lease, StateStore

BOUND = 30.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    made = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    yield made
    made.close()


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    made = BackgroundLoop("test-code-server")
    yield made
    made.close()


def runner(
    store: StateStore,
    source: MemorySource,
    sink: MemorySink,
    *,
    worker: str = "w1",
    records: int = 1_000,
    started: float | None = None,
) -> StreamRunner:
    spec = StreamSpec(
        name="s",
        source=source,
        sink=sink,
        resources=("items",),
        limits=ReadLimits(records=records, idle=0.05),
        lease_seconds=30.0,
    )
    return StreamRunner(spec, store, worker_id=worker, started=started)


def wait_for(what: str, condition: Callable[[], bool]) -> None:
    ends = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < ends, f"{what}: not within {BOUND:.0f}s"
        time.sleep(0.05)


def ids(destination: MemoryDestination) -> list[int]:
    return [row["id"] for row in destination.rows]


def test_a_tick_seals_what_reached_the_source_before_it_while_the_reader_found_nothing(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(10)
    sink = MemorySink()
    stream = runner(store, MemorySource(log), sink)
    assert loop.run(stream.tick(10)) is None
    # The reader of epoch 2 found nothing and reads again after a short pause; rows that arrive in
    # that pause, just before the tick, are read before the seal, not left to the next epoch.
    wait_for("the open epoch 2", lambda: "begin 2" in sink.destination.calls)
    for round in range(5):
        log.append(3)
        assert loop.run(stream.tick(10)) is None
        assert [c.row_counts for c in store.certificates("s")][-1] == {"items": 3}, f"tick {round + 2}"
    assert ids(sink.destination) == list(range(1, 26))
    loop.run(stream.close())


def test_a_tick_seals_what_the_open_epoch_read_since_the_last_one(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(40)
    sink = MemorySink()
    stream = runner(store, MemorySource(log), sink)
    assert loop.run(stream.tick(10)) is None  # starts the reader, seals after its first read
    assert [c.row_counts for c in store.certificates("s")] == [{"items": 40}]
    log.append(25)
    # Read between ticks into the open epoch 2: applied at the sink, not committed.
    wait_for("the rows read between ticks", lambda: "apply 2 25" in sink.destination.calls)
    assert ids(sink.destination) == list(range(1, 41))
    began = time.monotonic()
    assert loop.run(stream.tick(10)) is None
    assert time.monotonic() - began < 5, "a tick lasts a seal and a commit, not a read"
    assert [c.row_counts for c in store.certificates("s")] == [{"items": 40}, {"items": 25}]
    assert ids(sink.destination) == list(range(1, 66))
    assert log.acknowledgements == [40, 65]
    # Nothing new: the epoch is dropped empty (nothing certified), the next one begun.
    assert loop.run(stream.tick(10)) is None
    assert len(store.certificates("s")) == 2
    loop.run(stream.close())
    assert store.status("s")[0].owner is None


def test_reads_are_long_until_the_next_tick_can_come_and_short_once_it_can(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(40)
    stream = runner(store, MemorySource(log), MemorySink())
    # The first tick's seal is asked for before the reader's first read: a short one.
    assert loop.run(stream.tick(10, interval=30)) is None
    assert [limits.age for limits in log.reads[:1]] == [SEAL_SLICE_SECONDS]
    # The next tick cannot come for 30 s: the reads of the open epoch are long ones until shortly before.
    seen = len(log.reads)
    wait_for("two reads after the tick", lambda: len(log.reads) >= seen + 2)
    assert {limits.age for limits in log.reads[seen:]} == {READ_SLICE_SECONDS}
    # A tick that says the next one can come at once: short reads, so its seal waits a short one.
    assert loop.run(stream.tick(10, interval=0)) is None
    seen = len(log.reads)
    wait_for("two reads after the tick", lambda: len(log.reads) >= seen + 2)
    assert {limits.age for limits in log.reads[seen:]} == {SEAL_SLICE_SECONDS}
    loop.run(stream.close())


def test_a_tick_that_starts_the_reader_waits_its_starting_budget_and_the_first_seal_is_served_after_it(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(40)
    sink = MemorySink()
    stream = runner(store, MemorySource(log), sink)
    pending = loop.run(stream.tick(10, starting_budget=0.0))
    assert isinstance(pending, Pending) and stream.started
    # Its seal request stands: the reader seals after its first read, with no further tick.
    wait_for("the first epoch certified in the background", lambda: len(store.certificates("s")) == 1)
    assert [c.row_counts for c in store.certificates("s")] == [{"items": 40}]
    log.append(5)
    wait_for("the rows read between ticks", lambda: "apply 2 5" in sink.destination.calls)
    # A tick that finds the reader running waits its budget as before.
    assert loop.run(stream.tick(10, starting_budget=0.0)) is None and not stream.started
    assert [c.row_counts for c in store.certificates("s")][-1] == {"items": 5}
    loop.run(stream.close())


def test_a_tick_in_a_backlog_waits_for_its_own_seal_only(store: StateStore, loop: BackgroundLoop) -> None:
    log = MemoryLog()
    log.append(250)
    stream = runner(store, MemorySource(log), MemorySink(), records=100)
    assert loop.run(stream.tick(20)) is None
    # The tick returned once its epoch (full at 100 rows) was certified: it did not wait for the
    # backlog's next epochs, so a serial daemon's other sensors are not held up by this one. The
    # reader seals the next full epoch itself; the last 50 rows wait in the open epoch for a tick.
    counts = [c.row_counts for c in store.certificates("s")]
    assert counts in ([{"items": 100}], [{"items": 100}, {"items": 100}]), counts
    wait_for("the next full epoch certified without a tick", lambda: len(store.certificates("s")) == 2)
    assert loop.run(stream.tick(20)) is None
    assert [c.row_counts for c in store.certificates("s")] == [{"items": 100}, {"items": 100}, {"items": 50}]
    loop.run(stream.close())


def test_a_full_epoch_is_sealed_by_the_reader_without_waiting_for_a_tick(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(10)
    stream = runner(store, MemorySource(log), MemorySink(), records=100)
    assert loop.run(stream.tick(10)) is None
    # No tick comes while a backlog arrives (the sensor's interval): the reader does not sit idle
    # with a full epoch, it seals each one at its boundary and reads on.
    log.append(250)
    # The certificate is persisted before the source is acknowledged: wait for both.
    wait_for(
        "two full epochs certified and acknowledged without a tick",
        lambda: len(store.certificates("s")) == 3 and len(log.acknowledgements) == 3,
    )
    assert [c.row_counts for c in store.certificates("s")] == [{"items": 10}, {"items": 100}, {"items": 100}]
    assert log.acknowledgements == [10, 110, 210]
    assert loop.run(stream.tick(10)) is None
    assert [c.row_counts for c in store.certificates("s")][-1] == {"items": 50}
    loop.run(stream.close())


class HeldTransactionSession(MemorySession):
    """Reads one source transaction of all the log's rows, whose end arrives when ``release`` is set."""

    release: asyncio.Event

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        available = len(self.log.rows)
        if self.position >= available:
            return Coverage()
        dom, start = domain(), self.position
        await sink.control(TransactionBegin(dom, "big"))
        for low in range(start, available, 10):
            high = min(available, low + 10)
            rows = self.log.rows[low:high]
            await sink.write(dom, rows, Identities([str(p) for p in range(low + 1, high + 1)]))
        waiter = asyncio.ensure_future(self.release.wait())
        await asyncio.wait(
            {waiter, asyncio.ensure_future(cancel.wait())}, return_when=asyncio.FIRST_COMPLETED
        )
        if not self.release.is_set():
            waiter.cancel()
            return Coverage()  # interrupted inside the transaction: nothing past its begin
        await sink.control(TransactionEnd(dom, "big", str(available)))
        self.position = available
        return Coverage((DomainCoverage(dom, None if start == 0 else str(start), str(available)),))


class HeldTransactionSource(MemorySource):
    def __init__(self, log: MemoryLog) -> None:
        super().__init__(log)
        self.release = asyncio.Event()

    async def open(self, *args: object, **kwargs: object) -> MemorySession:
        session = await super().open(*args, **kwargs)  # type: ignore[arg-type]
        session.__class__ = HeldTransactionSession
        session.release = self.release  # type: ignore[attr-defined]
        return session


def test_a_source_transaction_spans_ticks_and_is_certified_whole(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(300)
    source, sink = HeldTransactionSource(log), MemorySink()
    # A record limit far below the transaction: limits are targets, never places to cut it.
    stream = runner(store, source, sink, records=50)
    pending = [loop.run(stream.tick(1.0)) for _ in range(3)]
    for found in pending:
        assert isinstance(found, Pending) and found.epoch is not None and found.epoch.sequence == 1
        assert found.rows == 300 and "has not reached a safe source boundary" in found.describe()
    assert store.certificates("s") == [] and sink.destination.rows == []
    assert "abort 1" not in sink.destination.calls, "a tick never rolls back the open epoch"
    loop.run(_set(source.release))  # the transaction's end arrives
    assert loop.run(stream.tick(10)) is None
    [certificate] = store.certificates("s")
    assert certificate.row_counts == {"items": 300} and ids(sink.destination) == list(range(1, 301))
    loop.run(stream.close())


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_a_reader_no_tick_reaches_rolls_back_and_releases_the_lease(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(10)
    sink = MemorySink()
    stream = runner(store, MemorySource(log), sink)
    assert loop.run(stream.tick(10, stop_after=1.0)) is None
    log.append(5)
    wait_for("the reader stopped", lambda: store.status("s")[0].owner is None)
    assert "abort 2" in sink.destination.calls and ids(sink.destination) == list(range(1, 11))
    # A later tick starts reading again, from the certified position.
    assert loop.run(stream.tick(10)) is None
    assert [c.row_counts for c in store.certificates("s")] == [{"items": 10}, {"items": 5}]
    loop.run(stream.close())


def test_a_hand_over_seals_the_open_epoch_before_the_newer_worker_takes_over(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(20)
    destination = MemoryDestination()
    old_sink = MemorySink(destination)
    old = runner(store, MemorySource(log), old_sink, worker="old", started=1.0)
    assert loop.run(old.tick(10)) is None
    log.append(15)
    wait_for("read into the old worker's open epoch", lambda: "apply 2 15" in destination.calls)
    new_loop = BackgroundLoop("newer-code-server")
    try:
        new = runner(store, MemorySource(log), MemorySink(destination), worker="new", started=2.0)
        assert new_loop.run(new.tick(10)) is None
        log.append(5)
        assert new_loop.run(new.tick(10)) is None
        new_loop.run(new.close())
    finally:
        new_loop.close()
    certificates = store.certificates("s")
    # The old worker sealed what it had read (epoch 2) when asked to hand over; nothing read twice.
    assert [(c.worker, c.row_counts) for c in certificates if c.row_counts] == [
        ("old", {"items": 20}),
        ("old", {"items": 15}),
        ("new", {"items": 5}),
    ]
    assert ids(destination) == list(range(1, 41))


def test_a_first_tick_that_finds_a_dead_holders_lease_certifies_once_it_expires_without_another_tick(
    store: StateStore, loop: BackgroundLoop
) -> None:
    """A code server killed (kill -9) leaves its lease live for up to its length: the next process's
    first tick asks it to hand over, reports the wait, and its reader takes the lease the moment it
    expires and certifies at once, not a sensor interval later."""
    # Longer than a tick's own lease wait (runner.lease.HANDOVER_WAIT_SECONDS, 5 s).
    dead = store.try_acquire_lease("s", "dead", 15.0, started=1.0)
    assert isinstance(dead, Lease)
    log = MemoryLog()
    log.append(10)
    stream = runner(store, MemorySource(log), MemorySink(), started=2.0)
    pending = loop.run(stream.tick(0.5))
    # A loaded machine may not let the reader ask for the lease within the first half second: the
    # ticks after it (long before the lease expires) report the wait.
    ends = time.monotonic() + BOUND
    while pending is not None and pending.lease_wait is None and time.monotonic() < ends:
        pending = loop.run(stream.tick(0.5))
    assert pending is not None and pending.lease_wait is not None, pending
    assert "leased to dead" in pending.lease_wait and "asked to hand the stream over" in pending.lease_wait
    assert "waiting" in pending.describe() and not store.certificates("s")
    # No tick: the reader takes the expired lease (fencing the dead holder) and serves the first seal.
    wait_for("the first certificate", lambda: bool(store.certificates("s")))
    [certificate] = store.certificates("s")
    assert (certificate.worker, certificate.row_counts) == ("w1", {"items": 10})
    assert certificate.fencing_token > dead.fencing_token
    assert loop.run(stream.tick(10)) is None  # the next tick finds it certified (the sensor reports it)
    loop.run(stream.close())


def test_closing_a_runner_that_waits_for_a_dead_holders_lease_stops_waiting(
    store: StateStore, loop: BackgroundLoop
) -> None:
    """A process that stops while its reader waits out a dead holder's lease (at exit, a hand-over)
    stops waiting: it closes without taking the lease, which the dead holder keeps until it expires."""
    dead = store.try_acquire_lease("s", "dead", 60.0, started=1.0)
    assert isinstance(dead, Lease)
    log = MemoryLog()
    log.append(10)
    stream = runner(store, MemorySource(log), MemorySink(), started=2.0)
    pending = loop.run(stream.tick(0.5))
    ends = time.monotonic() + BOUND
    while pending is not None and pending.lease_wait is None and time.monotonic() < ends:
        pending = loop.run(stream.tick(0.5))  # the reader had not asked for the lease yet (load)
    assert pending is not None and pending.lease_wait is not None, pending
    loop.run(stream.close())
    status = store.status("s")[0]
    assert status.owner == "dead" and status.fencing_token == dead.fencing_token, status
    assert not store.certificates("s")
