"""The streaming contract: source sessions that read to safe boundaries, sinks that commit epochs.

The continuous runner repeats one epoch (DESIGN.md section 4): it begins an epoch on the sink session,
reads from the source session until a safe boundary, seals the epoch in the pipeline, commits it at
the sink, persists its certificate, and only then acknowledges the source. The types here are the
contract between the runner, the pipeline and a connector:

* a :class:`StreamSource` opens a reusable :class:`StreamSession` at certified positions;
* ``StreamSession.read`` writes typed rows and ordered controls into a :class:`StreamRecordSink` (the
  pipeline) and returns the :class:`Coverage` it reached: candidates until certified;
* ``StreamSession.acknowledge`` runs only after certification, checking ``authority()`` before every
  provider acknowledgement;
* ``StreamSession.lag`` (optional) says how far the reads are behind the source's head, as
  :class:`SourceLag` values the certificate carries;
* a :class:`StreamingSink` opens a :class:`StreamingSinkSession` whose epochs are begun, applied,
  committed (returning :class:`Receipt` values) or aborted.
"""

import asyncio
import json
import zlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from faucet_dagster.protocol.bounded import PartialResult
from faucet_dagster.protocol.capabilities import Delivery, SinkCapabilities, SourceCapabilities, WritePolicy
from faucet_dagster.protocol.errors import DataError, UnsupportedOperation
from faucet_dagster.protocol.positions import EventIdentity, OrderingDomain, Position, PositionCodec
from faucet_dagster.protocol.records import Records

Authority = Callable[[], Awaitable[None]]
"""Confirms this worker still owns the stream; raises OwnershipLost when it does not."""


@dataclass(frozen=True)
class ReadLimits:
    """Targets for where a read should look for a safe boundary; never places to cut a transaction.

    A read returns at the first safe boundary after any limit is reached: ``records`` rows,
    ``bytes`` of payload, ``idle`` seconds with nothing new, or ``age`` seconds since the read began.
    A source transaction in progress when a limit is reached is finished first.
    """

    records: int | None = None
    bytes: int | None = None
    idle: float | None = 1.0
    age: float | None = None


