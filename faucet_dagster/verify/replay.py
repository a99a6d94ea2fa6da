"""The source side of a verification: a certificate's coverage re-read and recomputed.

Each covered domain is re-read with ``StreamSource.replay`` into the stream's own pipeline (its
schemas, keys, bad-row policy and batch size: :func:`faucet_dagster.runner.spec.stream_pipeline`),
behind a guard that refuses anything outside the range, then sealed at the certificate's coverage.
What the seal counts and digests is what the certificate claims: rows handed to the sink and routed
to the dead-letter route per resource, and the row digests (:class:`faucet_dagster.pipeline.RowDigests`,
independent of how the replay batched its reads). The batches themselves are kept for the destination
comparison (:mod:`.destination`).

Per domain, a source that no longer holds the range is *not replayable* (never "ok"), one that was
re-created under the same name has *diverged* from what was certified, one whose connector cannot
re-read is *not verifiable*.
"""

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from faucet_dagster.pipeline import DeadLetterRoute, EpochPipeline, Pipeline, SealedEpoch
from faucet_dagster.protocol import (
    CancelToken,
    CodecRegistry,
    Control,
    Coverage,
    DataError,
    DomainCoverage,
    EpochCertificate,
    EpochId,
    FaucetError,
    Identities,
    IncarnationChanged,
    IntegrityError,
    OrderingDomain,
    Position,
    PositionCodec,
    PositionUnavailable,
    ProgressBoundary,
    Receipt,
    Records,
    RejectedRecord,
    SchemaError,
    SinkBatch,
    SinkCommitState,
    StreamingSinkSession,
    StreamRecordSink,
    TransactionBegin,
    UnsupportedOperation,
)
from faucet_dagster.runner.spec import StreamSpec, stream_pipeline
from faucet_dagster.verify.results import Aspect, Finding, Outcome


class _Collector(StreamingSinkSession):
    """The sink session a replay writes to: it keeps the batches (the expected destination rows)."""

    def __init__(self) -> None:
        self.batches: list[SinkBatch] = []

    async def last_committed(self) -> SinkCommitState | None:
        return None

    async def begin_epoch(self, epoch: EpochId) -> None:
        return None

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        self.batches.append(batch)

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        return ()

    async def abort_epoch(self, epoch: EpochId) -> None:
        self.batches.clear()

    async def close_session(self) -> None:
        return None


class _Letters(DeadLetterRoute):
    """The dead-letter route of a replay: what would have been routed, by epoch."""

    def __init__(self) -> None:
        self.records: dict[int, list[RejectedRecord]] = {}

    async def route(self, epoch: EpochId, records: Sequence[RejectedRecord]) -> None:
        self.records.setdefault(epoch.sequence, []).extend(records)


@dataclass
class _Part:
    """One certificate's part of a replayed span: its coverage of the domain, its epoch's pipeline."""

    certificate: EpochCertificate
    coverage: DomainCoverage
    end: Any
    target: EpochPipeline
    rows: int = 0
    touched: bool = False
    """Whether the part's pipeline was handed anything (then it cannot be re-read on its own)."""


