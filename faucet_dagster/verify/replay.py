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

from faucet_dagster.pipeline import DeadLetterRoute, Pipeline, SealedEpoch
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
    StreamSource,
    UnsupportedOperation,
    record_count,
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
    """The dead-letter route of a replay: counts what would have been routed."""

    def __init__(self) -> None:
        self.records: list[RejectedRecord] = []

    async def route(self, epoch: EpochId, records: Sequence[RejectedRecord]) -> None:
        self.records.extend(records)


class _RangeGuard(StreamRecordSink):
    """Hands what a source replays to the epoch's pipeline; anything outside the range is refused."""

    def __init__(self, target: StreamRecordSink, coverage: DomainCoverage, codec: PositionCodec[Any]) -> None:
        self._target = target
        self._coverage = coverage
        self._codec = codec
        self._start = None if coverage.start is None else codec.validate(coverage.start)
        self._end = codec.validate(coverage.end)
        self.rows = 0

    def _check(self, domain: OrderingDomain, positions: Sequence[str]) -> None:
        certified = self._coverage.domain
        if domain.lineage != certified.lineage or domain.codec != certified.codec:
            raise IntegrityError(f"the replay of {certified} wrote rows of {domain}", where=str(certified))
        if domain.incarnation != certified.incarnation:
            raise IncarnationChanged(
                f"the source is incarnation {domain.incarnation!r} now, the certificate covers "
                f"{certified.incarnation!r}: it was deleted and re-created under the same name",
                where=str(certified),
            )
        compare, decode = self._codec.compare, self._codec.validate
        for text in (positions[0], positions[-1]) if positions else ():
            position = decode(text)
            if (self._start is not None and compare(position, self._start) <= 0) or compare(
                position, self._end
            ) > 0:
                raise IntegrityError(
                    f"the replay wrote position {text}, outside the certified range "
                    f"{self._coverage.start}..{self._coverage.end}",
                    where=str(certified),
                )

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        self._check(domain, identities.positions)
        self.rows += record_count(rows)
        await self._target.write(domain, rows, identities, resource=resource)

    async def control(self, control: Control) -> None:
        self._check(control.domain, [control.position] if hasattr(control, "position") else [])
        await self._target.control(control)

    async def reject(self, record: RejectedRecord) -> None:
        self._check(record.identity.domain, [record.identity.position])
        self.rows += 1
        await self._target.reject(record)


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
    """Re-reads certificates of one stream in order, through one pipeline (so a schema inferred from
    the first certificate's rows holds for the next ones, as in the worker that read them)."""

    def __init__(self, spec: StreamSpec, codecs: CodecRegistry | None = None) -> None:
        self.spec = spec
        self._letters = _Letters()
        self._pipeline: Pipeline = stream_pipeline(spec, self._letters)
        self._codecs = codecs or self._pipeline.codecs

    async def replay(
        self,
        certificate: EpochCertificate,
        refused: Mapping[str, set[str]] | None = None,
        cancel: CancelToken | None = None,
    ) -> Replayed:
        """Re-read ``certificate``'s coverage and compare what it recomputes with what it claims.
        ``refused`` names, per resource, the rows the destination refused in that epoch (dead letters:
        handed to the sink, so in the digest, but not in its row count)."""
        replayed = Replayed(certificate)
        collector = _Collector()
        starts = [
            Position(item.domain, item.start) for item in certificate.coverage if item.start is not None
        ]
        epoch = self._pipeline.begin(certificate.epoch, collector, starts)
        self._letters.records.clear()
        ok = True
        for item in certificate.coverage:
            finding = await self._replay_domain(
                self.spec.source, epoch, item, replayed, cancel or CancelToken()
            )
            replayed.findings.append(finding)
            ok = ok and finding.outcome is Outcome.VERIFIED
        if not ok:
            await epoch.discard()
            return replayed
        try:
            sealed = await epoch.seal(Coverage(certificate.coverage))
        except FaucetError as exc:
            replayed.findings.append(
                Finding(
                    Aspect.SOURCE,
                    Outcome.DIVERGED,
                    "replay does not seal",
                    f"certificate {certificate.sequence}",
                    f"the re-read rows do not make the certified epoch: {exc}",
                )
            )
            await epoch.discard()
            return replayed
        replayed.sealed = sealed
        replayed.batches = collector.batches
        replayed.findings.extend(_compare(certificate, sealed, self._letters.records, refused or {}))
        return replayed

    async def _replay_domain(
        self,
        source: StreamSource,
        epoch: StreamRecordSink,
        item: DomainCoverage,
        replayed: Replayed,
        cancel: CancelToken,
    ) -> Finding:
        where = str(item.domain)
        span = f"after {item.start} up to {item.end}" if item.start is not None else f"up to {item.end}"
        codec = self._codecs.get(item.domain.codec)
        guard = _RangeGuard(epoch, item, codec)
        try:
            await source.replay(item, guard, cancel)
            if cancel.cancelled:
                raise UnsupportedOperation("the verification was cancelled", where=where)
            await epoch.control(ProgressBoundary(item.domain, item.end))
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
                f"re-reading {span} found what the certified epoch could not have read: {exc}",
            )
        except FaucetError as exc:
            return Finding(
                Aspect.SOURCE, Outcome.NOT_VERIFIABLE, "not re-read", where, f"{type(exc).__name__}: {exc}"
            )
        finally:
            replayed.rows += guard.rows
        return Finding(
            Aspect.SOURCE, Outcome.VERIFIED, "re-read", where, f"re-read {guard.rows} records {span}"
        )


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
