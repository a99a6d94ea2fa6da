"""The continuous runner: epochs sealed at safe source boundaries, committed, certified, then acknowledged.

:meth:`StreamRunner._run_epoch` is the single commit order of DESIGN.md section 4, in one function:

1. hold a current lease (renewed when a third of it has passed; its fencing token is part of the epoch id);
2. begin the epoch at the sink (``begin_epoch``), once the epoch before it was committed: its pipeline
   does that right before its first ``apply`` (or at the seal);
3. ``read`` until a safe boundary: in one call until one that meets the limits (:meth:`run_epoch`), or,
   under a sensor, until the open epoch is due (its age, about a second, its size, or a stop:
   :mod:`.open_epoch`); the pipeline flushes and seals;
4. ``commit_epoch`` -> receipts, once the epoch before it was certified;
5. persist the epoch certificate in the state store;
6. ``acknowledge(coverage, authority)`` on the source session, once the epoch before it was;
7. return the certificate; reporting it to Dagster is the caller's job (the sensor reports from the
   store, which remembers what was reported). Reporting never gates the acknowledgement.

Epochs are pipelined (:mod:`.pipelined`): the next epoch is read while the last one commits, certifies
and acknowledges; the waits of steps 2, 4 and 6 on the epoch before keep one active epoch per sink
session, certificates in sequence and nothing acknowledged before its certificate. Three ways to
drive it, never mixed on one runner: :meth:`run_epoch` (one epoch, nothing read ahead: tests, tools),
:meth:`run_epochs` (pipelined, within a budget: workers, benchmarks) and :meth:`tick` (under a sensor:
a background reader, :mod:`.reader`, seals each epoch when it is due; a tick only says what is not
certified yet).

Failures and interruptions (:mod:`.sessions` holds the sessions, :mod:`.recovery` reconciles them):

* before 4 (read, seal, a refused commit) and on a cancelled read (never evidence that a transaction
  ended): the epoch is aborted and the source session closed, so the next epoch reopens it at the
  certified positions (the rewind); an epoch read ahead is discarded first
  (:meth:`.pipelined.Flight.quiesce`), so the rewind covers it. A process that dies with an open epoch
  leaves nothing of it at a transactional sink; the next owner reads it again;
* between 4 and 6 (an uncertain commit, a certificate that could not be persisted): nothing is
  acknowledged and both sessions are dropped; the next open reconciles the sink's ``last_committed()``
  with the last certificate (a sink one epoch ahead is recovered without loss or duplicates where the
  sink can prove it, :func:`.recovery.reconcile`);
* a close whose outcome is uncertain marks the stream uncertain in the store, which blocks every
  lease until an operator runs ``faucet streams release``.

Leases (DESIGN.md section 5, :mod:`.lease`) are short and renewed in the background. A hand-over
request (a newer worker found the lease live) seals the open epoch if it reaches a boundary within
``HANDOVER_SEAL_SECONDS`` (else interrupts it), closes the sessions and passes the lease on. A close
seals the open epoch the same way; for a sink whose writes cannot be taken back (``durability`` other
than transactional: NATS publishes during ``apply``) it waits for the boundary however long it takes,
so nothing it wrote is replayed after its duplicate window.

The ``fault_point(...)`` lines mark where the fault harness (:mod:`faucet_dagster.testing.faults`)
crashes or stops a worker; they do nothing unless a fault worker process armed one.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from faucet_dagster.pipeline import DeadLetterRoute, EpochPipeline, SealedEpoch
from faucet_dagster.planner import Plan
from faucet_dagster.protocol import (
    Coverage,
    Durability,
    EpochCertificate,
    EpochId,
    FaucetError,
    OwnershipLost,
    ReadLimits,
    Receipt,
    SourceLag,
    StreamSession,
    UncertainOutcome,
)
from faucet_dagster.runner.faults import Point, fault_point
from faucet_dagster.runner.lease import StreamLease
from faucet_dagster.runner.open_epoch import EpochClock, Pending
from faucet_dagster.runner.pipelined import Flight, pipelined
from faucet_dagster.runner.reader import Reader
from faucet_dagster.runner.reads import EpochReads
from faucet_dagster.runner.recovery import Stopwatch, advance
from faucet_dagster.runner.sessions import StreamSessions
from faucet_dagster.runner.spec import (
    DEFAULT_EPOCH_LIMITS,
    DEFAULT_LEASE_SECONDS,
    CutShort,
    StoreDeadLetterRoute,
    StreamSpec,
    continuous_plan,
    default_worker_id,
    stream_pipeline,
)
from faucet_dagster.state import Lease, StateStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

LAG_TIMEOUT = 5.0
"""Seconds the source may take to say where its head is (``StreamSession.lag``) after an epoch's read."""
MIN_FINISH_RESERVE = 0.5
"""Seconds of a call's budget always kept for sealing, committing, certifying and acknowledging."""
LINGER_MARGIN_SECONDS = 10.0
"""How late past its interval a tick may come (a serial daemon busy with other sensors) before a
lingering process stops waiting for it (:meth:`StreamRunner.linger`)."""
HANDOVER_SEAL_SECONDS = 1.5
"""How long a hand-over waits for the open epoch to reach a boundary and be certified before it
interrupts it (its rows are then read again by the next owner). Well inside the time a newer worker
waits for the hand-over (``lease.HANDOVER_WAIT_SECONDS``, or its tick's budget if shorter)."""