class _Router(StreamRecordSink):
    """Hands what a source replays over a span of consecutive certificates of one domain to each
    certificate's pipeline, by position, ending each part with a boundary at its certified end;
    anything outside the span, or of another domain, is refused."""

    def __init__(self, parts: Sequence[_Part], codec: PositionCodec[Any]) -> None:
        self._parts = parts
        self._codec = codec
        self._domain = parts[0].coverage.domain
        self._start = None if parts[0].coverage.start is None else codec.validate(parts[0].coverage.start)
        self._index = 0

    def _check(self, domain: OrderingDomain) -> None:
        certified = self._domain
        if domain.lineage != certified.lineage or domain.codec != certified.codec:
            raise IntegrityError(f"the replay of {certified} wrote rows of {domain}", where=str(certified))
        if domain.incarnation != certified.incarnation:
            raise IncarnationChanged(
                f"the source is incarnation {domain.incarnation!r} now, the certificate covers "
                f"{certified.incarnation!r}: it was deleted and re-created under the same name",
                where=str(certified),
            )

    async def _part_of(self, text: str) -> _Part:
        """The part ``text`` falls in, ending the parts before it (positions only go forward)."""
        position = self._codec.validate(text)
        compare = self._codec.compare
        if self._start is not None and compare(position, self._start) <= 0:
            raise IntegrityError(
                f"the replay wrote position {text}, before the certified range (after {self._start})",
                where=str(self._domain),
            )
        while compare(position, self._parts[self._index].end) > 0:
            await self._close_part()
            if self._index == len(self._parts):
                raise IntegrityError(
                    f"the replay wrote position {text}, past the certified range (up to "
                    f"{self._parts[-1].coverage.end})",
                    where=str(self._domain),
                )
        return self._parts[self._index]

    async def _close_part(self) -> None:
        part = self._parts[self._index]
        part.touched = True
        await part.target.control(ProgressBoundary(self._domain, part.coverage.end))
        self._index += 1

    async def finish(self) -> None:
        """End every part not ended yet (the span's rows are all written)."""
        while self._index < len(self._parts):
            await self._close_part()

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        self._check(domain)
        positions = identities.positions
        start = 0
        while start < len(positions):
            part = await self._part_of(positions[start])
            stop = start + 1
            while (
                stop < len(positions)
                and self._codec.compare(self._codec.validate(positions[stop]), part.end) <= 0
            ):
                stop += 1
            piece = rows if start == 0 and stop == len(positions) else _slice(rows, start, stop)
            ordinals = None if identities.ordinals is None else identities.ordinals[start:stop]
            part.rows += stop - start
            part.touched = True
            await part.target.write(
                domain, piece, Identities(positions[start:stop], ordinals), resource=resource
            )
            start = stop

    async def control(self, control: Control) -> None:
        self._check(control.domain)
        if isinstance(control, TransactionBegin):
            part = self._parts[min(self._index, len(self._parts) - 1)]
            part.touched = True
            await part.target.control(control)
            return
        part = await self._part_of(control.position)
        part.touched = True
        await part.target.control(control)

    async def reject(self, record: RejectedRecord) -> None:
        self._check(record.identity.domain)
        part = await self._part_of(record.identity.position)
        part.rows += 1
        part.touched = True
        await part.target.reject(record)


def _slice(rows: Records, start: int, stop: int) -> Records:
    if isinstance(rows, pa.RecordBatch):
        return rows.slice(start, stop - start)
    return rows[start:stop]


@dataclass
class Replayed:
    """One certificate's coverage re-read: the seal (``None`` unless every domain was re-read whole),
    the batches handed to the (collecting) sink, the findings, and the rows re-read."""

    certificate: EpochCertificate
    sealed: SealedEpoch | None = None
    batches: list[SinkBatch] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    rows: int = 0

    @property
    def complete(self) -> bool:
        return self.sealed is not None


