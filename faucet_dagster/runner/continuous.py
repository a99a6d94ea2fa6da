"""The continuous runner: epochs sealed at safe source boundaries, committed, certified, then acknowledged.

:meth:`StreamRunner.run_epoch` is the single commit order of DESIGN.md section 4, in one function:

1. hold a current lease (renewed; its fencing token is part of the epoch id);
2. ``begin_epoch`` on the sink session;
3. ``read`` until a safe boundary that meets the limits; the pipeline flushes and seals;
4. ``commit_epoch`` -> receipts;
5. persist the epoch certificate in the state store;
6. ``acknowledge(coverage, authority)`` on the source session;
7. return the certificate; reporting it to Dagster is the caller's job (the sensor reports from the
   store, which remembers what was reported). Reporting never gates the acknowledgement.

Failures and interruptions:

* before 4 (read, seal, a refused commit): the epoch is aborted and the source session closed, so the
  next epoch reopens it at the certified positions (the rewind);
* a cancelled read never counts as a finished transaction: the epoch is aborted and rewound;
* between 4 and 6 (an uncertain commit, a certificate that could not be persisted): nothing is
  acknowledged and both sessions are dropped; the next open asks the sink what it last committed;
* on every open, the sink's ``last_committed()`` is reconciled with the last certificate: a sink one
  epoch ahead (a crash between 4 and 5) is recovered by reading again from the certified positions
  at least to the sink's watermark; the sink suppresses the rows it already holds, as it documents,
  and that epoch's certificate is persisted under the sequence the sink committed. A source that is
  not deterministic (its re-read would not give the rows the sink committed: a new snapshot, say) is
  not re-read into a sink with an atomic watermark: that epoch is certified from the sink's own
  watermark (coverage up to it; no receipts, no rows, an empty digest) and the source opens there;
* a close whose outcome is uncertain marks the stream uncertain in the store, which blocks every
  lease until an operator runs ``faucet streams release``.

Leases (DESIGN.md section 5, :mod:`.lease`): the lease is short (``lease_seconds``, 15 s by default)
and renewed in the background while the runner holds it, between calls too, so a worker that dies
(kill -9) is taken over within seconds. A hand-over request (a newer worker found the lease live)
interrupts a running read; once the epoch in progress has ended, the sessions are closed (everything
certified is acknowledged; the rest is replayed by the next owner) and the lease released.

A :class:`StreamRunner` keeps its sessions open across calls (sensor ticks), always on one event loop.

The ``fault_point(...)`` lines mark where the fault harness (:mod:`faucet_dagster.testing.faults`)
crashes or stops a worker; they do nothing unless a fault worker process armed one.
"""

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TypeVar

from faucet_dagster.pipeline import (
    DeadLetterRoute,
    EpochPipeline,
    Pipeline,
    PipelineOptions,
    ResourceSchema,
)
from faucet_dagster.pipeline.schema import BadRowPolicy
from faucet_dagster.planner import Plan, plan
from faucet_dagster.protocol import (
    CancelToken,
    Coverage,
    Delivery,
    DomainCoverage,
    EpochCertificate,
    EpochId,
    FaucetError,
    IntegrityError,
    Membership,
    Mode,
    OwnershipLost,
    Position,
    ReadLimits,
    RejectedRecord,
    SinkCommitState,
    SourceLag,
    StreamingSink,
    StreamingSinkSession,
    StreamSession,
    StreamSource,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
    compare_positions,
)
from faucet_dagster.runner.faults import Point, fault_point
from faucet_dagster.runner.lease import StreamLease
from faucet_dagster.state import Lease, StateStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

LAG_TIMEOUT = 5.0
"""Seconds the source may take to say where its head is (``StreamSession.lag``) after an epoch's read."""
DEFAULT_EPOCH_LIMITS = ReadLimits(records=50_000, bytes=None, idle=1.0, age=10.0)
DEFAULT_LEASE_SECONDS = 15.0
MIN_FINISH_RESERVE = 0.5
"""Seconds of a budget always kept for sealing, committing, certifying and acknowledging."""