class StreamRunner:
    """Runs one stream's epochs, keeping the source and sink sessions open between calls.

    One caller at a time, always on the same event loop (the sessions' clients are bound to it).
    ``cancel`` is the exception: any thread may call it to interrupt the current read. Calls, the
    ticks' reader and :meth:`close` are serialized on the loop with the lease keeper, which hands the
    stream over between two of them. ``started`` (seconds since 1970, default: now) orders workers
    for hand-overs: a runner created later takes a stream over from a live earlier one.
    """

    def __init__(
        self,
        spec: StreamSpec,
        store: StateStore,
        *,
        worker_id: str | None = None,
        dead_letters: DeadLetterRoute | None = None,
        started: float | None = None,
    ) -> None:
        self.spec = spec
        self.store = store
        self.worker_id = worker_id or default_worker_id()
        self.started_at = time.time() if started is None else started
        self.plan: Plan = continuous_plan(spec)
        # Always a route: a source whose own policy dead-letters undecodable records needs one too.
        self._pipeline = stream_pipeline(spec, dead_letters or StoreDeadLetterRoute(store, spec.name))
        self._lease = StreamLease(
            store,
            spec.name,
            self.worker_id,
            spec.lease_seconds,
            self.started_at,
            on_handover=self._hand_over,
            on_lost=self._interrupt_read,
        )
        self._sessions = StreamSessions(spec, store, self.worker_id)
        self.final_applies = spec.sink.capabilities().durability is not Durability.TRANSACTIONAL
        """True when the sink cannot take back what ``apply`` did (NATS publishes): a stop seals the
        open epoch at its next boundary however long that takes, never rolls it back."""
        self._stop_seal = None if self.final_applies else HANDOVER_SEAL_SECONDS
        self._reads = EpochReads(self._sessions, spec.name)
        self.cut_short: CutShort | None = None
        """The epoch the deadline of the latest :meth:`run_epochs` interrupted after it read rows
        (None: no epoch of that call was cut short; epochs read between ticks are never cut short)."""
        self._serial: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._finish_seconds = 1.0  # until measured: a fresh process's first call keeps room too
        """The slowest recent seal-to-acknowledgement time (decaying): what a budget keeps for it."""
        self._reader = Reader(
            spec.name,
            EpochClock(spec.limits),
            self._read_between_ticks,
            lease_waiting=lambda: self._lease.waiting,
            interrupt=self._interrupt_read,
            seal_within=self._stop_seal,
            on_idle_stop=self._close_after_idle,
        )

    @property
    def started(self) -> bool:
        """Whether the latest :meth:`tick` started the reader (this process's first, or after one ended)."""
        return self._reader.started

    def cancel(self) -> None:
        """Interrupt the current read, or the next one if none is running: its epoch is aborted and
        nothing is certified (``run_epoch`` returns None); a reader between ticks stops. Thread-safe.

        For a sink whose writes cannot be taken back (:attr:`final_applies`) the read in progress is
        not interrupted, since its epoch may have published already: it ends at the first safe
        boundary after the source read under way returns (within the epoch's limits), and its epoch
        is sealed, committed, certified and acknowledged; the read after it is interrupted."""
        self._reader.clock.stopping = True
        self._reads.cancel(finish=self.final_applies)

    # -- epochs in calls ------------------------------------------------------------------------

    async def run_epochs(
        self,
        budget_seconds: float,
        limits: ReadLimits | None = None,
        *,
        on_certified: Callable[[EpochCertificate], None] | None = None,
    ) -> list[EpochCertificate]:
        """Run epochs, pipelined, until ``budget_seconds`` are spent or the source has nothing new;
        each read to ``limits`` (default: the stream's); ``on_certified`` is called with each
        certificate as soon as its epoch is acknowledged.

        Reads end early enough for the seal, commit, certificate and acknowledgement to fit in the
        budget too: the time kept for them is twice the slowest recent one (at least
        ``MIN_FINISH_RESERVE``, at most a quarter of the budget); no epoch is read ahead within that
        reserve. A read still going when its time is up is cancelled (that epoch is aborted and
        :attr:`cut_short` says so if it had read rows). Returns the certificates, in order. Raises the
        first failure (certificates persisted before it stay persisted; an epoch read ahead is
        rewound with the one that failed).
        """
        loop = asyncio.get_running_loop()
        reserve = min(budget_seconds / 4, max(MIN_FINISH_RESERVE, 2 * self._finish_seconds))
        deadline = loop.time() + budget_seconds - reserve
        read = limits or self.spec.limits
        certificates: list[EpochCertificate] = []
        self.cut_short = None
        ended = False

        def more() -> bool:
            return not ended and deadline > loop.time()

        def ahead() -> bool:
            return deadline - loop.time() > reserve

        async def epoch(flight: Flight) -> EpochCertificate | None:
            remaining = deadline - loop.time()
            age = remaining * 0.75 if read.age is None else min(read.age, remaining * 0.75)
            return await self._run_epoch(replace(read, age=age), deadline, None, flight)

        async with self._serialized():
            epochs = pipelined(epoch, more=more, ahead=ahead)
            try:
                async for outcome in epochs:
                    if outcome is None:
                        ended = True
                        continue
                    certificates.append(outcome)
                    if on_certified is not None:
                        on_certified(outcome)
            finally:
                await epochs.aclose()
        if not certificates and self.cut_short is not None:
            logger.warning("stream %s: %s", self.spec.name, self.cut_short.describe())
        return certificates

    async def run_epoch(
        self, limits: ReadLimits | None = None, *, deadline: float | None = None
    ) -> EpochCertificate | None:
        """Run one epoch in the commit order, nothing read ahead; return its certificate, or None
        when the source had nothing new or the read was cancelled (``cancel``, ``deadline``: a time on
        the running loop's clock that also bounds the wait for a hand-over). Every failure is raised
        after the epoch was aborted and rewound (before the commit) or the sessions dropped (after)."""
        async with self._serialized():
            return await self._run_epoch(limits or self.spec.limits, deadline, None, Flight())

    # -- epochs under a sensor ------------------------------------------------------------------

    async def tick(
        self,
        budget_seconds: float,
        *,
        stop_after: float | None = None,
        starting_budget: float | None = None,
        interval: float | None = None,
    ) -> Pending | None:
        """One sensor tick: keep the background reader running (:mod:`.reader`) and say what is not
        certified yet. Epochs are sealed in the background when due (about a second old, full, or a
        stop), committed, certified and acknowledged; the tick does not wait for them, and the sensor
        reports the certificates from the store.

        Returns None when the reader holds nothing it has not certified, else what is pending (an
        open epoch with rows, one being committed, the reader starting or waiting for a lease: a lease
        held by a worker this one asked to hand over is waited for beyond the tick). The first tick
        (and the first after the reader failed or stopped: :attr:`started`) starts the reader and
        waits at most ``starting_budget`` (default ``budget_seconds``) for it to take the lease and
        open the sessions. A failure of the reader is raised by the next tick, once. The reader stops
        (its open epoch sealed and certified first, its lease released) when no tick came for
        ``stop_after`` seconds. ``interval`` (the sensor's: when the next tick comes at the earliest)
        bounds how long an exiting process reads on (:meth:`linger`).
        """
        return await self._reader.tick(
            budget_seconds, stop_after=stop_after, starting_budget=starting_budget, interval=interval
        )

    @property
    def reading(self) -> bool:
        """True while the background reader runs (a sensor ticks this runner)."""
        return self._reader.running

    async def linger(self, longest: float) -> None:
        """Go on reading, at most ``longest`` seconds, until a newer worker takes the stream over or
        the next tick is overdue (its interval after the last, plus ``LINGER_MARGIN_SECONDS``): what
        an exiting process does, so the stream does not stand still until the process replacing it
        ticks (see :mod:`faucet_dagster.streams.runner_cache`). Returns at once when no reader runs."""
        await self._reader.linger(longest, LINGER_MARGIN_SECONDS)

    async def _read_between_ticks(self, clock: EpochClock) -> None:
        """The reader's epochs: pipelined, each read until it is due (:meth:`EpochClock.read`), until
        the clock stops."""

        async def epoch(flight: Flight) -> EpochCertificate | None:
            try:
                return await self._run_epoch(self.spec.limits, None, clock, flight)
            finally:
                clock.ended(flight.epoch)

        async with self._serialized():
            epochs = pipelined(epoch, more=clock.going, ahead=clock.going)
            try:
                async for _ in epochs:
                    pass
            finally:
                await epochs.aclose()

    async def _close_after_idle(self, stop_after: float) -> None:
        logger.warning(
            "stream %s: no tick for %.0fs; the reader stopped after certifying its open epoch, and the "
            "lease is released",
            self.spec.name,
            stop_after,
        )
        async with self._serialized():
            await self._close(release=True)

    # -- the one commit order -------------------------------------------------------------------

    async def _run_epoch(
        self, limits: ReadLimits, deadline: float | None, clock: EpochClock | None, flight: Flight
    ) -> EpochCertificate | None:
        """One epoch, the one commit order. ``clock`` set: read under a sensor until the open epoch is
        due (:meth:`EpochClock.read`); else read in this call to the limits. ``flight.previous`` is
        the epoch before this one when that one is still in flight (pipelined): this one is read
        meanwhile and waits for it at steps 2, 4 and 6 (:mod:`.pipelined`)."""
        timings = Stopwatch()
        started = time.perf_counter()
        sessions = self._sessions
        before = flight.previous

        # 1. Hold a current lease: its fencing token goes into the epoch id and the sessions. A reader
        # under a sensor waits out a holder it asked to hand over (one killed cannot answer). An epoch
        # read ahead holds the lease of the epoch before it (renewed in the background meanwhile).
        try:
            lease = await self._lease.hold(deadline, patient=None if clock is None else clock.going)
            held = None if before is None else before.epoch
            if held is not None and held.fencing_token != lease.fencing_token:
                raise OwnershipLost(f"the lease changed under epoch {held}", where=self.spec.name)
        except BaseException as exc:  # a lease lost drops the sessions; a store out of reach keeps them
            await self._drop(flight, exc, sessions=isinstance(exc, OwnershipLost))
            raise
        source_session, sink_session = await sessions.open(lease)
        if before is None or before.epoch is None or before.coverage is None:
            sequence, starts = sessions.next_sequence, sessions.certified
        else:
            sequence, starts = before.epoch.sequence + 1, advance(sessions.certified, before.coverage)
        epoch = flight.epoch = EpochId(self.spec.name, sequence, lease.fencing_token)
        timings.lap("lease")
        adopted, sessions.adopted = sessions.adopted, None
        if adopted is not None:
            return await self._adopt(epoch, adopted, lease, source_session, flight, timings)

        # 2. Begin the epoch at the sink once the epoch before it was committed (a sink session has
        # one active epoch): the pipeline calls ``begin_epoch`` right before its first ``apply`` (or
        # at the seal), holding what this epoch reads until then.
        pipeline = self._pipeline.begin(epoch, sink_session, starts, begin_after=flight.may_begin)

        # 3. Read until a safe boundary (the limits, or the open epoch due); the pipeline flushes and seals.
        if clock is None:
            reading = self._reads.to_limits(source_session, pipeline, limits, deadline, flight)
        else:
            clock.begun(epoch, pipeline, asyncio.get_running_loop().time())
            reading = self._reads.until_due(clock, source_session, pipeline, flight)
        coverage = await self._guard(reading, epoch, pipeline, flight)
        if coverage is None or (coverage.empty and not pipeline.has_evidence):
            # Cancelled, or nothing new: nothing to commit. A session that moved is rewound.
            cut = coverage is None and deadline is not None and asyncio.get_running_loop().time() >= deadline
            if clock is None and cut and pipeline.rows_written:
                self.cut_short = CutShort(epoch, pipeline.rows_written, time.perf_counter() - started)
            await flight.quiesce(failed=False)
            await sessions.abort(epoch, pipeline, rewind=pipeline.has_evidence)
            flight.settle()
            return None
        read_end = time.perf_counter()
        # The source's lag (informational, for the certificate) takes the source session's turn now,
        # before the next epoch's reads, and is awaited at step 5.
        lagging = asyncio.ensure_future(self._reads.lag(source_session, LAG_TIMEOUT))
        await asyncio.sleep(0)
        sealed = await self._guard(pipeline.seal(coverage), epoch, pipeline, flight, lagging)
        timings.lap("read_and_seal")
        flight.sealed(epoch, sealed.coverage, overlapping=not sessions.recover_to)
        if clock is not None:
            clock.sealed(epoch)

        # 4. Commit at the sink once the epoch before it was certified (certificates in sequence: the
        # destination is never two epochs ahead of them): durable as the policy promises once it returns.
        if before is not None:
            await self._guard(flight.may_commit(), epoch, pipeline, flight, lagging)
            timings.lap("wait")
        fault_point(Point.BEFORE_SINK_COMMIT)
        try:
            receipts = await sink_session.commit_epoch(epoch, sealed.coverage)
        except UncertainOutcome as exc:
            # It may have committed: never abort it, never acknowledge; the next open reconciles.
            await _cancelled(lagging)
            await self._drop(flight, exc)
            raise
        except BaseException as exc:
            await self._abort(epoch, pipeline, flight, exc, lagging)
            raise
        timings.lap("commit")
        flight.committed()
        fault_point(Point.AFTER_SINK_COMMIT)

        # 5. Persist the certificate: from here on, the epoch is certified.
        try:
            lag = await lagging  # cancelled: committed, not certified; the next open reconciles
            certificate = self._certificate(epoch, sealed.coverage, timings, sealed, tuple(receipts), lag)
            # Committed but not certified when this fails: acknowledge nothing; the next open finds
            # the sink ahead.
            await asyncio.to_thread(self.store.append_certificate, certificate, lease)
        except BaseException as exc:
            await self._drop(flight, exc)
            raise
        sessions.certify(epoch, sealed.coverage)
        flight.certified()

        # 6. Acknowledge the certified coverage (after the epoch before it), each provider
        # acknowledgement checked by the authority.
        fault_point(Point.AFTER_CERTIFICATE)
        try:
            await flight.may_acknowledge()
            async with sessions.turn:
                await source_session.acknowledge(sealed.coverage, self._authority)
        except BaseException as exc:
            await self._drop(flight, exc)
            lost = await self._lost_or(exc)
            if lost is exc:
                raise
            raise lost from exc
        flight.acknowledged()

        # 7. Report: the caller reports certificates from the store (never a precondition of step 6).
        finish = time.perf_counter() - read_end
        self._finish_seconds = max(finish, self._finish_seconds * 0.8)
        logger.info(
            "stream %s: certified %s (%s rows)", self.spec.name, epoch, sum(sealed.row_counts.values())
        )
        return certificate

    async def _adopt(
        self,
        epoch: EpochId,
        adopted: Coverage,
        lease: Lease,
        source_session: StreamSession,
        flight: Flight,
        timings: Stopwatch,
    ) -> EpochCertificate:
        """Steps 5 and 6 of an epoch the sink committed with no certificate naming it, for a source
        that cannot re-read it exactly: the sink's own watermark is the coverage, nothing is read."""
        certificate = self._certificate(epoch, adopted, timings)
        try:
            await asyncio.to_thread(self.store.append_certificate, certificate, lease)
            self._sessions.certify(epoch, adopted)
            async with self._sessions.turn:
                await source_session.acknowledge(adopted, self._authority)
        except BaseException as exc:
            await self._drop(flight, exc)
            raise
        flight.acknowledged()
        logger.warning("stream %s: certified %s from the destination's watermark", self.spec.name, epoch)
        return certificate

    def _certificate(
        self,
        epoch: EpochId,
        coverage: Coverage,
        timings: Stopwatch,
        sealed: SealedEpoch | None = None,
        receipts: tuple[Receipt, ...] = (),
        lag: tuple[SourceLag, ...] = (),
    ) -> EpochCertificate:
        """The certificate of ``epoch`` (an adopted one: no ``sealed`` epoch, no rows, no digest)."""
        return EpochCertificate(
            stream=self.spec.name,
            sequence=epoch.sequence,
            fencing_token=epoch.fencing_token,
            worker=self.worker_id,
            coverage=coverage.domains,
            receipts=receipts,
            row_counts={} if sealed is None else sealed.row_counts,
            digest="" if sealed is None else sealed.digest,
            delivery=self.plan.delivery,
            timings=timings.laps,
            created_at=datetime.now(UTC).isoformat(timespec="microseconds"),
            dead_lettered={} if sealed is None else sealed.dead_lettered,
            lag=lag,
            missing_fields={} if sealed is None else sealed.missing_fields,
            row_digests={} if sealed is None else sealed.row_digests,
            schemas={} if sealed is None else sealed.schemas,
        )

    # -- closing and handing over ---------------------------------------------------------------

    async def close(self, *, release: bool = True) -> None:
        """Stop the reader under a sensor (its open epoch sealed and certified at its next safe
        boundary: within ``HANDOVER_SEAL_SECONDS`` for a transactional sink, else rolled back; however
        long that takes for a sink whose writes cannot be taken back), close the sessions (joining
        outstanding reads and acknowledgements) and give the lease up.

        Waits for a call in progress to end first (interrupt it with :meth:`cancel`). A sink close
        that cannot promise no later effect raises :class:`UncertainOutcome` after the stream was
        marked uncertain in the store (no automatic takeover); the lease is then kept.
        """
        await self._reader.stop(seal_within=self._stop_seal)
        async with self._serialized():
            await self._close(release=release)

    def abandoned_effects(self) -> str | None:
        """Why abandoning this runner now (a process exiting before its close ended) could leave
        destination effects no certificate covers, or None when it cannot: a sink whose writes cannot
        be taken back has a session open. The caller then marks the stream uncertain."""
        sessions = self._sessions
        if self.final_applies and (sessions.sink is not None or sessions.closing_sink is not None):
            return (
                f"the process exited before its {self.spec.sink.connector_name} sink session closed: "
                "writes of its last epoch may have reached the destination without a certificate"
            )
        return None

    async def _close(self, *, release: bool, hand_over: bool = False) -> None:
        self._reads.forget_cancel()
        await self._sessions.drop(None)
        if release:
            await self._lease.release(hand_over=hand_over)
        else:
            self._lease.forget()

    @contextlib.asynccontextmanager
    async def _serialized(self) -> AsyncIterator[None]:
        """One call, reader, close or hand-over at a time, on the running loop."""
        loop = asyncio.get_running_loop()
        if self._serial is None or self._serial[0] is not loop:
            self._serial = (loop, asyncio.Lock())
        async with self._serial[1]:
            yield

    async def _hand_over(self, lease: Lease, requester: str) -> None:
        """Answer a hand-over request: stop at a certified position and release ``lease``."""
        logger.info("stream %s: handing the stream over to %s", self.spec.name, requester)
        await self._reader.stop(seal_within=HANDOVER_SEAL_SECONDS)
        self._interrupt_read()
        async with self._serialized():
            current = self._lease.current
            if current is None or current.fencing_token != lease.fencing_token:
                return
            try:
                await self._close(release=True, hand_over=True)
            except FaucetError as exc:
                logger.error("stream %s: closing for the hand-over failed: %s", self.spec.name, exc)

    def _interrupt_read(self) -> None:
        """Cancel the read in progress, if any (unlike :meth:`cancel`, never the next one)."""
        self._reads.interrupt()

    # -- around the commit order -------------------------------------------------------------

    async def _lost_or(self, failure: BaseException) -> BaseException:
        """The lease lost, when an acknowledgement ``failure`` came after it was (a process frozen
        between the authority's check and the provider's answer wakes to a provider that moved on: a
        PostgreSQL slot advanced past it refuses it); else ``failure``."""
        if isinstance(failure, OwnershipLost) or not isinstance(failure, FaucetError):
            return failure
        try:
            await self._lease.check()
        except OwnershipLost as lost:
            lost.add_note(f"the acknowledgement failed after the lease was lost: {failure}")
            return lost
        except FaucetError:
            pass
        return failure

    async def _authority(self) -> None:
        """The authority a source checks before every provider acknowledgement: the live lease."""
        await self._lease.check()
        fault_point(Point.DURING_ACK)

    async def _guard(
        self,
        step: Awaitable[T],
        epoch: EpochId,
        pipeline: EpochPipeline,
        flight: Flight,
        lagging: "asyncio.Future[Any] | None" = None,
    ) -> T:
        """Await a step before the commit; on failure abort the epoch and rewind (:meth:`_abort`)."""
        try:
            return await step
        except BaseException as exc:
            await self._abort(epoch, pipeline, flight, exc, lagging)
            raise

    async def _abort(
        self,
        epoch: EpochId,
        pipeline: EpochPipeline,
        flight: Flight,
        cause: BaseException,
        lagging: "asyncio.Future[Any] | None",
    ) -> None:
        """Before the commit, on failure: the lag's request and the epoch read ahead ended first,
        abort the epoch and rewind the source session."""
        if lagging is not None:
            await _cancelled(lagging)
        await flight.quiesce(failed=True)
        await self._sessions.abort(epoch, pipeline, rewind=True, cause=cause)
        self._forget_lost_lease(cause)
        flight.settle()

    async def _drop(self, flight: Flight, cause: BaseException, *, sessions: bool = True) -> None:
        """After the commit (or taking the lease), on failure: the epoch read ahead discarded first,
        drop both sessions (unless ``sessions`` is false)."""
        await flight.quiesce(failed=True)
        if sessions:
            await self._sessions.drop(cause)
        self._forget_lost_lease(cause)
        flight.settle()

    def _forget_lost_lease(self, cause: BaseException) -> None:
        """A lease found lost (an operator's release, a newer holder) is forgotten, so the next epoch,
        or the next reader, takes a new one instead of failing on the lost one again."""
        if isinstance(cause, OwnershipLost):
            self._lease.forget()


async def _cancelled(task: "asyncio.Future[Any]") -> None:
    """Cancel ``task`` and wait until it ended (its outcome is not wanted)."""
    task.cancel()
    await asyncio.wait([task])


__all__ = [
    "DEFAULT_EPOCH_LIMITS",
    "DEFAULT_LEASE_SECONDS",
    "CutShort",
    "Pending",
    "StoreDeadLetterRoute",
    "StreamRunner",
    "StreamSpec",
    "default_worker_id",
]