class Replayer:
    """Re-reads runs of consecutive certificates of one stream, through one pipeline (so a schema
    inferred from the first rows holds for the next ones, as in the worker that read them).

    Per domain, the ranges of consecutive certificates that follow each other exactly are re-read
    as one span (one ``StreamSource.replay`` call: one consumer for many epochs), and each row goes
    to the certificate whose range holds its position. A span the source cannot re-read whole is
    re-read certificate by certificate, so each says for itself whether its range is still there.
    """

    def __init__(self, spec: StreamSpec, codecs: CodecRegistry | None = None) -> None:
        self.spec = spec
        self._letters = _Letters()
        self._pipeline: Pipeline = stream_pipeline(spec, self._letters)
        self._codecs = codecs or self._pipeline.codecs

    async def replay(
        self,
        certificates: Sequence[EpochCertificate],
        refused: Mapping[int, Mapping[str, set[str]]] | None = None,
        cancel: CancelToken | None = None,
    ) -> list[Replayed]:
        """Re-read the coverage of ``certificates`` (consecutive, ascending) and compare what it
        recomputes with what each claims. ``refused`` names, per epoch and resource, the rows the
        destination refused (dead letters: handed to the sink, so in the digest, not in its count)."""
        cancel = cancel or CancelToken()
        refused = refused or {}
        results = {certificate.sequence: Replayed(certificate) for certificate in certificates}
        collectors = {certificate.sequence: _Collector() for certificate in certificates}
        pipelines = {
            certificate.sequence: self._pipeline.begin(
                certificate.epoch,
                collectors[certificate.sequence],
                [
                    Position(item.domain, item.start)
                    for item in certificate.coverage
                    if item.start is not None
                ],
            )
            for certificate in certificates
        }
        failed: set[int] = set()
        self._letters.records.clear()
        for run in _runs(certificates):
            parts = [
                _Part(
                    certificate,
                    item,
                    self._codecs.get(item.domain.codec).validate(item.end),
                    pipelines[certificate.sequence],
                )
                for certificate, item in run
            ]
            outcome = await self._replay_span(parts, cancel)
            untouched = [part for part in parts if not part.touched]
            if isinstance(outcome, Finding) and len(parts) > 1 and untouched:
                # Not the whole span: the ranges nothing was read into yet on their own (the later
                # ones may still be there); those read into share the span's outcome.
                self._settle(results, failed, [part for part in parts if part.touched], outcome)
                for part in untouched:
                    self._settle(results, failed, [part], await self._replay_span([part], cancel))
                continue
            self._settle(results, failed, parts, outcome)
        for certificate in certificates:
            sequence = certificate.sequence
            replayed = results[sequence]
            if sequence in failed:
                await pipelines[sequence].discard()
                continue
            try:
                sealed = await pipelines[sequence].seal(Coverage(certificate.coverage))
            except FaucetError as exc:
                replayed.findings.append(
                    Finding(
                        Aspect.SOURCE,
                        Outcome.DIVERGED,
                        "replay does not seal",
                        f"certificate {sequence}",
                        f"the re-read rows do not make the certified epoch: {exc}",
                    )
                )
                await pipelines[sequence].discard()
                continue
            replayed.sealed = sealed
            replayed.batches = collectors[sequence].batches
            letters = self._letters.records.get(sequence, [])
            replayed.findings.extend(_compare(certificate, sealed, letters, refused.get(sequence, {})))
        return [results[certificate.sequence] for certificate in certificates]

    def _settle(
        self,
        results: Mapping[int, Replayed],
        failed: set[int],
        parts: Sequence[_Part],
        outcome: "Finding | str",
    ) -> None:
        """Record a span's outcome on each certificate of it."""
        for part in parts:
            replayed = results[part.certificate.sequence]
            replayed.rows += part.rows
            if isinstance(outcome, Finding):
                replayed.findings.append(outcome)
                failed.add(part.certificate.sequence)
            else:
                replayed.findings.append(
                    Finding(
                        Aspect.SOURCE,
                        Outcome.VERIFIED,
                        "re-read",
                        str(part.coverage.domain),
                        f"re-read {part.rows} records {_span(part.coverage)}",
                    )
                )

    async def _replay_span(self, parts: Sequence[_Part], cancel: CancelToken) -> "Finding | str":
        """Re-read ``parts`` (consecutive ranges of one domain) in one call: "ok", or the finding of
        why not (the parts then hold whatever they were handed: their epochs are discarded)."""
        first, last = parts[0].coverage, parts[-1].coverage
        span = DomainCoverage(first.domain, first.start, last.end)
        where = str(span.domain)
        codec = self._codecs.get(span.domain.codec)
        router = _Router(parts, codec)
        for part in parts:
            part.rows = 0
        try:
            await self.spec.source.replay(span, router, cancel)
            if cancel.cancelled:
                raise UnsupportedOperation("the verification was cancelled", where=where)
            await router.finish()
        except PositionUnavailable as exc:
            return Finding(Aspect.SOURCE, Outcome.NOT_VERIFIABLE, "not replayable", where, exc.message)
        except IncarnationChanged as exc:
            return Finding(Aspect.SOURCE, Outcome.DIVERGED, "source re-created", where, exc.message)
        except (DataError, IntegrityError, SchemaError) as exc:
            return Finding(
                Aspect.SOURCE,
                Outcome.DIVERGED,
                "replay differs",
                where,
                f"re-reading {_span(span)} found what the certified epochs could not have read: {exc}",
            )
        except FaucetError as exc:
            return Finding(
                Aspect.SOURCE, Outcome.NOT_VERIFIABLE, "not re-read", where, f"{type(exc).__name__}: {exc}"
            )
        return "ok"