@dataclass(frozen=True)
class StreamSpec:
    """One continuous stream: its source and sink, what is read, how it is written, how epochs end.

    ``schemas`` declares resources' schemas (others are inferred; every resource is keyed by
    ``key``). ``limits`` are the per-epoch read targets. ``lease_seconds`` is how long a lease lives
    without renewal (the runner renews it in the background every third of that): how long a
    worker that died without releasing it holds the stream up.
    """

    name: str
    source: StreamSource
    sink: StreamingSink
    resources: tuple[str, ...]
    policy: WritePolicy = WritePolicy.APPEND
    key: tuple[str, ...] = ()
    schemas: Mapping[str, ResourceSchema] = field(default_factory=dict)
    default_schema: ResourceSchema | None = None
    delivery: Delivery | None = None
    limits: ReadLimits = DEFAULT_EPOCH_LIMITS
    membership: Membership = field(default_factory=Membership)
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)

    @property
    def dead_letter(self) -> bool:
        """True when some resource routes bad rows to the dead-letter route."""
        specs = [*self.schemas.values(), self.default_schema or ResourceSchema()]
        return any(spec.on_bad_row is BadRowPolicy.DEAD_LETTER for spec in specs)


class StoreDeadLetterRoute(DeadLetterRoute):
    """Dead letters kept in the state store, keyed by event identity (a replay stores nothing twice)."""

    def __init__(self, store: StateStore, stream: str) -> None:
        self._store = store
        self._stream = stream

    async def route(self, epoch: EpochId, records: Sequence[RejectedRecord]) -> None:
        await asyncio.to_thread(self._store.record_dead_letters, self._stream, epoch.sequence, records)

    async def withdraw(self, epoch: EpochId, records: Sequence[RejectedRecord]) -> None:
        await asyncio.to_thread(self._store.withdraw_dead_letters, self._stream, records)


@dataclass(frozen=True)
class CutShort:
    """An epoch its deadline interrupted after it had read rows, before a safe boundary: nothing of it
    was certified, and the next read starts again at the certified positions. Repeated, it means the
    source cannot reach a boundary within one budget (a source transaction larger than a tick reads)
    and the stream makes no progress until the budget grows."""

    epoch: EpochId
    rows: int
    seconds: float

    def describe(self) -> str:
        return (
            f"epoch {self.epoch.sequence} read {self.rows} rows in {self.seconds:.1f}s without reaching a "
            "safe source boundary (an open source transaction) before the budget ended; nothing was "
            "certified. If this repeats, one source transaction is larger than a tick can read: give "
            "the stream a larger budget (budget_seconds, DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS)"
        )


