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
drive it, never mixed on one runner:

* :meth:`run_epoch`: one epoch per call, read in the call, nothing read ahead (tests, tools);
* :meth:`run_epochs`: epochs back to back, pipelined, within a budget (workers, benchmarks);
* :meth:`tick`: under a sensor (:mod:`.reader`). The first tick starts a reader on the runner's event
  loop that runs pipelined epochs back to back, each sealed when it is due; a tick does not wait for
  any of it and says what is not certified yet. A source transaction spans as many epochs' worth of
  time as it needs.

Failures and interruptions (:mod:`.sessions` holds the sessions):

* before 4 (read, seal, a refused commit): the epoch is aborted and the source session closed, so the
  next epoch reopens it at the certified positions (the rewind); an epoch read ahead is discarded
  first (:meth:`.pipelined.Flight.quiesce`), so the rewind covers it;
* a cancelled read never counts as a finished transaction: the epoch is aborted and rewound; a process
  that dies with an open epoch leaves nothing of it at a transactional sink, and the next owner reads
  it again from the certified positions;
* between 4 and 6 (an uncertain commit, a certificate that could not be persisted): nothing is
  acknowledged and both sessions are dropped; the next open asks the sink what it last committed;
* on every open, the sink's ``last_committed()`` is reconciled with the last certificate
  (:func:`.recovery.reconcile`): a sink one epoch ahead (a crash between 4 and 5) is recovered by
  reading again from the certified positions at least to the sink's watermark; the sink suppresses
  the rows it already holds, as it documents, and that epoch's certificate is persisted under the
  sequence the sink committed. A source that is not deterministic is not re-read into a sink with an
  atomic watermark: that epoch is certified from the sink's own watermark (coverage up to it; no
  receipts, no rows, an empty digest) and the source opens there;
* a close whose outcome is uncertain marks the stream uncertain in the store, which blocks every
  lease until an operator runs ``faucet streams release``.

Leases (DESIGN.md section 5, :mod:`.lease`): the lease is short (``lease_seconds``, 15 s by default)
and renewed in the background while the runner holds it, between calls and ticks too, so a worker that
dies (kill -9) is taken over within seconds. A hand-over request (a newer worker found the lease live)
seals the open epoch if it reaches a boundary within ``HANDOVER_SEAL_SECONDS`` (else interrupts it);
then the sessions are closed (everything certified is acknowledged; the rest is replayed by the next
owner) and the lease passed on. A close seals the open epoch the same way; for a sink whose writes
cannot be taken back (``durability`` other than transactional: NATS publishes during ``apply``) it waits
for the boundary however long it takes, so nothing it wrote is replayed after its duplicate window.

