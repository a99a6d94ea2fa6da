"""The pipeline of one epoch: rows and controls in, integrity-checked batches to the sink, then a seal.

A :class:`Pipeline` lives as long as a stream's sessions (it keeps each resource's schema, declared or
inferred on first use). For each epoch the runner calls :meth:`Pipeline.begin`, hands the returned
:class:`EpochPipeline` to ``StreamSession.read`` as its :class:`StreamRecordSink`, and finally calls
:meth:`EpochPipeline.seal` with the coverage the read returned.

What holds, and where it is enforced:

* ``write`` buffers rows per (resource, domain) builder; a builder holding ``batch_rows`` rows is
  converted to Arrow, checked (:func:`~faucet_dagster.pipeline.integrity.check_batch`), added to the
  epoch digest and handed to ``StreamingSinkSession.apply``. At most one ``apply`` is in flight: the
  next flush waits for it, which is the backpressure a slow sink puts on the source.
* Rows that do not fit their resource's schema go where :class:`BadRowPolicy` says, at flush time and
  so before the epoch can commit: a :class:`DataError` naming the row, or the dead-letter route.
  Under ``dead_letter`` batches go to ``StreamingSinkSession.apply_partial``, and the rows the
  destination refuses (a constraint, a value its column type refuses) are routed too, with the
  destination's reason, before the batch counts as applied (so before the epoch can commit); an epoch
  discarded (aborted) withdraws them (``DeadLetterRoute.withdraw``), so they are kept only with the
  epoch's commit.
* A control (``TransactionBegin``, ``TransactionEnd``, ``ProgressBoundary``) flushes the builders of
  its domain and waits for every preceding ``apply``; only then is a boundary *accepted*. An epoch
  read ahead (``begin_after``: the runner reads it while the epoch before it commits, and a sink
  session has one active epoch) is begun at the sink by its pipeline once ``begin_after()`` returned;
  until then its batches are held in order (up to ``PipelineOptions.read_ahead_bytes``) and a control
  accepts its boundary once they are held: ``seal`` applies every held batch before it vouches for
  anything, so no coverage is certified whose rows did not reach the sink.
* Positions only move forward within a domain, rows come after the certified start position and
  after the domain's last accepted boundary, and a boundary is never before the last row before it.
* ``seal`` refuses (with :class:`IntegrityError`) an epoch with an open transaction, rows after the
  last accepted boundary of their domain, or coverage that does not end exactly at each domain's last
  accepted boundary: a position the pipeline has no evidence for is never certified.
"""