def _span(coverage: DomainCoverage) -> str:
    return (
        f"after {coverage.start} up to {coverage.end}"
        if coverage.start is not None
        else f"up to {coverage.end}"
    )


def _runs(certificates: Sequence[EpochCertificate]) -> list[list[tuple[EpochCertificate, DomainCoverage]]]:
    """Per domain, the runs of consecutive certificates whose ranges follow each other exactly (the
    same domain, each starting where the previous ended): each run is re-read as one span."""
    runs: list[list[tuple[EpochCertificate, DomainCoverage]]] = []
    open_runs: dict[tuple[str, str, str], list[tuple[EpochCertificate, DomainCoverage]]] = {}
    for certificate in certificates:
        for item in certificate.coverage:
            run = open_runs.get(item.domain.lineage)
            if run is not None and run[-1][1].domain == item.domain and run[-1][1].end == item.start:
                run.append((certificate, item))
                continue
            run = [(certificate, item)]
            open_runs[item.domain.lineage] = run
            runs.append(run)
    return runs


def _compare(
    certificate: EpochCertificate,
    sealed: SealedEpoch,
    letters: Sequence[RejectedRecord],
    refused: Mapping[str, set[str]],
) -> list[Finding]:
    """What the seal of the replay says against what the certificate claims, per resource."""
    where = f"certificate {certificate.sequence}"
    if not certificate.receipts and not certificate.row_counts and not certificate.digest:
        return [
            Finding(
                Aspect.SOURCE,
                Outcome.NOT_VERIFIABLE,
                "claims no rows",
                where,
                "certified from the destination's watermark in a recovery: it claims no rows or digest "
                "to compare with the re-read range",
            )
        ]
    findings: list[Finding] = []
    routed = Counter(letter.resource or letter.identity.domain.resource for letter in letters)
    resources = sorted(set(certificate.row_counts) | set(sealed.row_counts) | set(certificate.dead_lettered))
    for resource in resources:
        refused_here = len(refused.get(resource, ()))
        claimed = certificate.row_counts.get(resource, 0) + refused_here
        found = sealed.row_counts.get(resource, 0)
        letters_claimed = certificate.dead_lettered.get(resource, 0) - refused_here
        at = f"{resource} in {where}"
        if found != claimed or routed.get(resource, 0) != letters_claimed:
            findings.append(
                Finding(
                    Aspect.SOURCE,
                    Outcome.DIVERGED,
                    "row count differs",
                    at,
                    f"the certificate counts {claimed} rows handed to the sink and {letters_claimed} "
                    f"dead-lettered; the source holds {found} and {routed.get(resource, 0)} in the range",
                )
            )
            continue
        claimed_digest = certificate.row_digests.get(resource)
        if claimed_digest is None:
            findings.append(
                Finding(
                    Aspect.SOURCE,
                    Outcome.NOT_VERIFIABLE,
                    "no row digest",
                    at,
                    f"{found} rows counted alike; the certificate has no row digest to compare the rows "
                    "with (written before row digests existed)",
                )
            )
            continue
        if certificate.schemas.get(resource) not in (None, sealed.schemas.get(resource)):
            findings.append(
                Finding(
                    Aspect.SOURCE,
                    Outcome.NOT_VERIFIABLE,
                    "schema differs",
                    at,
                    f"{found} rows counted alike, but the replay converts them to another Arrow schema than "
                    "the worker did (an inferred schema, fixed by the first rows a worker saw): declare the "
                    "resource's schema to make its replays exact",
                )
            )
            continue
        if sealed.row_digests.get(resource) != claimed_digest:
            findings.append(
                Finding(
                    Aspect.SOURCE,
                    Outcome.DIVERGED,
                    "rows differ",
                    at,
                    f"{found} rows counted alike, but their digest is {sealed.row_digests.get(resource)}, "
                    f"the certificate's {claimed_digest}: the source holds other rows in the range than "
                    "the epoch read",
                )
            )
            continue
        findings.append(
            Finding(
                Aspect.SOURCE,
                Outcome.VERIFIED,
                "rows match",
                at,
                f"{found} rows and their digest recomputed from the source",
            )
        )
    return findings


__all__ = ["Replayed", "Replayer"]
