"""The continuous runner: epochs sealed at safe source boundaries, committed, certified, then acknowledged.

:meth:`StreamRunner._run_epoch` is the single commit order of DESIGN.md section 4, in one function:

1. hold a current lease (renewed when a third of it has passed; its fencing token is part of the epoch id);
2. ``begin_epoch`` on the sink session;
3. ``read`` until a safe boundary: in one call until one that meets the limits (:meth:`run_epoch`), or,
   between sensor ticks, until a tick asks for a seal (:meth:`tick`, :mod:`.open_epoch`); the pipeline
   flushes and seals;
4. ``commit_epoch`` -> receipts;
5. persist the epoch certificate in the state store;
6. ``acknowledge(coverage, authority)`` on the source session;
7. return the certificate; reporting it to Dagster is the caller's job (the sensor reports from the
   store, which remembers what was reported). Reporting never gates the acknowledgement.

Two ways to drive it, never mixed on one runner:

* :meth:`run_epoch` / :meth:`run_epochs`: one epoch (or several, within a budget) per call, read in
  the call (workers, benchmarks, tests);
* :meth:`tick`: under a sensor. The first tick starts a reader task on the runner's event loop that
  runs epochs back to back, reading into the open epoch *between* ticks (its first epoch is sealed
  after one read, for that first tick, even when taking the lease outlasted it); each tick asks for a
  seal and waits (within its budget) for the epoch to be sealed at its next safe boundary,
  committed, certified and acknowledged. A tick lasts a seal and a commit, not a read; a source
  transaction spans as many ticks as it needs (:mod:`.open_epoch`).

Failures and interruptions (:mod:`.sessions` holds the sessions):

* before 4 (read, seal, a refused commit): the epoch is aborted and the source session closed, so the
  next epoch reopens it at the certified positions (the rewind);
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
owner) and the lease passed on.

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

from faucet_dagster.pipeline import DeadLetterRoute, EpochPipeline
from faucet_dagster.planner import Plan, plan
from faucet_dagster.protocol import (
    CancelToken,
    Coverage,
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
from faucet_dagster.runner.faults import Point, fault_point
from faucet_dagster.runner.lease import StreamLease
from faucet_dagster.runner.open_epoch import EpochClock, Pending
from faucet_dagster.runner.recovery import Stopwatch, merge, reaches
from faucet_dagster.runner.sessions import StreamSessions
from faucet_dagster.runner.spec import (
    DEFAULT_EPOCH_LIMITS,
    DEFAULT_LEASE_SECONDS,
    CutShort,
    StoreDeadLetterRoute,
    StreamSpec,
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
HANDOVER_SEAL_SECONDS = 1.5
"""How long a hand-over waits for the open epoch to reach a boundary and be certified before it
interrupts it (its rows are then read again by the next owner). Well inside the time a newer worker
waits for the hand-over (``lease.HANDOVER_WAIT_SECONDS``, or its tick's budget if shorter)."""


class StreamRunner:
    """Runs one stream's epochs, keeping the source and sink sessions open between calls.

    One caller at a time, always on the same event loop (the sessions' clients are bound to it).
    ``cancel`` is the exception: any thread may call it to interrupt the current read. Epochs, ticks'
    reader and :meth:`close` are serialized on the loop with the lease keeper, which hands the stream
    over between two epochs. ``started`` (seconds since 1970, default: now) orders workers for
    hand-overs: a runner created later takes a stream over from a live earlier one.
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
        self.started = time.time() if started is None else started
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
        # Always a route: a source whose own policy dead-letters undecodable records needs one too.
        self._pipeline = stream_pipeline(spec, dead_letters or StoreDeadLetterRoute(store, spec.name))
        self._lease = StreamLease(
            store,
            spec.name,
            self.worker_id,
            spec.lease_seconds,
            self.started,
            on_handover=self._hand_over,
            on_lost=self._interrupt_read,
        )
        self._sessions = StreamSessions(spec, store, self.worker_id)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cancel: CancelToken | None = None
        self._cancel_requested = False
        self._cancel_lock = threading.Lock()
        self.cut_short: CutShort | None = None
        """The epoch the deadline of the latest :meth:`run_epochs` interrupted after it read rows
        (None: no epoch of that call was cut short; epochs read between ticks are never cut short)."""
        self.started = False
        """Whether the latest :meth:`tick` started the reader (this process's first, or after one ended)."""
        self._serial: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._finish_seconds = 1.0  # until measured: a fresh process's first call keeps room too
        """The slowest recent seal-to-acknowledgement time (decaying): what a budget keeps for it."""
        self._clock = EpochClock(spec.limits)
        self._reader: asyncio.Task[None] | None = None
        self._reader_failure: BaseException | None = None

    def cancel(self) -> None:
        """Interrupt the current read, or the next one if none is running: its epoch is aborted and
        nothing is certified (``run_epoch`` returns None); a reader between ticks stops. Thread-safe."""
        self._clock.stopping = True
        with self._cancel_lock:
            token, loop = self._cancel, self._loop
            if token is not None and loop is not None:
                loop.call_soon_threadsafe(token.cancel)
            else:
                self._cancel_requested = True

    # -- epochs in one call -----------------------------------------------------------------------

    async def run_epochs(self, budget_seconds: float) -> list[EpochCertificate]:
        """Run epochs until ``budget_seconds`` are spent or the source has nothing new.

        Reads end early enough for the seal, commit, certificate and acknowledgement to fit in the
        budget too: the time kept for them is twice the slowest recent one (at least
        ``MIN_FINISH_RESERVE``, at most a quarter of the budget). A read still going when its time is up is
        cancelled (that epoch is aborted and :attr:`cut_short` says so if it had read rows). Returns
        the certificates, in order. Raises the first failure (certificates persisted before it stay
        persisted).
        """
        loop = asyncio.get_running_loop()
        reserve = min(budget_seconds / 4, max(MIN_FINISH_RESERVE, 2 * self._finish_seconds))
        deadline = loop.time() + budget_seconds - reserve
        certificates: list[EpochCertificate] = []
        self.cut_short = None
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            age = (
                remaining * 0.75
                if self.spec.limits.age is None
                else min(self.spec.limits.age, remaining * 0.75)
            )
            certificate = await self.run_epoch(replace(self.spec.limits, age=age), deadline=deadline)
            if certificate is None:
                break
            certificates.append(certificate)
        if not certificates and self.cut_short is not None:
            logger.warning("stream %s: %s", self.spec.name, self.cut_short.describe())
        return certificates

    async def run_epoch(
        self, limits: ReadLimits | None = None, *, deadline: float | None = None
    ) -> EpochCertificate | None:
        """Run one epoch in the commit order; return its certificate, or None when nothing was certified.

        None means the source had nothing new, or the read was cancelled (``cancel``, ``deadline``, a
        time on the running loop's clock, or a hand-over), and the epoch was aborted. Every failure
        is raised after the epoch was aborted and rewound (before the commit) or the sessions dropped
        (after it). ``deadline`` also bounds the wait for a hand-over.
        """
        async with self._serialized():
            return await self._run_epoch(limits or self.spec.limits, deadline, None)

    # -- epochs that span ticks -------------------------------------------------------------------

    async def tick(
        self,
        budget_seconds: float,
        *,
        stop_after: float | None = None,
        starting_budget: float | None = None,
        interval: float | None = None,
    ) -> Pending | None:
        """One sensor tick: seal the open epoch at its next safe boundary and wait, within
        ``budget_seconds``, until it is committed, certified and acknowledged. Returns None when done,
        or what was still pending when the budget ended (the reader goes on; a later tick reports the
        certificate). In a backlog the reader seals each full epoch itself, tick or not, so a tick does
        not wait for more than its own seal: under a serial daemon a tick that waited out its budget
        while full epochs kept coming would hold up every other sensor, and drain nothing faster.

        The first tick (and the first after a failure) starts the reader, and its seal request is the
        reader's first: the reader takes the lease, opens the sessions, reads once and seals, so a new
        process certifies on its first tick when that fits the budget. A lease held by a worker this
        one asked to hand over (one killed cannot answer) is waited for beyond the tick, up to the
        lease's length; the first epoch is then sealed and certified as soon as it is taken, without
        waiting for the next tick, which reports it. A failure of the reader is
        raised by the next tick, once; the tick after it starts a new reader. The reader stops when
        no tick came for ``stop_after`` seconds (its open epoch is aborted and its lease released).
        A tick that starts the reader waits at most ``starting_budget`` (default: ``budget_seconds``);
        its seal request stands, so the first epoch is sealed after the reader's first read and
        certified in the background (:attr:`started` says the tick did that). ``interval`` says the
        next tick comes that many seconds after this one at the earliest (a sensor's minimum interval):
        the reader reads in long slices until shortly before then, and in short ones after it, so the
        next tick's seal waits a fraction of a second (without it, every read is a short one). The
        certificates are in the store; the sensor reports them from there.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_seconds
        clock = self._clock
        clock.ticked(loop.time(), interval, stop_after)
        self.cut_short = None
        self.started = False
        if self._reader is None or self._reader.done():
            failure, self._reader_failure, self._reader = self._reader_failure, None, None
            if failure is not None:
                raise failure
            clock.stopping = clock.stopped_idle = False
            clock.since = loop.time()
            self._reader = loop.create_task(self._read_between_ticks(), name=f"faucet-read-{self.spec.name}")
            self.started = True
            if starting_budget is not None:
                deadline = min(deadline, loop.time() + starting_budget)
        reader = self._reader
        target = clock.request()
        while clock.served < target:
            if reader.done():
                failure, self._reader_failure = self._reader_failure, None
                if failure is not None:
                    raise failure
                return self._pending(loop.time())
            left = deadline - loop.time()
            if left <= 0:
                return self._pending(loop.time())
            await clock.wait(left)
        return None

    def _pending(self, now: float) -> Pending:
        return replace(self._clock.pending(now), lease_wait=self._lease.waiting)

    async def _read_between_ticks(self) -> None:
        """The reader: epochs back to back, each read between ticks until a tick seals it."""
        clock = self._clock
        try:
            while not clock.stopping:
                clock.phase = "starting"
                try:
                    async with self._serialized():
                        await self._run_epoch(self.spec.limits, None, clock)
                finally:
                    clock.ended()
        except Exception as exc:  # noqa: BLE001 - handed to the next tick, which raises it
            self._reader_failure = exc
        finally:
            clock.changed()
        if clock.stopped_idle:
            logger.warning(
                "stream %s: no tick for %.0fs; the open epoch was rolled back and the lease released",
                self.spec.name,
                clock.stop_after or 0.0,
            )
            async with self._serialized():
                await self._close(release=True)

    async def _stop_reader(self, *, seal_within: float = 0.0) -> None:
        """Stop the reader (if it runs, and it is not the caller): with ``seal_within``, first let the
        open epoch be sealed and certified if that takes no longer; then interrupt it (rolled back)."""
        reader = self._reader
        if reader is None or reader is asyncio.current_task():
            return
        clock = self._clock
        if seal_within > 0 and not reader.done():
            loop = asyncio.get_running_loop()
            ends, target = loop.time() + seal_within, clock.request()
            while clock.served < target and not reader.done() and loop.time() < ends:
                await clock.wait(ends - loop.time())
        clock.stopping = True
        clock.changed()
        self._interrupt_read()
        await asyncio.wait([reader])
        self._reader = None
        self._reader_failure = None

    # -- the one commit order ---------------------------------------------------------------------

    async def _run_epoch(
        self, limits: ReadLimits, deadline: float | None, clock: EpochClock | None
    ) -> EpochCertificate | None:
        """One epoch, serialized: the one commit order. ``clock`` set: read between ticks until a
        tick asks for the seal (:meth:`EpochClock.read`); else read in this call to the limits."""
        timings = Stopwatch()
        started = time.perf_counter()
        sessions = self._sessions

        # 1. Hold a current lease: its fencing token goes into the epoch id and the sessions. A reader
        # between ticks waits out a holder it asked to hand over (one killed cannot answer), its tick
        # reporting the wait; the seal that tick asked for is then served without waiting for another.
        try:
            lease = await self._lease.hold(deadline, patient=None if clock is None else clock.going)
        except OwnershipLost as exc:
            await sessions.drop(exc)
            raise
        source_session, sink_session = await sessions.open(lease)
        epoch = EpochId(self.spec.name, sessions.next_sequence, lease.fencing_token)
        timings.lap("lease")
        adopted, sessions.adopted = sessions.adopted, None
        if adopted is not None:
            # The sink committed this epoch, no certificate names it, and the source cannot re-read it
            # exactly: steps 5 and 6 with the sink's own watermark as the coverage, nothing read.
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
                sessions.certify(epoch, adopted)
                await source_session.acknowledge(adopted, self._authority)
            except BaseException as exc:
                await sessions.drop(exc)
                raise
            logger.warning("stream %s: certified %s from the destination's watermark", self.spec.name, epoch)
            return certificate

        # 2. Begin the epoch at the sink.
        await self._guard(sink_session.begin_epoch(epoch), epoch, None)
        timings.lap("begin")

        # 3. Read until a safe boundary (the limits, or a tick's seal); the pipeline flushes and seals.
        pipeline = self._pipeline.begin(epoch, sink_session, sessions.certified)
        if clock is None:
            reading = self._read(source_session, pipeline, limits, deadline)
        else:
            clock.begun(epoch, pipeline, asyncio.get_running_loop().time())
            reading = self._read_open(clock, source_session, pipeline)
        coverage = await self._guard(reading, epoch, pipeline)
        if coverage is None or (coverage.empty and not pipeline.has_evidence):
            # Cancelled, or nothing new: nothing to commit. A session that moved is rewound.
            cut = coverage is None and deadline is not None and asyncio.get_running_loop().time() >= deadline
            if clock is None and cut and pipeline.rows_written:
                self.cut_short = CutShort(epoch, pipeline.rows_written, time.perf_counter() - started)
            await sessions.abort(epoch, pipeline, rewind=pipeline.has_evidence)
            return None
        read_end = time.perf_counter()
        sealed = await self._guard(pipeline.seal(coverage), epoch, pipeline)
        timings.lap("read_and_seal")
        # The source's lag (informational, for the certificate) is asked while the sink commits.
        lagging = asyncio.ensure_future(self._source_lag(source_session))

        # 4. Commit at the sink: durable as the policy promises once it returns.
        fault_point(Point.BEFORE_SINK_COMMIT)
        try:
            receipts = await sink_session.commit_epoch(epoch, sealed.coverage)
        except UncertainOutcome as exc:
            # It may have committed: never abort it, never acknowledge; the next open reconciles.
            await _cancelled(lagging)
            await sessions.drop(exc)
            raise
        except BaseException as exc:
            await _cancelled(lagging)
            await sessions.abort(epoch, pipeline, rewind=True, cause=exc)
            raise
        timings.lap("commit")
        fault_point(Point.AFTER_SINK_COMMIT)
        try:
            lag = await lagging
        except BaseException as exc:  # cancelled: committed, not certified; the next open reconciles
            await sessions.drop(exc)
            raise

        # 5. Persist the certificate: from here on, the epoch is certified.
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
            row_digests=sealed.row_digests,
            schemas=sealed.schemas,
        )
        try:
            await asyncio.to_thread(self.store.append_certificate, certificate, lease)
        except BaseException as exc:
            # Committed but not certified: acknowledge nothing; the next open finds the sink ahead.
            await sessions.drop(exc)
            raise
        sessions.certify(epoch, sealed.coverage)

        # 6. Acknowledge the certified coverage, each provider acknowledgement checked by the authority.
        fault_point(Point.AFTER_CERTIFICATE)
        try:
            await source_session.acknowledge(sealed.coverage, self._authority)
        except BaseException as exc:
            await sessions.drop(exc)
            raise

        # 7. Report: the caller reports certificates from the store (never a precondition of step 6).
        finish = time.perf_counter() - read_end
        self._finish_seconds = max(finish, self._finish_seconds * 0.8)
        logger.info(
            "stream %s: certified %s (%s rows)", self.spec.name, epoch, sum(sealed.row_counts.values())
        )
        return certificate

    # -- closing and handing over ----------------------------------------------------------------

    async def close(self, *, release: bool = True) -> None:
        """Stop the reader between ticks (its open epoch is rolled back), close the sessions (joining
        outstanding reads and acknowledgements) and give the lease up.

        Waits for an epoch in progress to end first (interrupt it with :meth:`cancel`). A sink close
        that cannot promise no later effect raises :class:`UncertainOutcome` after the stream was
        marked uncertain in the store (no automatic takeover); the lease is then kept.
        """
        await self._stop_reader()
        async with self._serialized():
            await self._close(release=release)

    async def _close(self, *, release: bool, hand_over: bool = False) -> None:
        self._cancel_requested = False
        await self._sessions.drop(None)
        if release:
            await self._lease.release(hand_over=hand_over)
        else:
            self._lease.forget()

    @contextlib.asynccontextmanager
    async def _serialized(self) -> AsyncIterator[None]:
        """One epoch, close or hand-over at a time, on the running loop."""
        loop = asyncio.get_running_loop()
        if self._serial is None or self._serial[0] is not loop:
            self._serial = (loop, asyncio.Lock())
        async with self._serial[1]:
            yield

    async def _hand_over(self, lease: Lease, requester: str) -> None:
        """Answer a hand-over request: stop at a certified position and release ``lease``."""
        logger.info("stream %s: handing the stream over to %s", self.spec.name, requester)
        await self._stop_reader(seal_within=HANDOVER_SEAL_SECONDS)
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

    # -- the reads --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _cancellable(self) -> Iterator[CancelToken]:
        """A cancel token for the reads of one epoch, reachable by :meth:`cancel` meanwhile."""
        token = CancelToken()
        with self._cancel_lock:
            self._loop, self._cancel = asyncio.get_running_loop(), token
            if self._cancel_requested:
                self._cancel_requested = False
                token.cancel()
        try:
            yield token
        finally:
            with self._cancel_lock:
                self._cancel = None

    async def _read(
        self, session: StreamSession, pipeline: EpochPipeline, limits: ReadLimits, deadline: float | None
    ) -> Coverage | None:
        """Read to a safe boundary (while recovering, on to the sink's watermark); None when cancelled."""
        recover_to = self._sessions.recover_to
        with self._cancellable() as token:
            loop = asyncio.get_running_loop()
            timer = None if deadline is None else loop.call_at(deadline, token.cancel)
            try:
                coverage = await session.read(pipeline, limits, token)
                while recover_to and not token.cancelled and not reaches(coverage, recover_to):
                    more = await session.read(pipeline, limits, token)
                    if more.empty:
                        logger.warning(
                            "stream %s: the source has nothing more, short of the destination's watermark; "
                            "the recovery is tried again on the next run",
                            self.spec.name,
                        )
                        return None
                    coverage = merge(coverage, more)
            finally:
                if timer is not None:
                    timer.cancel()
        # Cancellation is an interruption, never evidence that a transaction or the recovery ended.
        return None if token.cancelled else coverage

    async def _read_open(
        self, clock: EpochClock, session: StreamSession, pipeline: EpochPipeline
    ) -> Coverage | None:
        """Read into the open epoch between ticks until a tick asks for the seal; None when cancelled."""
        with self._cancellable() as token:
            coverage = await clock.read(session, pipeline, token, self._sessions.recover_to)
        return None if token.cancelled else coverage

    async def _source_lag(self, session: StreamSession) -> tuple[SourceLag, ...]:
        """How far the source's head is past this epoch's read, for its certificate. Informational:
        bounded by ``LAG_TIMEOUT`` and never failing the epoch (a failure is logged, the lag left out)."""
        try:
            return await asyncio.wait_for(session.lag(), LAG_TIMEOUT)
        except (FaucetError, TimeoutError) as exc:
            logger.warning("stream %s: the source's lag is unknown: %r", self.spec.name, exc)
            return ()

    async def _authority(self) -> None:
        """The authority a source checks before every provider acknowledgement: the live lease."""
        await self._lease.check()
        fault_point(Point.DURING_ACK)

    async def _guard(self, step: Awaitable[T], epoch: EpochId, pipeline: EpochPipeline | None) -> T:
        """Await a step before the commit; on failure abort the epoch, rewind, and re-raise."""
        try:
            return await step
        except BaseException as exc:
            await self._sessions.abort(epoch, pipeline, rewind=True, cause=exc)
            raise


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