import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from faucet_dagster.pipeline.builder import Builder, convert_chunks, row_at
from faucet_dagster.pipeline.domain import DomainState
from faucet_dagster.pipeline.integrity import EpochDigest, RowDigests, check_batch
from faucet_dagster.pipeline.schema import (
    BadRow,
    BadRowPolicy,
    ResourceSchema,
    RowConverter,
    row_payload,
)
from faucet_dagster.pipeline.writer import SinkWriter
from faucet_dagster.protocol import (
    CodecRegistry,
    ConfigError,
    Control,
    Coverage,
    DataError,
    EpochId,
    EventIdentity,
    FaucetError,
    Identities,
    IncarnationChanged,
    IntegrityError,
    LifecycleError,
    OrderingDomain,
    PartialResult,
    Position,
    ProgressBoundary,
    Records,
    RejectedRecord,
    SinkBatch,
    StreamingSinkSession,
    StreamRecordSink,
    TransactionBegin,
    TransactionEnd,
    default_codec_registry,
    record_count,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineOptions:
    """Tuning that never changes what is certified.

    ``batch_rows``: a builder holding this many rows is flushed to the sink without waiting for a
    control, so memory stays bounded while a long source transaction is read.
    """

    batch_rows: int = 16_384
    read_ahead_bytes: int = 64 * 1024 * 1024
    """Bytes of Arrow batches an epoch read ahead holds while the epoch before it commits; past them
    its read waits for that commit."""


class DeadLetterRoute(ABC):
    """Where rows go that do not fit their resource's schema (policy ``dead_letter``), and records a
    source could not turn into rows (``StreamRecordSink.reject``)."""

    @abstractmethod
    async def route(self, epoch: EpochId, records: Sequence[RejectedRecord]) -> None:
        """Store ``records`` durably before returning.

        Called before the epoch commits, so an aborted and replayed epoch routes the same records
        again: a route is idempotent by ``RejectedRecord.identity``.
        """

    async def withdraw(self, epoch: EpochId, records: Sequence[RejectedRecord]) -> None:
        """Remove ``records``, routed by ``epoch``, which is being aborted (it did not commit). The
        pipeline withdraws only rows the destination refused: their positions are past everything
        the destination committed, so no committed epoch holds them, and a replay may not refuse them
        again (another writer, a constraint dropped). The default keeps them."""


@dataclass(frozen=True)
class SealedEpoch:
    """An epoch the pipeline vouches for: what it covered, how many rows went where, and the digest.

    ``row_counts`` counts rows handed to the sink per resource (less those it refused and the
    dead-letter route took); ``dead_lettered`` rows routed to the dead-letter route per resource;
    ``missing_fields`` per resource and field, the rows whose record lacked that field of the schema
    (they landed with null there, or were refused under ``on_missing_field: refuse``).
    ``row_digests`` and ``schemas`` are what a replay of the coverage recomputes
    (:class:`~faucet_dagster.pipeline.integrity.RowDigests`).
    """

    epoch: EpochId
    coverage: Coverage
    row_counts: Mapping[str, int]
    dead_lettered: Mapping[str, int]
    digest: str
    missing_fields: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    row_digests: Mapping[str, str] = field(default_factory=dict)
    schemas: Mapping[str, str] = field(default_factory=dict)


class Pipeline:
    """The per-stream pipeline: resource schemas (kept across epochs) and how epochs are begun."""

    def __init__(
        self,
        schemas: Mapping[str, ResourceSchema] | None = None,
        *,
        default_schema: ResourceSchema | None = None,
        dead_letters: DeadLetterRoute | None = None,
        options: PipelineOptions | None = None,
        codecs: CodecRegistry | None = None,
    ) -> None:
        self._schemas = dict(schemas or {})
        self._default_schema = default_schema or ResourceSchema()
        self._converters: dict[str, RowConverter] = {}
        self.dead_letters = dead_letters
        self.options = options or PipelineOptions()
        self.codecs = codecs or default_codec_registry()
        routed = [name for name, spec in self._schemas.items() if spec.on_bad_row is BadRowPolicy.DEAD_LETTER]
        if self._default_schema.on_bad_row is BadRowPolicy.DEAD_LETTER:
            routed.append("(default)")
        if routed and dead_letters is None:
            raise ConfigError(
                f"resource(s) {', '.join(routed)} send bad rows to a dead-letter route, and none is set"
            )

    def converter(self, resource: str) -> RowConverter:
        """The converter of ``resource`` (created on first use; keeps an inferred schema)."""
        converter = self._converters.get(resource)
        if converter is None:
            converter = RowConverter(resource, self._schemas.get(resource, self._default_schema))
            self._converters[resource] = converter
        return converter

    def begin(
        self,
        epoch: EpochId,
        session: StreamingSinkSession,
        starts: Sequence[Position],
        *,
        begin_after: Callable[[], Awaitable[None]] | None = None,
    ) -> "EpochPipeline":
        """A pipeline for ``epoch`` writing to ``session``, resuming after ``starts``.

        ``starts`` are the positions the epoch resumes after (the certified ones, or where the epoch
        before it ends); rows at or before them are refused, and the epoch's coverage must start
        there. Without ``begin_after`` the caller began the epoch at the sink; with it the pipeline
        begins it (``begin_epoch``) before its first ``apply`` (or at the seal), once
        ``begin_after()`` returned, holding the batches read meanwhile (see the module docstring).
        """
        return EpochPipeline(self, epoch, session, starts, begin_after=begin_after)


class EpochPipeline(StreamRecordSink):
    """The :class:`StreamRecordSink` of one epoch. Not safe for concurrent calls (one read at a time)."""

    def __init__(
        self,
        pipeline: Pipeline,
        epoch: EpochId,
        session: StreamingSinkSession,
        starts: Sequence[Position],
        *,
        begin_after: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._epoch = epoch
        self._starts = {start.domain.lineage: start for start in starts}
        self._writer = SinkWriter(
            session, epoch, begin_after=begin_after, hold_bytes=pipeline.options.read_ahead_bytes
        )
        self._domains: dict[OrderingDomain, DomainState] = {}
        self._builders: dict[tuple[str, OrderingDomain], Builder] = {}
        self._digest = EpochDigest()
        self._row_digests = RowDigests()
        self._row_counts: Counter[str] = Counter()
        self._dead_lettered: Counter[str] = Counter()
        self._missing: dict[str, Counter[str]] = {}
        self._refused: list[RejectedRecord] = []
        """Dead letters of rows the destination refused, withdrawn if the epoch is discarded."""
        self._bytes = 0
        self._read = 0
        self._closed = False

    @property
    def epoch(self) -> EpochId:
        return self._epoch

    @property
    def rows_written(self) -> int:
        """Rows of this epoch handed to the sink so far (dead letters not included)."""
        return sum(self._row_counts.values())

    @property
    def rows_read(self) -> int:
        """Rows the source wrote into this epoch so far (some may still wait in a builder)."""
        return self._read

    @property
    def bytes_written(self) -> int:
        """Bytes of the Arrow batches of this epoch handed to the sink so far."""
        return self._bytes

    @property
    def begun(self) -> bool:
        """True when the epoch is active at the sink (an abort must end it there)."""
        return self._writer.begun

    @property
    def has_evidence(self) -> bool:
        """True once any row or control reached this epoch (a source session has moved)."""
        return bool(self._domains)

    async def write(
        self,
        domain: OrderingDomain,
        rows: Records,
        identities: Identities,
        *,
        resource: str | None = None,
    ) -> None:
        self._check_open()
        count = record_count(rows)
        if count != len(identities):
            raise IntegrityError(f"{count} rows came with {len(identities)} identities", where=str(domain))
        if count == 0:
            return
        self._read += count
        state = self._domain(domain)
        state.accept_rows(identities.positions[0], identities.positions[-1])
        name = resource or domain.resource
        builder = self._builders.get((name, domain))
        if builder is None:
            builder = Builder(name, domain, self._pipeline.converter(name))
            self._builders[(name, domain)] = builder
            state.builders.append(builder)
        if (
            isinstance(rows, pa.RecordBatch)
            and builder.chunks
            and isinstance(builder.chunks[-1], pa.RecordBatch)
            and not rows.schema.equals(builder.chunks[-1].schema, check_metadata=True)
        ):
            await self._flush(builder)  # a schema change at the source: one batch per schema
        builder.add(rows, identities)
        if builder.rows >= self._pipeline.options.batch_rows:
            await self._flush(builder)

    async def control(self, control: Control) -> None:
        self._check_open()
        state = self._domain(control.domain)
        where = str(control.domain)
        if isinstance(control, TransactionBegin):
            if state.open_transaction is not None:
                raise IntegrityError(
                    f"transaction {control.transaction_id} began inside open transaction "
                    f"{state.open_transaction}",
                    where=where,
                )
            await self._flush_domain(state)
            state.open_transaction = control.transaction_id
            state.floor = state.last_row
            return
        if isinstance(control, TransactionEnd):
            if state.open_transaction != control.transaction_id:
                raise IntegrityError(
                    f"transaction {control.transaction_id} ended, the open one is {state.open_transaction}",
                    where=where,
                )
        elif isinstance(control, ProgressBoundary):
            if state.open_transaction is not None:
                raise IntegrityError(
                    f"a progress boundary at {control.position} is inside open transaction "
                    f"{state.open_transaction}",
                    where=where,
                )
        else:
            raise IntegrityError(f"unknown control {control!r}", where=where)
        value = state.check_boundary(control.position)
        await self._flush_domain(state)
        # Accepted only now: every row before it is converted, checked and applied at the sink.
        state.boundary = value
        state.unbounded_rows = False
        state.open_transaction = None

    async def reject(self, record: RejectedRecord) -> None:
        """Route a record the source could not turn into a row; its position counts as read."""
        self._check_open()
        route = self._pipeline.dead_letters
        if route is None:
            await super().reject(record)
            return
        domain = record.identity.domain
        self._domain(domain).accept_rows(record.identity.position, record.identity.position)
        await route.route(self._epoch, [record])
        self._dead_lettered[record.resource or domain.resource] += 1

    async def seal(self, coverage: Coverage) -> SealedEpoch:
        """Vouch for ``coverage``: every preceding write applied, and the evidence matching it exactly.

        Raises :class:`IntegrityError` when a transaction is open, rows follow a domain's last accepted
        boundary, or ``coverage`` does not end at each domain's last accepted boundary (or starts
        elsewhere than the certified position). After ``seal`` the pipeline accepts nothing more.
        """
        self._check_open()
        for state in self._domains.values():
            if state.open_transaction is not None:
                raise IntegrityError(
                    f"transaction {state.open_transaction} is still open: no safe boundary to seal at",
                    where=str(state.domain),
                )
            if state.unbounded_rows:
                raise IntegrityError("rows follow the last accepted boundary", where=str(state.domain))
        await self._writer.finish()
        covered: set[OrderingDomain] = set()
        for item in coverage.domains:
            where = str(item.domain)
            if item.domain in covered:
                raise IntegrityError("the coverage names this domain twice", where=where)
            covered.add(item.domain)
            found = self._domains.get(item.domain)
            if found is None or found.boundary is None:
                raise IntegrityError(
                    f"the coverage reaches {item.end}, but the pipeline accepted no boundary in this domain",
                    where=where,
                )
            state = found
            end = state.decode(item.end)
            order = state.codec.compare(end, state.boundary)
            if order != 0:
                last = state.codec.canonicalize(state.boundary)
                raise IntegrityError(
                    f"the coverage ends at {item.end}, "
                    + (
                        f"past the last accepted boundary {last}"
                        if order > 0
                        else f"before the last accepted boundary {last}, whose rows were written"
                    ),
                    where=where,
                )
            if (item.start is None) != (state.start is None) or (
                item.start is not None and state.codec.compare(state.decode(item.start), state.start) != 0
            ):
                raise IntegrityError(
                    f"the coverage starts at {item.start}, the certified position is {state.start_text}",
                    where=where,
                )
        uncovered = [str(domain) for domain in self._domains if domain not in covered]
        if uncovered:
            raise IntegrityError(f"rows or boundaries in {', '.join(uncovered)} are not in the coverage")
        self._closed = True
        return SealedEpoch(
            self._epoch,
            coverage,
            dict(self._row_counts),
            dict(self._dead_lettered),
            self._digest.hexdigest(),
            {resource: dict(fields) for resource, fields in self._missing.items()},
            self._row_digests.digests(),
            self._row_digests.schemas(),
        )

    async def discard(self) -> BaseException | None:
        """Drop everything buffered and join the ``apply`` in flight (the epoch is being aborted).

        Returns the in-flight ``apply``'s failure, if any, for the caller to report with the cause.
        """
        self._closed = True
        self._builders.clear()
        failure = await self._writer.discard()
        route, refused, self._refused = self._pipeline.dead_letters, self._refused, []
        if refused and route is not None:
            try:
                await route.withdraw(self._epoch, refused)
            except FaucetError as exc:
                # They stay: a replay that the destination refuses again routes them idempotently.
                logger.warning("epoch %s: the dead letters of refused rows stay routed: %r", self._epoch, exc)
        return failure

    def _check_open(self) -> None:
        if self._closed:
            raise LifecycleError(f"epoch {self._epoch} is sealed or discarded", where=str(self._epoch))

    def _domain(self, domain: OrderingDomain) -> DomainState:
        state = self._domains.get(domain)
        if state is not None:
            return state
        codec = self._pipeline.codecs.get(domain.codec)
        start = self._starts.get(domain.lineage)
        if start is not None:
            if start.domain.incarnation != domain.incarnation:
                raise IncarnationChanged(
                    f"the source is at incarnation {domain.incarnation!r}, the certified position "
                    f"{start.value} belongs to {start.domain.incarnation!r}",
                    where="/".join(domain.lineage),
                )
            if start.domain.codec != domain.codec:
                raise IntegrityError(
                    f"the domain's codec is {domain.codec!r}, the certified one's {start.domain.codec!r}",
                    where=str(domain),
                )
        state = DomainState(domain, codec, None if start is None else start.value)
        self._domains[domain] = state
        return state

    async def _flush_domain(self, state: DomainState) -> None:
        for builder in state.builders:
            await self._flush(builder)
        await self._writer.drain()

    async def _flush(self, builder: Builder) -> None:
        chunks, positions, ordinals = builder.take()
        if not chunks:
            return
        converted = convert_chunks(builder.converter, chunks)
        if converted.missing:
            self._missing.setdefault(builder.resource, Counter()).update(converted.missing)
        if converted.bad:
            await self._reject(builder, converted.bad, chunks, positions, ordinals)
        if converted.kept is not None:
            positions = [positions[index] for index in converted.kept]
            ordinals = None if ordinals is None else [ordinals[index] for index in converted.kept]
        if converted.batch.num_rows == 0:
            return
        batch = SinkBatch(
            self._epoch, builder.resource, builder.domain, converted.batch, Identities(positions, ordinals)
        )
        schema = builder.converter.schema
        assert schema is not None  # set by the conversion above
        check_batch(batch, schema, builder.converter.required)
        self._digest.add(batch)
        self._row_digests.add(batch)
        self._row_counts[builder.resource] += converted.batch.num_rows
        routed = builder.converter.spec.on_bad_row is BadRowPolicy.DEAD_LETTER
        self._bytes += converted.batch.nbytes
        await self._writer.submit(batch, self._route_refused if routed else None)

    async def _route_refused(self, batch: SinkBatch, result: PartialResult) -> None:
        """Dead-letter the rows of ``batch`` the sink refused, each with the destination's reason."""
        route = self._pipeline.dead_letters
        assert route is not None  # checked when the pipeline was built
        records = []
        for row in result.rejected:
            identity = batch.identities.at(batch.domain, row.index)
            payload = row_payload(batch.records.slice(row.index, 1).to_pylist()[0])
            reason = f"the destination refused the row: {row.reason}"
            where = f"{batch.resource} @ {identity}"
            records.append(RejectedRecord(identity, reason, payload, where, batch.resource))
        self._refused.extend(records)
        await route.route(self._epoch, records)
        self._row_counts[batch.resource] -= len(records)
        self._dead_lettered[batch.resource] += len(records)

    async def _reject(
        self,
        builder: Builder,
        bad: Sequence[BadRow],
        chunks: list[Records],
        positions: list[str],
        ordinals: list[int] | None,
    ) -> None:
        def identity(index: int) -> EventIdentity:
            return Identities(positions, ordinals).at(builder.domain, index)

        policy = builder.converter.spec.on_bad_row
        if policy is BadRowPolicy.HALT:
            first = bad[0]
            raise DataError(
                f"a row does not fit and the policy halts the stream: {first.reason}"
                + (f" ({len(bad) - 1} more row(s) in the same batch)" if len(bad) > 1 else ""),
                where=f"{builder.resource} @ {identity(first.index)}",
            )
        route = self._pipeline.dead_letters
        assert route is not None  # checked when the pipeline was built
        records = [
            RejectedRecord(
                identity(row.index),
                row.reason,
                row_payload(row_at(chunks, row.index)),
                f"{builder.resource} @ {identity(row.index)}",
                builder.resource,
            )
            for row in bad
        ]
        await route.route(self._epoch, records)
        self._dead_lettered[builder.resource] += len(records)
