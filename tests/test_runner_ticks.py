"""Epochs under a sensor (``StreamRunner.tick``): read in the background, sealed by age, size or a stop.

The source and sink are the in-memory doubles of ``stream_doubles`` (a transaction's end is held back
by the test where it says so); the state store is real (SQLite). Each runner lives on a
:class:`BackgroundLoop`, as in a code server: its reader runs there between the ticks the test sends.
A tick never seals anything: the tests wait (with generous bounds) for what the reader certifies.
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
    OwnershipLost,
    ReadLimits,
    StreamRecordSink,
    TransactionBegin,
    TransactionEnd,
)
from faucet_dagster.runner.continuous import Pending, StreamRunner, StreamSpec
from faucet_dagster.runner.loop import BackgroundLoop
from faucet_dagster.runner.open_epoch import READ_SLICE_SECONDS
from faucet_dagster.state import Lease, StateStore

BOUND = 30.0
LONG_AGE = 600.0
"""An epoch age no test waits for: its epochs end by size, a stop or a hand-over only."""


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
    age: float | None = 0.3,
    started: float | None = None,
) -> StreamRunner:
    spec = StreamSpec(
        name="s",
        source=source,
        sink=sink,
        resources=("items",),
        limits=ReadLimits(records=records, idle=0.05, age=age),
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


def counts(store: StateStore) -> list[dict[str, int]]:
    return [dict(c.row_counts) for c in store.certificates("s")]


def test_epochs_are_sealed_by_age_in_the_background_and_a_tick_only_reports(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(10)
    sink = MemorySink()
    stream = runner(store, MemorySource(log), sink)
    loop.run(stream.tick(10))  # starts the reader
    assert stream.started
    wait_for("the first epoch certified by age", lambda: counts(store) == [{"items": 10}])
    # No tick from here on: each burst is certified and acknowledged about an age after it arrived.
    for burst in range(2, 5):
        log.append(3)
        wait_for(f"burst {burst} certified without a tick", lambda n=burst: len(counts(store)) == n)
        assert counts(store)[-1] == {"items": 3}
    wait_for("acknowledged", lambda: log.acknowledged == 19)
    assert ids(sink.destination) == list(range(1, 20))
    # A tick does not wait for anything: it says what is not certified yet (nothing here).
    began = time.monotonic()
    assert loop.run(stream.tick(10)) is None and not stream.started
    assert time.monotonic() - began < 5
    loop.run(stream.close())
    assert store.status("s")[0].owner is None


def test_an_open_epoch_waits_at_the_sink_uncommitted_and_a_tick_says_so(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(40)
    sink = MemorySink()
    stream = runner(store, MemorySource(log), sink, records=100, age=LONG_AGE)
    loop.run(stream.tick(10))
    wait_for("the rows applied in the open epoch 1", lambda: "apply 1 40" in sink.destination.calls)
    pending = loop.run(stream.tick(10))
    assert isinstance(pending, Pending) and pending.phase == "reading" and pending.rows == 40, pending
    assert pending.epoch is not None and pending.epoch.sequence == 1
    assert "epoch 1 is open with 40 rows read" in pending.describe()
    assert store.certificates("s") == [] and sink.destination.rows == [], "not committed before it is due"
    log.append(60)  # the epoch is full: sealed at that boundary, without a tick
    wait_for("the full epoch certified", lambda: counts(store) == [{"items": 100}])
    assert ids(sink.destination) == list(range(1, 101))
    loop.run(stream.close())


def test_an_open_epoch_reads_until_it_is_due_then_in_short_reads(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    stream = runner(store, MemorySource(log), MemorySink(), age=2.0)
    loop.run(stream.tick(10))
    # Nothing read: long reads (a read returns ``idle`` after its last row anyway).
    wait_for("two reads", lambda: len(log.reads) >= 2)
    assert {limits.age for limits in log.reads} == {READ_SLICE_SECONDS}
    log.append(5)
    wait_for("the rows certified", lambda: counts(store) == [{"items": 5}])
    # Once the epoch read rows, no read outlasts the time left until it is due.
    ages = [limits.age for limits in log.reads]
    assert all(age is not None and age <= READ_SLICE_SECONDS for age in ages), ages
    loop.run(stream.close())


def test_a_tick_that_starts_the_reader_waits_at_most_its_starting_budget(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(40)
    sink = MemorySink()
    stream = runner(store, MemorySource(log), sink)
    pending = loop.run(stream.tick(10, starting_budget=0.0))
    assert isinstance(pending, Pending) and stream.started and pending.phase == "starting"
    wait_for("the first epoch certified in the background", lambda: counts(store) == [{"items": 40}])
    # A tick that finds the reader running does not start it again. The certificate is persisted
    # before the source is acknowledged: ticks say the epoch is pending until it ended.
    restarted: list[bool] = []

    def settled() -> bool:
        pending = loop.run(stream.tick(10, starting_budget=0.0))
        restarted.append(stream.started)
        return pending is None

    wait_for("a tick with nothing pending", settled)
    assert not any(restarted) and log.acknowledged == 40
    loop.run(stream.close())


def test_a_backlog_is_sealed_full_epoch_after_full_epoch_without_ticks(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(10)
    stream = runner(store, MemorySource(log), MemorySink(), records=100)
    loop.run(stream.tick(10))
    wait_for("the first epoch", lambda: counts(store) == [{"items": 10}])
    log.append(250)
    # The certificate is persisted before the source is acknowledged: wait for both.
    wait_for(
        "the backlog certified and acknowledged without a tick",
        lambda: len(counts(store)) == 4 and log.acknowledged == 260,
    )
    assert counts(store) == [{"items": 10}, {"items": 100}, {"items": 100}, {"items": 50}]
    assert log.acknowledgements == [10, 110, 210, 260]
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


def test_a_source_transaction_outlives_the_epoch_age_and_is_certified_whole(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(300)
    source, sink = HeldTransactionSource(log), MemorySink()
    # An age and a record limit far below the transaction: limits are targets, never places to cut it.
    stream = runner(store, source, sink, records=50, age=0.2)
    loop.run(stream.tick(10))
    ends = time.monotonic() + BOUND
    pending = loop.run(stream.tick(1.0))
    while pending is None or pending.seconds < 0.2 + READ_SLICE_SECONDS + 0.5:
        assert time.monotonic() < ends, pending
        time.sleep(0.1)
        pending = loop.run(stream.tick(1.0))
    assert pending.epoch is not None and pending.epoch.sequence == 1 and pending.rows == 300
    assert "has not reached a safe source boundary" in pending.describe()
    assert store.certificates("s") == [] and sink.destination.rows == []
    assert "abort 1" not in sink.destination.calls, "the open epoch is never rolled back"
    loop.run(_set(source.release))  # the transaction's end arrives
    wait_for("the transaction certified", lambda: bool(store.certificates("s")))
    [certificate] = store.certificates("s")
    assert certificate.row_counts == {"items": 300} and ids(sink.destination) == list(range(1, 301))
    loop.run(stream.close())


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_a_reader_no_tick_reaches_certifies_its_open_epoch_and_releases_the_lease(
    store: StateStore, loop: BackgroundLoop
) -> None:
    """The sensor stopped: the reader stops after ``stop_after`` seconds without a tick. What its
    open epoch holds is sealed at the next boundary and certified, never rolled back (a sink that
    cannot take back what it applied, NATS, would store it again when it is replayed later)."""
    log = MemoryLog()
    log.append(10)
    sink = MemorySink()
    # Nothing is sealed by age: the second epoch is open when the reader stops.
    stream = runner(store, MemorySource(log), sink, records=10, age=LONG_AGE)
    loop.run(stream.tick(10, stop_after=2.0))
    wait_for("the first epoch (full)", lambda: counts(store) == [{"items": 10}])
    log.append(5)
    wait_for("the rows applied in the open epoch", lambda: "apply 2 5" in sink.destination.calls)
    wait_for("the reader stopped", lambda: store.status("s")[0].owner is None)
    assert "abort 2" not in sink.destination.calls
    assert counts(store) == [{"items": 10}, {"items": 5}] and log.acknowledged == 15
    assert ids(sink.destination) == list(range(1, 16))
    # A later tick starts reading again, from the certified position.
    log.append(10)
    loop.run(stream.tick(10))
    wait_for("the next (full) epoch", lambda: len(counts(store)) == 3)
    assert counts(store)[-1] == {"items": 10} and ids(sink.destination) == list(range(1, 26))
    loop.run(stream.close())


def test_a_hand_over_seals_the_open_epoch_before_the_newer_worker_takes_over(
    store: StateStore, loop: BackgroundLoop
) -> None:
    log = MemoryLog()
    log.append(20)
    destination = MemoryDestination()
    old_sink = MemorySink(destination)
    old = runner(store, MemorySource(log), old_sink, worker="old", records=20, age=LONG_AGE, started=1.0)
    loop.run(old.tick(10))
    wait_for("the old worker's first epoch", lambda: counts(store) == [{"items": 20}])
    log.append(15)
    wait_for("read into the old worker's open epoch", lambda: "apply 2 15" in destination.calls)
    new_loop = BackgroundLoop("newer-code-server")
    try:
        new = runner(store, MemorySource(log), MemorySink(destination), worker="new", started=2.0)
        new_loop.run(new.tick(10))
        log.append(5)
        wait_for("the new worker's epoch", lambda: sum(sum(c.values()) for c in counts(store)) == 40)
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
    # No tick: the reader takes the expired lease (fencing the dead holder) and certifies.
    wait_for("the first certificate", lambda: bool(store.certificates("s")))
    [certificate] = store.certificates("s")
    assert (certificate.worker, certificate.row_counts) == ("w1", {"items": 10})
    assert certificate.fencing_token > dead.fencing_token
    wait_for("acknowledged", lambda: log.acknowledged == 10)
    assert loop.run(stream.tick(10)) is None  # nothing left to certify (the sensor reports it)
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


def test_a_reader_whose_lease_an_operator_released_takes_a_new_one_at_its_next_start(
    store: StateStore, loop: BackgroundLoop
) -> None:
    """An operator's release (``faucet streams release``) of a live holder's lease fails the epoch
    that holds it when its certificate is appended, and the tick after reports it. The reader the next
    tick starts takes a new lease at once: it does not go on with the lost one (which would fail it
    again a sensor interval later, and, into NATS, replay its epoch past the duplicate window)."""
    log = MemoryLog()
    log.append(10)
    sink = MemorySink()
    stream = runner(store, MemorySource(log), sink, records=10, age=LONG_AGE)
    loop.run(stream.tick(10))
    wait_for("the first epoch", lambda: counts(store) == [{"items": 10}])
    lost = store.release("s").fencing_token  # the lease was renewed moments ago: no renewal notices
    log.append(10)
    wait_for("the second epoch committed at the sink", lambda: "commit 2" in sink.destination.calls)
    failed: list[BaseException] = []

    def ticks_until_failed() -> bool:
        try:
            loop.run(stream.tick(10))
        except OwnershipLost as exc:
            failed.append(exc)
        return bool(failed)

    wait_for("a tick reporting the lost lease", ticks_until_failed)
    assert counts(store) == [{"items": 10}]
    loop.run(stream.tick(10))  # a new reader, no tick after it
    wait_for("the second epoch certified under a new lease", lambda: len(counts(store)) == 2)
    certificate = store.certificates("s")[-1]
    assert certificate.fencing_token > lost and sum(certificate.row_counts.values()) == 10
    assert ids(sink.destination) == list(range(1, 21))
    loop.run(stream.close())