The ``fault_point(...)`` lines mark where the fault harness (:mod:`faucet_dagster.testing.faults`)
crashes or stops a worker; they do nothing unless a fault worker process armed one.
"""

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from faucet_dagster.pipeline import DeadLetterRoute, EpochPipeline, Pipeline, ResourceSchema
from faucet_dagster.planner import Plan, plan
from faucet_dagster.protocol import (
    CancelToken,
    Coverage,
    Durability,
    EpochCertificate,
    EpochId,
    FaucetError,
    Mode,
    OwnershipLost,
    ReadLimits,
    SourceLag,
    StreamSession,
    UncertainOutcome,
)
from faucet_dagster.runner.epoch_reads import read_to_limits
from faucet_dagster.runner.faults import Point, fault_point
from faucet_dagster.runner.lease import StreamLease
from faucet_dagster.runner.open_epoch import EpochClock, Pending
from faucet_dagster.runner.pipelined import Flight, pipelined
from faucet_dagster.runner.reader import Reader
from faucet_dagster.runner.recovery import Stopwatch, advance
from faucet_dagster.runner.sessions import StreamSessions
from faucet_dagster.runner.spec import (
    DEFAULT_EPOCH_LIMITS,
    DEFAULT_LEASE_SECONDS,
    CutShort,
    StoreDeadLetterRoute,
    StreamSpec,
    default_worker_id,
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
        self.plan: Plan = plan(
            spec.source.capabilities(),
            spec.sink.capabilities(),
            Mode.CONTINUOUS,
            spec.policy,
            spec.key,
            delivery=spec.delivery,
            durable_state=True,
            dead_letter=spec.dead_letter,
        )
        schemas = {name: replace(schema, key=schema.key or spec.key) for name, schema in spec.schemas.items()}
        default = spec.default_schema or ResourceSchema()
        self._pipeline = Pipeline(
            schemas,
            default_schema=replace(default, key=default.key or spec.key),
            # Always a route: a source whose own policy dead-letters undecodable records needs one too.
            dead_letters=dead_letters or StoreDeadLetterRoute(store, spec.name),
            options=spec.pipeline,
        )
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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cancel: CancelToken | None = None
        self._cancel_requested = False
        self._cancel_lock = threading.Lock()
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
        nothing is certified (``run_epoch`` returns None); a reader between ticks stops. Thread-safe."""
        self._reader.clock.stopping = True
        with self._cancel_lock:
            token, loop = self._cancel, self._loop
            if token is not None and loop is not None:
                loop.call_soon_threadsafe(token.cancel)
            else:
                self._cancel_requested = True

    # -- epochs in calls ------------------------------------------------------------------------

    async def run_epochs(
        self, budget_seconds: float, limits: ReadLimits | None = None
    ) -> list[EpochCertificate]:
        """Run epochs, pipelined, until ``budget_seconds`` are spent or the source has nothing new;
        each read to ``limits`` (default: the stream's).

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
                    else:
                        certificates.append(outcome)
            finally:
                await epochs.aclose()
        if not certificates and self.cut_short is not None:
            logger.warning("stream %s: %s", self.spec.name, self.cut_short.describe())
        return certificates

    async def run_epoch(
        self, limits: ReadLimits | None = None, *, deadline: float | None = None
    ) -> EpochCertificate | None:
        """Run one epoch in the commit order, nothing read ahead; return its certificate, or None
        when nothing was certified.

        None means the source had nothing new, or the read was cancelled (``cancel``, ``deadline``, a
        time on the running loop's clock, or a hand-over), and the epoch was aborted. Every failure
        is raised after the epoch was aborted and rewound (before the commit) or the sessions dropped
        (after it). ``deadline`` also bounds the wait for a hand-over.
        """
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
        certified yet. Epochs are sealed in the background when due (about a second old, full, or
        a stop), committed, certified and acknowledged; the tick does not wait for them, and the
        sensor reports the certificates from the store.

        Returns None when the reader holds nothing it has not certified, else what is pending (an
        open epoch with rows, an epoch being committed, the reader starting or waiting for a lease).
        The first tick (and the first after the reader failed or stopped) starts the reader and waits
        at most ``starting_budget`` (default ``budget_seconds``) for it to take the lease and open the
        sessions (:attr:`started` says the tick did that); a lease held by a worker this one asked to
        hand over (one killed cannot answer) is waited for beyond the tick, up to the lease's length,
        and ``Pending.lease_wait`` says so. A failure of the reader is raised by the next tick, once.
        The reader stops (its open epoch sealed and certified first, its lease released) when no tick
        came for ``stop_after`` seconds. ``interval`` (the sensor's minimum interval: the next tick
        comes that many seconds after this one at the earliest) bounds how long a closing process goes
        on reading while it waits for a newer one to take the stream over (:meth:`linger`).
        """
        return await self._reader.tick(
            budget_seconds, stop_after=stop_after, starting_budget=starting_budget, interval=interval
        )

    @property
    def reading(self) -> bool:
        """True while the background reader runs (a sensor ticks this runner)."""
        return self._reader.running

    async def linger(self, longest: float) -> None:
        """Go on reading, at most ``longest`` seconds, until a newer worker takes the stream over (a
        hand-over) or the next tick is overdue (the tick interval after the last one, plus
        ``LINGER_MARGIN_SECONDS``): what a process that is about to exit does, so the stream does not
        stand still between its exit and the first tick of the process that replaces it (the daemon
        replaces its code servers every 60 s; the old one exits about 20 s later, the new one's first
        tick may come up to an interval after the last). Returns at once when no reader runs."""
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
        except OwnershipLost as exc:
            await flight.quiesce(failed=True)
            await sessions.drop(exc)
            flight.settle()
            raise
        except BaseException:
            await flight.quiesce(failed=True)
            flight.settle()
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
            reading = self._read(source_session, pipeline, limits, deadline, flight)
        else:
            clock.begun(epoch, pipeline, asyncio.get_running_loop().time())
            reading = self._read_open(clock, source_session, pipeline, flight)
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
        lagging = asyncio.ensure_future(self._source_lag(source_session))
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
            await _cancelled(lagging)
            await flight.quiesce(failed=True)
            await sessions.abort(epoch, pipeline, rewind=True, cause=exc)
            flight.settle()
            raise
        timings.lap("commit")
        flight.committed()
        fault_point(Point.AFTER_SINK_COMMIT)

        # 5. Persist the certificate: from here on, the epoch is certified.
        try:
            lag = await lagging  # cancelled: committed, not certified; the next open reconciles
            certificate = EpochCertificate(
                stream=self.spec.name,
                sequence=epoch.sequence,
                fencing_token=epoch.fencing_token,
                worker=self.worker_id,
                coverage=sealed.coverage.domains,
                receipts=tuple(receipts),
                row_counts=sealed.row_counts,
                digest=sealed.digest,
                delivery=self.plan.delivery,
                timings=timings.laps,
                created_at=datetime.now(UTC).isoformat(timespec="microseconds"),
                dead_lettered=sealed.dead_lettered,
                lag=lag,
            )
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
            raise
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
        certificate = EpochCertificate(
            stream=self.spec.name,
            sequence=epoch.sequence,
            fencing_token=epoch.fencing_token,
            worker=self.worker_id,
            coverage=adopted.domains,
            receipts=(),
            row_counts={},
            digest="",
            delivery=self.plan.delivery,
            timings=timings.laps,
            created_at=datetime.now(UTC).isoformat(timespec="microseconds"),
        )
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
        self._cancel_requested = False
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
        with self._cancel_lock:
            token, loop = self._cancel, self._loop
            if token is not None and loop is not None:
                loop.call_soon_threadsafe(token.cancel)

    # -- the reads ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _cancellable(self, flight: Flight) -> Iterator[CancelToken]:
        """A cancel token for the reads of one epoch, reachable by :meth:`cancel` meanwhile (and by
        the epoch before it, which interrupts it when it fails)."""
        token = CancelToken()
        with self._cancel_lock:
            self._loop, self._cancel = asyncio.get_running_loop(), token
            if self._cancel_requested:
                self._cancel_requested = False
                token.cancel()
        flight.reading(token)
        try:
            yield token
        finally:
            with self._cancel_lock:
                if self._cancel is token:
                    self._cancel = None

    async def _read(
        self,
        session: StreamSession,
        pipeline: EpochPipeline,
        limits: ReadLimits,
        deadline: float | None,
        flight: Flight,
    ) -> Coverage | None:
        """Read to a safe boundary (while recovering, on to the sink's watermark); None when cancelled."""
        with self._cancellable(flight) as token:
            loop = asyncio.get_running_loop()
            timer = None if deadline is None else loop.call_at(deadline, token.cancel)
            try:
                coverage = await read_to_limits(
                    self._sessions, session, pipeline, limits, token, flight, self.spec.name
                )
            finally:
                if timer is not None:
                    timer.cancel()
        # Cancellation is an interruption, never evidence that a transaction or the recovery ended.
        return None if token.cancelled else coverage

    async def _read_open(
        self, clock: EpochClock, session: StreamSession, pipeline: EpochPipeline, flight: Flight
    ) -> Coverage | None:
        """Read into the open epoch under a sensor until it is due; None when cancelled."""
        sessions = self._sessions

        async def read(into: EpochPipeline, limits: ReadLimits, cancel: CancelToken) -> Coverage:
            return await sessions.read(session, into, limits, cancel)

        with self._cancellable(flight) as token:
            coverage = await clock.read(read, pipeline, token, sessions.recover_to)
        return None if token.cancelled else coverage

    async def _source_lag(self, session: StreamSession) -> tuple[SourceLag, ...]:
        """How far the source's head is past this epoch's read, for its certificate, in the source
        session's turn. Informational: bounded by ``LAG_TIMEOUT`` and never failing the epoch (a
        failure is logged, the lag left out)."""
        async with self._sessions.turn:
            try:
                return await asyncio.wait_for(session.lag(), LAG_TIMEOUT)
            except (FaucetError, TimeoutError) as exc:
                logger.warning("stream %s: the source's lag is unknown: %r", self.spec.name, exc)
                return ()

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
        """Await a step before the commit; on failure (the epoch read ahead discarded first) abort
        the epoch, rewind, and re-raise."""
        try:
            return await step
        except BaseException as exc:
            if lagging is not None:
                await _cancelled(lagging)
            await flight.quiesce(failed=True)
            await self._sessions.abort(epoch, pipeline, rewind=True, cause=exc)
            flight.settle()
            raise

    async def _drop(self, flight: Flight, cause: BaseException) -> None:
        """After the commit, on failure (the epoch read ahead discarded first): drop both sessions."""
        await flight.quiesce(failed=True)
        await self._sessions.drop(cause)
        flight.settle()


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