class CancelToken:
    """A cooperative interruption: the runner cancels, a read notices and returns or raises.

    Cancellation is an interruption, never evidence that a source transaction ended: a read that is
    cancelled inside a transaction returns no coverage past the transaction's begin.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass(frozen=True)
class TransactionBegin:
    """A source transaction starts in ``domain``; its rows follow."""

    domain: OrderingDomain
    transaction_id: str


@dataclass(frozen=True)
class TransactionEnd:
    """The source transaction ended; ``position`` (its commit position) is a safe boundary."""

    domain: OrderingDomain
    transaction_id: str
    position: str


@dataclass(frozen=True)
class ProgressBoundary:
    """``position`` is a safe place to resume in ``domain``, outside any transaction."""

    domain: OrderingDomain
    position: str


Control = TransactionBegin | TransactionEnd | ProgressBoundary


@dataclass(frozen=True)
class Identities:
    """The event identities of a run of rows in one domain, held column-wise (one per row).

    ``positions[i]`` is the canonical position of row ``i``; ``ordinals[i]`` tells apart rows sharing
    a position (``None`` means every ordinal is 0).
    """

    positions: Sequence[str]
    ordinals: Sequence[int] | None = None

    def __len__(self) -> int:
        return len(self.positions)

    def at(self, domain: OrderingDomain, index: int) -> EventIdentity:
        ordinal = 0 if self.ordinals is None else self.ordinals[index]
        return EventIdentity(domain, self.positions[index], ordinal)


@dataclass(frozen=True)
class RejectedRecord:
    """A source record that cannot become a row (its payload is not JSON, not an object, not text).

    ``identity`` is the record's stable event identity, ``where`` names it for people (``topic orders
    partition 2 offset 1042``), ``payload`` is the raw bytes as the provider delivered them.
    """

    identity: EventIdentity
    reason: str
    payload: bytes
    where: str
    resource: str | None = None


class StreamRecordSink(ABC):
    """Where a source session writes during ``read``: the pipeline, in the order of the calls.

    ``write`` may block for a long time under backpressure (the sink is slow); a source keeps its
    provider's heartbeats and delivery renewals alive while it waits.
    """

    @abstractmethod
    async def write(
        self,
        domain: OrderingDomain,
        rows: Records,
        identities: Identities,
        *,
        resource: str | None = None,
    ) -> None:
        """Hand over rows read from ``domain`` (for ``resource``, default ``domain.resource``).

        ``identities`` has one entry per row. Returns when the rows are accepted by the pipeline;
        they are not yet written anywhere durable.
        """

    @abstractmethod
    async def control(self, control: Control) -> None:
        """Record a transaction boundary or a progress boundary, in order with the rows.

        Flushes the builders of the affected domain and waits for the preceding sink writes and
        integrity checks. Does not commit the epoch and does not acknowledge the provider.
        """

    async def reject(self, record: RejectedRecord) -> None:
        """Hand over a record that cannot become a row, in order with the rows of its domain.

        A source calls this only when its own policy sends such records to the dead-letter route; a
        sink with such a route stores the record (durably before the epoch commits) and returns, and
        the source reads on, its coverage including the record's position. The default has no route:
        it raises :class:`DataError` naming the record, so nothing is ever dropped silently.
        """
        raise DataError(
            f"no dead-letter route for a record that cannot become a row: {record.reason}",
            where=record.where,
        )


@dataclass(frozen=True)
class DomainCoverage:
    """What a read (or an epoch) covered in one domain: after ``start`` up to and including ``end``.

    ``start`` is the certified position the read resumed after (``None``: the domain's beginning).
    """

    domain: OrderingDomain
    start: str | None
    end: str


@dataclass(frozen=True)
class Coverage:
    """The positions a read reached, per domain. Candidates until the epoch is certified."""

    domains: tuple[DomainCoverage, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.domains

    def end_positions(self) -> tuple[Position, ...]:
        return tuple(Position(item.domain, item.end) for item in self.domains)


@dataclass(frozen=True)
class WorkerIdentity:
    """The admitted worker: who it is and the fencing token of the lease it holds."""

    worker_id: str
    fencing_token: int


@dataclass(frozen=True)
class Membership:
    """Which partitions of the selected resources this worker owns, by stable hashing.

    With ``members == 1`` the worker owns everything. The assignment depends only on the resource
    and partition names, so every worker computes the same split.
    """

    member: int = 0
    members: int = 1

    def __post_init__(self) -> None:
        if self.members < 1 or not 0 <= self.member < self.members:
            raise DataError(f"membership {self.member} of {self.members} is not valid")

    def owns(self, resource: str, partition: str) -> bool:
        if self.members == 1:
            return True
        return zlib.crc32(f"{resource}/{partition}".encode()) % self.members == self.member


@dataclass(frozen=True)
class SourceLag:
    """How far a session's reads are behind the source's head in one domain, measured after a read.

    ``position`` is where the reads reached (``None``: nothing read yet), ``head`` the source's newest
    position (its last stored message or record, its current WAL position; ``None``: it holds nothing
    yet), both as the source writes positions. ``behind`` counts
    what lies between in the source's own ``unit`` (``"messages"``, ``"offsets"``, ``"WAL bytes"``): 0
    is caught up. ``seconds`` is how much older the event at ``position`` is than the one at ``head``,
    where the source knows both times (``None`` where it does not; 0 when caught up).
    """

    domain: OrderingDomain
    position: str | None
    head: str | None
    behind: int
    unit: str
    seconds: float | None = None

    def describe(self) -> str:
        """For people: ``120 messages (1.5s) behind in <domain>``."""
        seconds = "" if self.seconds is None else f" ({self.seconds:.1f}s)"
        return f"{self.behind} {self.unit}{seconds} behind in {self.domain}"


class StreamSession(ABC):
    """A reusable session on a source, opened at certified positions.

    The runner alternates ``read`` and ``acknowledge``; it never calls two methods concurrently, and
    ``close`` joins any outstanding read or acknowledgement first.
    """

    @abstractmethod
    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        """Read onwards from where the previous read ended, writing rows and controls into ``sink``.

        Returns when a safe boundary is reached after a limit, or when cancelled. The returned
        coverage ends only at positions for which a boundary was sent through ``sink.control``; a
        source proves it skipped no input on the way (gaps raise :class:`IntegrityError`). Blocks on
        the provider and on ``sink`` backpressure, keeping provider heartbeats alive meanwhile.
        Never acknowledges anything.
        """

    @abstractmethod
    async def acknowledge(self, coverage: Coverage, authority: Authority) -> None:
        """Acknowledge certified ``coverage`` to the provider.

        Called only after the epoch covering it was committed at the sink and its certificate
        persisted. Awaits ``authority()`` before every provider acknowledgement (including
        redeliveries it suppresses as already certified); an :class:`OwnershipLost` from it stops the
        acknowledgement and propagates. Idempotent for coverage already acknowledged.
        """

    @abstractmethod
    async def close(self) -> None:
        """Join any outstanding read or acknowledgement, then release the provider session.

        Unacknowledged records stay with the provider and are delivered again on the next open.
        """

    async def lag(self) -> tuple[SourceLag, ...]:
        """How far the positions the reads reached are behind the source's head, per domain read.

        Called by the runner right after a read (never concurrently with another method), and
        recorded in the epoch's certificate. Informational only: it never gates a commit or an
        acknowledgement, and a failure (a typed :class:`FaucetError`) is logged and the lag left
        out; one slower than the runner's ``LAG_TIMEOUT`` is cancelled, which the session survives as
        it survives a cancelled read. A read of the head should be cheap (one metadata request) and
        must not move what the session reads or acknowledges. The default reports nothing, for
        sources that cannot tell.
        """
        return ()

    @property
    def exhausted(self) -> bool:
        """True once a bounded session has delivered everything it will ever deliver.

        A session whose source capabilities say ``bounded`` ends at a fixed point (chosen when it
        opened); after the read that reaches it, this is True and every further read returns empty
        coverage at once. A continuous session is never exhausted (the default).
        """
        return False


class StreamSource(ABC):
    """A continuous source: declares capabilities and codecs, opens sessions at certified positions."""

    connector_name: str

    @abstractmethod
    def capabilities(self) -> SourceCapabilities:
        """What this configured source emits and guarantees. Pure: no I/O."""

    @abstractmethod
    def codecs(self) -> Sequence[PositionCodec[Any]]:
        """The codecs of this source's positions (also registered under ``faucet.position_codecs``)."""

    async def check(self) -> None:
        """Optional preflight (``faucet check``): connect, authenticate and verify that what the
        config names exists; raise a FaucetError naming why not. The default checks nothing."""

    @abstractmethod
    async def open(
        self,
        resources: Sequence[str],
        resume_positions: Sequence[Position],
        membership: Membership,
        worker: WorkerIdentity,
    ) -> StreamSession:
        """Open a session reading ``resources`` after ``resume_positions`` (the certified ones).

        A domain without a resume position starts at its beginning. A resume position the provider
        no longer has raises :class:`PositionUnavailable`; a position of another incarnation raises
        :class:`IncarnationChanged`. Never falls back to the latest position.
        """

    async def replay(self, coverage: "DomainCoverage", sink: StreamRecordSink, cancel: CancelToken) -> None:
        """Re-read exactly one certified range, for ``faucet verify``: every record of
        ``coverage.domain`` after ``coverage.start`` (``None``: the domain's beginning) up to and
        including ``coverage.end``, written into ``sink`` as ``StreamSession.read`` writes it: the
        same decoding, resources and event identities, records that cannot become rows through
        ``sink.reject`` (or the DataError the source's policy raises). Controls are optional; the
        caller ends the range itself.

        Side-effect free: acknowledges nothing, never moves a consumer group's or a durable
        consumer's state, and uses nothing a live session of the stream uses. Returns once the whole
        range was written; writes nothing outside it; a record it cannot account for raises
        :class:`IntegrityError`. Raises :class:`PositionUnavailable` when the source no longer holds
        part of the range (retention, a purge, a truncated log, a replication slot that confirmed
        it), :class:`IncarnationChanged` when the domain's source was deleted and recreated since,
        and :class:`UnsupportedOperation` (this default) when the connector cannot re-read a range.
        Returns early, having written a prefix of the range, when ``cancel`` is cancelled.
        """
        raise UnsupportedOperation(
            f"the {self.connector_name} stream source cannot re-read a certified range",
            where=str(coverage.domain),
        )


@dataclass(frozen=True, order=True)
class EpochId:
    """One epoch of one stream: its sequence and the fencing token of the lease that runs it."""

    stream: str
    sequence: int
    fencing_token: int

    def __str__(self) -> str:
        return f"{self.stream}#{self.sequence}@{self.fencing_token}"


@dataclass(frozen=True)
class SinkBatch:
    """Sealed, integrity-checked records for one resource, bound to the epoch they belong to."""

    epoch: EpochId
    resource: str
    domain: OrderingDomain
    records: pa.RecordBatch
    identities: Identities


@dataclass(frozen=True)
class Receipt:
    """What a committed epoch did to one destination resource.

    ``rows_skipped`` counts replayed rows the destination suppressed (at or below its watermark, or
    deduplicated by event identity). ``details`` holds destination facts (first and last stream
    sequence, the transaction id), never secrets.
    """

    resource: str
    rows_written: int
    rows_skipped: int = 0
    details: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SinkCommitState:
    """What the sink last committed for a stream: the epoch and the per-domain watermark positions."""

    epoch: EpochId
    watermarks: tuple[Position, ...]


class StreamingSinkSession(ABC):
    """One sink session: ``begin_epoch``, ``apply`` batches, then ``commit_epoch`` or ``abort_epoch``.

    Calls are serialized by the runner. A lifecycle call out of order (begin twice, commit without
    begin, apply after commit) raises :class:`LifecycleError`; a batch for another epoch raises
    :class:`EpochMismatch`.
    """

    @abstractmethod
    async def last_committed(self) -> SinkCommitState | None:
        """Read back, durably, what this stream last committed here (``None``: nothing yet)."""

    @abstractmethod
    async def begin_epoch(self, epoch: EpochId) -> None:
        """Start ``epoch``; a transactional sink opens its transaction here."""

    @abstractmethod
    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        """Apply ``batch`` tentatively within the active epoch (NATS: publish and collect acks)."""

    async def apply_partial(self, epoch: EpochId, batch: SinkBatch) -> PartialResult:
        """Apply ``batch`` as :meth:`apply` does, except the rows the destination refuses for a
        row-level reason (a constraint, a value its column type refuses): those are left out and
        reported by their index in ``batch`` with the destination's reason, for the dead-letter route.
        The epoch stays usable (the refused rows left nothing behind).

        The pipeline calls it for resources whose bad rows go to the dead-letter route (a sink
        declaring ``partial_results`` overrides it); the default applies the batch whole.
        """
        await self.apply(epoch, batch)
        return PartialResult(written=batch.records.num_rows)

    @abstractmethod
    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        """Commit the epoch together with the watermark of ``coverage``.

        When it returns, the writes have reached the durability the policy promises and the receipts
        describe the completed work. A sink with owner fencing checks ``epoch.fencing_token`` against
        the destination atomically with the commit and raises :class:`OwnershipLost` if stale. An
        unknown outcome (connection lost during commit) is resolved by reading the watermark back,
        else raises :class:`UncertainOutcome`.
        """

    @abstractmethod
    async def abort_epoch(self, epoch: EpochId) -> None:
        """Discard the epoch's tentative effects. Cannot undo what the destination already accepted
        (published messages) nor earlier committed epochs; each connector documents which."""

    @abstractmethod
    async def close_session(self) -> None:
        """End the session. Returning means no later destination effect from it is possible; when
        that is uncertain (a request could still land), raises :class:`UncertainOutcome`."""


class StreamingSink(ABC):
    """A continuous sink: declares capabilities and opens sessions for one stream."""

    connector_name: str

    @abstractmethod
    def capabilities(self) -> SinkCapabilities:
        """What this configured sink can apply and promise. Pure: no I/O."""

    async def check(self) -> None:
        """Optional preflight (``faucet check``): connect, authenticate and verify access; raise a
        FaucetError naming why not. The default checks nothing."""

    @abstractmethod
    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> StreamingSinkSession:
        """Open a session writing ``stream``'s epochs with ``policy`` (keyed by ``key`` when needed)."""


@dataclass(frozen=True)
class EpochCertificate:
    """The durable record that an epoch was committed at the sink: what it covered and wrote.

    Persisted before the source is acknowledged; shown as asset metadata in Dagster. Holds no
    secrets: resources and positions only. ``row_counts`` counts the rows handed to the sink per
    resource; ``dead_lettered`` the rows routed to the dead-letter route instead, per resource.
    ``lag`` is how far the source's head was ahead of the epoch's coverage when its read ended (empty
    when the source cannot tell). ``missing_fields`` counts, per resource and field, the rows whose
    record lacked that field of the resource's schema (null there, or refused by a strict schema):
    a field that stops arriving shows here. ``row_digests`` are, per resource, the digest of the rows
    handed to the sink that a replay of the coverage recomputes (:class:`faucet_dagster.pipeline.RowDigests`:
    independent of how rows were batched and interleaved; empty in a certificate written before
    they existed), and ``schemas`` a fingerprint of the Arrow schema each resource's rows had.
    """

    stream: str
    sequence: int
    fencing_token: int
    worker: str
    coverage: tuple[DomainCoverage, ...]
    receipts: tuple[Receipt, ...]
    row_counts: Mapping[str, int]
    digest: str
    delivery: Delivery
    timings: Mapping[str, float] = field(default_factory=dict)
    created_at: str = ""
    dead_lettered: Mapping[str, int] = field(default_factory=dict)
    lag: tuple[SourceLag, ...] = ()
    missing_fields: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    row_digests: Mapping[str, str] = field(default_factory=dict)
    schemas: Mapping[str, str] = field(default_factory=dict)

    @property
    def epoch(self) -> EpochId:
        return EpochId(self.stream, self.sequence, self.fencing_token)

    @property
    def certificate_id(self) -> str:
        return f"{self.stream}:{self.sequence:020d}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "EpochCertificate":
        raw = json.loads(text)
        return cls(
            stream=raw["stream"],
            sequence=raw["sequence"],
            fencing_token=raw["fencing_token"],
            worker=raw["worker"],
            coverage=tuple(
                DomainCoverage(OrderingDomain(**item["domain"]), item["start"], item["end"])
                for item in raw["coverage"]
            ),
            receipts=tuple(
                Receipt(item["resource"], item["rows_written"], item["rows_skipped"], item["details"])
                for item in raw["receipts"]
            ),
            row_counts=raw["row_counts"],
            digest=raw["digest"],
            delivery=Delivery(raw["delivery"]),
            timings=raw["timings"],
            created_at=raw["created_at"],
            dead_lettered=raw.get("dead_lettered", {}),
            lag=tuple(
                SourceLag(
                    OrderingDomain(**item["domain"]),
                    item["position"],
                    item["head"],
                    item["behind"],
                    item["unit"],
                    item["seconds"],
                )
                for item in raw.get("lag", ())
            ),
            missing_fields=raw.get("missing_fields", {}),
            row_digests=raw.get("row_digests", {}),
            schemas=raw.get("schemas", {}),
        )