def default_worker_id() -> str:
    """A worker id unique to this process instance (a restarted process is a new worker)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class StreamRunner:
    """Runs one stream's epochs, keeping the source and sink sessions open between calls.

    Not thread-safe: one caller at a time, always on the same event loop (the sessions' clients are
    bound to it). ``cancel`` is the exception: any thread may call it to interrupt the current read.
    Epochs and :meth:`close` are serialized on the loop with the lease keeper, which hands the stream
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
            self.started,
            on_handover=self._hand_over,
            on_lost=self._interrupt_read,
        )
        self._source_session: StreamSession | None = None
        self._sink_session: StreamingSinkSession | None = None
        self._sessions_token: int | None = None
        self._certified: tuple[Position, ...] = ()
        self._next_sequence = 0
        self._recover_to: tuple[Position, ...] = ()
        # The coverage of an epoch the sink committed before its certificate, to certify as the sink
        # holds it: for a source whose re-read would not give the same rows (see the module docstring).
        self._adopted: Coverage | None = None
        self._adopts = (
            not spec.source.capabilities().deterministic and spec.sink.capabilities().atomic_watermark
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cancel: CancelToken | None = None
        self._cancel_requested = False
        self._cancel_lock = threading.Lock()
        self.cut_short: CutShort | None = None
        """The epoch the deadline of the latest :meth:`run_epochs` interrupted after it read rows
        (None: no epoch of that call was cut short)."""
        self._serial: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._finish_seconds = 1.0  # until measured: a fresh process's first tick keeps room too
        """The slowest recent seal-to-acknowledgement time (decaying): what a budget keeps for it."""

    def cancel(self) -> None:
        """Interrupt the current read, or the next one if none is running: its epoch is aborted and
        nothing is certified (``run_epoch`` returns None). Thread-safe."""
        with self._cancel_lock:
            token, loop = self._cancel, self._loop
            if token is not None and loop is not None:
                loop.call_soon_threadsafe(token.cancel)
            else:
                self._cancel_requested = True

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
            return await self._run_epoch(limits or self.spec.limits, deadline)

    async def _run_epoch(self, limits: ReadLimits, deadline: float | None) -> EpochCertificate | None:
        """:meth:`run_epoch`, serialized: the one commit order."""
        timings = _Stopwatch()
        started = time.perf_counter()

        # 1. Hold a current lease: its fencing token goes into the epoch id and the sessions.
        try:
            lease = await self._lease.hold(deadline)
        except OwnershipLost as exc:
            await self._drop_sessions(exc)
            raise
        source_session, sink_session = await self._open_sessions(lease)
        epoch = EpochId(self.spec.name, self._next_sequence, lease.fencing_token)
        timings.lap("lease")
        adopted, self._adopted = self._adopted, None
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
                self._certified = _advance(self._certified, adopted)
                self._next_sequence = epoch.sequence + 1
                await source_session.acknowledge(adopted, self._authority)
            except BaseException as exc:
                await self._drop_sessions(exc)
                raise
            logger.warning("stream %s: certified %s from the destination's watermark", self.spec.name, epoch)
            return certificate

        # 2. Begin the epoch at the sink.
        await self._guard(sink_session.begin_epoch(epoch), epoch, None)
        timings.lap("begin")

        # 3. Read until a safe boundary that meets the limits; the pipeline flushes and seals.
        pipeline = self._pipeline.begin(epoch, sink_session, self._certified)
        coverage = await self._guard(self._read(source_session, pipeline, limits, deadline), epoch, pipeline)
        if coverage is None or (coverage.empty and not pipeline.has_evidence):
            # Cancelled, or nothing new: nothing to commit. A session that moved is rewound.
            cut = coverage is None and deadline is not None and asyncio.get_running_loop().time() >= deadline
            if cut and pipeline.rows_written:
                self.cut_short = CutShort(epoch, pipeline.rows_written, time.perf_counter() - started)
            await self._abort(epoch, pipeline, rewind=pipeline.has_evidence)
            return None
        read_end = time.perf_counter()
        sealed = await self._guard(pipeline.seal(coverage), epoch, pipeline)
        timings.lap("read_and_seal")
        lag = await self._source_lag(source_session)

        # 4. Commit at the sink: durable as the policy promises once it returns.
        fault_point(Point.BEFORE_SINK_COMMIT)
        try:
            receipts = await sink_session.commit_epoch(epoch, sealed.coverage)
        except UncertainOutcome as exc:
            # It may have committed: never abort it, never acknowledge; the next open reconciles.
            await self._drop_sessions(exc)
            raise
        except BaseException as exc:
            await self._abort(epoch, pipeline, rewind=True, cause=exc)
            raise
        timings.lap("commit")
        fault_point(Point.AFTER_SINK_COMMIT)

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
        )
        try:
            await asyncio.to_thread(self.store.append_certificate, certificate, lease)
        except BaseException as exc:
            # Committed but not certified: acknowledge nothing; the next open finds the sink ahead.
            await self._drop_sessions(exc)
            raise
        self._certified = _advance(self._certified, sealed.coverage)
        self._next_sequence = epoch.sequence + 1
        if self._recover_to:
            logger.warning(
                "stream %s: recovered epoch %s committed before its certificate", self.spec.name, epoch
            )
            self._recover_to = ()

        # 6. Acknowledge the certified coverage, each provider acknowledgement checked by the authority.
        fault_point(Point.AFTER_CERTIFICATE)
        try:
            await source_session.acknowledge(sealed.coverage, self._authority)
        except BaseException as exc:
            await self._drop_sessions(exc)
            raise

        # 7. Report: the caller reports certificates from the store (never a precondition of step 6).
        finish = time.perf_counter() - read_end
        self._finish_seconds = max(finish, self._finish_seconds * 0.8)
        logger.info(
            "stream %s: certified %s (%s rows)", self.spec.name, epoch, sum(sealed.row_counts.values())
        )
        return certificate

    async def close(self, *, release: bool = True) -> None:
        """Close the sessions (joining outstanding reads and acknowledgements) and give the lease up.

        Waits for an epoch in progress to end first (interrupt it with :meth:`cancel`). A sink close
        that cannot promise no later effect raises :class:`UncertainOutcome` after the stream was
        marked uncertain in the store (no automatic takeover); the lease is then kept.
        """
        async with self._serialized():
            await self._close(release=release)

    async def _close(self, *, release: bool, hand_over: bool = False) -> None:
        self._cancel_requested = False
        await self._drop_sessions(None)
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

    # -- the steps ------------------------------------------------------------------------------

    async def _open_sessions(self, lease: Lease) -> tuple[StreamSession, StreamingSinkSession]:
        """The open sessions for ``lease``'s token; (re)opened at the certified positions if needed.

        Opening reconciles the sink's last commit with the last certificate.
        """
        if self._sessions_token is not None and self._sessions_token != lease.fencing_token:
            await self._drop_sessions(None)
        worker = WorkerIdentity(self.worker_id, lease.fencing_token)
        if self._sink_session is None:
            last = await asyncio.to_thread(self.store.last_certificate, self.spec.name)
            self._certified = await asyncio.to_thread(self.store.certified_positions, self.spec.name)
            self._next_sequence = (last.sequence if last else 0) + 1
            session = await self.spec.sink.open(self.spec.name, self.spec.policy, self.spec.key, worker)
            self._sink_session = session
            self._sessions_token = lease.fencing_token
            try:
                self._recover_to = self._reconcile(await session.last_committed())
            except BaseException as exc:
                await self._drop_sessions(exc)
                raise
            if self._recover_to and self._adopts:
                certified = {position.domain.lineage: position.value for position in self._certified}
                self._adopted = Coverage(
                    tuple(
                        DomainCoverage(
                            position.domain, certified.get(position.domain.lineage), position.value
                        )
                        for position in self._recover_to
                    )
                )
                self._recover_to = ()
        if self._source_session is None:
            resume = self._certified if self._adopted is None else _advance(self._certified, self._adopted)
            self._source_session = await self.spec.source.open(
                self.spec.resources, resume, self.spec.membership, worker
            )
            self._sessions_token = lease.fencing_token
        return self._source_session, self._sink_session

    def _reconcile(self, committed: SinkCommitState | None) -> tuple[Position, ...]:
        """Compare the sink's last commit with the certificates; return the watermark to recover to.

        Empty when the sink is not ahead (or cannot say). Raises :class:`IntegrityError` when the
        sink and the certificates disagree in a way no crash explains.
        """
        if committed is None:
            return ()
        last = self._next_sequence - 1
        sequence = committed.epoch.sequence
        where = self.spec.name
        if sequence > last + 1 or sequence < last:
            raise IntegrityError(
                f"the destination last committed epoch {committed.epoch}, the last certificate is {last}: "
                "certificates or destination data were lost or restored",
                where=where,
            )
        certified = {position.domain.lineage: position for position in self._certified}
        # Only the domains the uncertified epoch moved past their certified position are recovered:
        # a sink may report every domain it holds, and an epoch may cover some of them only.
        ahead: list[Position] = []
        for watermark in committed.watermarks:
            position = certified.get(watermark.domain.lineage)
            order = 1 if position is None else compare_positions(watermark, position)
            if order > 0:
                ahead.append(watermark)
            if sequence == last and order != 0:
                raise IntegrityError(
                    f"the destination's watermark {watermark.value} in {watermark.domain} differs from "
                    f"the certified position {position.value if position else None}",
                    where=where,
                )
            if sequence == last + 1 and order < 0:
                raise IntegrityError(
                    f"the destination committed epoch {committed.epoch} behind the certified position "
                    f"in {watermark.domain}",
                    where=where,
                )
        if sequence == last:
            return ()
        logger.warning(
            "stream %s: the destination committed epoch %s but no certificate was persisted; recovering it",
            self.spec.name,
            committed.epoch,
        )
        return tuple(ahead) or committed.watermarks

    async def _read(
        self, session: StreamSession, pipeline: EpochPipeline, limits: ReadLimits, deadline: float | None
    ) -> Coverage | None:
        """Read to a safe boundary (while recovering, on to the sink's watermark); None when cancelled."""
        loop = asyncio.get_running_loop()
        token = CancelToken()
        with self._cancel_lock:
            self._loop, self._cancel = loop, token
            if self._cancel_requested:
                self._cancel_requested = False
                token.cancel()
        timer = None if deadline is None else loop.call_at(deadline, token.cancel)
        try:
            coverage = await session.read(pipeline, limits, token)
            while self._recover_to and not token.cancelled and not _reaches(coverage, self._recover_to):
                more = await session.read(pipeline, limits, token)
                if more.empty:
                    logger.warning(
                        "stream %s: the source has nothing more, short of the destination's watermark; "
                        "the recovery is tried again on the next run",
                        self.spec.name,
                    )
                    return None
                coverage = _merge(coverage, more)
        finally:
            if timer is not None:
                timer.cancel()
            with self._cancel_lock:
                self._cancel = None
        # Cancellation is an interruption, never evidence that a transaction or the recovery ended.
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

    # -- failure handling -----------------------------------------------------------------------

    async def _guard(self, step: Awaitable[T], epoch: EpochId, pipeline: EpochPipeline | None) -> T:
        """Await a step before the commit; on failure abort the epoch, rewind, and re-raise."""
        try:
            return await step
        except BaseException as exc:
            await self._abort(epoch, pipeline, rewind=True, cause=exc)
            raise

    async def _abort(
        self,
        epoch: EpochId,
        pipeline: EpochPipeline | None,
        *,
        rewind: bool,
        cause: BaseException | None = None,
    ) -> None:
        """Abort ``epoch`` at the sink; with ``rewind``, close the source session so it reopens at the
        certified positions. Failures while cleaning up are attached to ``cause`` (or raised)."""
        if pipeline is not None:
            inflight = await pipeline.discard()
            if inflight is not None and cause is not None and inflight is not cause:
                cause.add_note(f"a batch in flight failed too: {inflight!r}")
        sink_session = self._sink_session
        if sink_session is not None:
            try:
                await sink_session.abort_epoch(epoch)
            except FaucetError as exc:
                if cause is None:
                    await self._drop_sessions(exc)
                    raise
                cause.add_note(f"aborting epoch {epoch} failed too: {exc}")
                await self._drop_sessions(cause)
                return
        if rewind:
            await self._close_source(cause)

    async def _close_source(self, cause: BaseException | None) -> None:
        session, self._source_session = self._source_session, None
        if session is None:
            return
        try:
            await session.close()
        except FaucetError as exc:
            if cause is None:
                raise
            cause.add_note(f"closing the source session failed too: {exc}")

    async def _drop_sessions(self, cause: BaseException | None) -> None:
        """Close both sessions. An uncertain sink close marks the stream uncertain in the store.

        With a ``cause`` (already failing), close failures are attached to it; without, raised.
        """
        await self._close_source(cause)
        session, self._sink_session = self._sink_session, None
        self._sessions_token = None
        self._recover_to = ()
        self._adopted = None
        if session is None:
            return
        try:
            await session.close_session()
        except UncertainOutcome as exc:
            await asyncio.to_thread(self.store.mark_uncertain, self.spec.name, exc.message)
            if cause is None:
                raise
            cause.add_note(f"closing the sink session was uncertain; the stream is marked uncertain: {exc}")
        except FaucetError as exc:
            if cause is None:
                raise
            cause.add_note(f"closing the sink session failed too: {exc}")


class _Stopwatch:
    """Seconds spent in each step of an epoch, for its certificate."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._last, 6)
        self._last = now


def _advance(certified: tuple[Position, ...], coverage: Coverage) -> tuple[Position, ...]:
    """The certified positions after ``coverage`` was certified."""
    positions = {position.domain.lineage: position for position in certified}
    for position in coverage.end_positions():
        positions[position.domain.lineage] = position
    return tuple(positions.values())


def _reaches(coverage: Coverage, targets: Sequence[Position]) -> bool:
    """True when ``coverage`` ends at or past every target position."""
    ends = {position.domain.lineage: position for position in coverage.end_positions()}
    for target in targets:
        end = ends.get(target.domain.lineage)
        if end is None or compare_positions(end, target) < 0:
            return False
    return True


def _merge(first: Coverage, then: Coverage) -> Coverage:
    """Two reads of one epoch as one coverage: each domain from its first start to its last end."""
    merged = {item.domain: item for item in first.domains}
    for item in then.domains:
        earlier = merged.get(item.domain)
        merged[item.domain] = (
            item if earlier is None else DomainCoverage(item.domain, earlier.start, item.end)
        )
    return Coverage(tuple(merged.values()))
