"""``faucet verify`` of a continuous stream: a range of its certificates, each checked again.

:func:`verify_stream` takes the stream's spec (its source, sink, policy, key and schemas, as the worker
has them) and its state store, and for each certificate of the range (default: the first
``limit`` after the last one verified) checks

1. the chain (:mod:`.chain`), and the reports Dagster received when they are given;
2. the source (:mod:`.replay`): the coverage re-read, row counts and row digests recomputed;
3. the destination (:mod:`.destination`): the re-read rows, consecutive epochs together up to
   ``rows_per_comparison`` rows, compared with what the sink's reader finds, and the destination's
   last committed epoch against the store's last certificate;

then records each outcome in the store (:class:`~faucet_dagster.state.verifications.VerificationLog`).
A stream run by several workers is verified group by group: each partition group's certificates are a
chain of their own (``names``).

What it costs: the source reads the range once (as a consumer that commits nothing), the destination
answers one comparison per run of epochs (a PostgreSQL reader loads the rows into a temporary table
and compares inside the database), and the store is read once per certificate. See
docs/verification.md for measured figures.
"""

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from faucet_dagster.protocol import (
    CancelToken,
    CodecRegistry,
    Delivery,
    DestinationReader,
    EpochCertificate,
    FaucetError,
    ReadableStreamingSink,
    Receipt,
    UnsupportedOperation,
    compare_positions,
    default_codec_registry,
)
from faucet_dagster.runner.spec import StreamSpec
from faucet_dagster.state import StateStore
from faucet_dagster.state.verifications import StoredCertificate, VerificationLog
from faucet_dagster.verify.chain import ChainResult, check_chain, check_reports
from faucet_dagster.verify.destination import Comparison, EpochRows, compare, expected_rows
from faucet_dagster.verify.replay import Replayed, Replayer
from faucet_dagster.verify.results import Aspect, Finding, Outcome, Report, Verification, note_all

HISTORY_PAGE = 64
"""Certificates read back at a time to find each domain's coverage before the range."""

Reports = Callable[[str, int, int], Mapping[int, str]]
"""The certificates Dagster received for a chain (its name) from ``first`` to ``last``: the fingerprint
of each certificate the materializations list, by sequence."""


@dataclass(frozen=True)
class VerifyOptions:
    """Which certificates, and which aspects.

    ``first``/``last`` bound the range (default: the ``limit`` certificates after the last one
    verified). ``source`` and ``destination`` switch those aspects off (the chain is always checked).
    ``record`` keeps the outcomes in the store (what the default range starts after).
    ``rows_per_comparison`` bounds the rows held for one destination comparison; ``history`` how many
    certificates before the range are read to find where each domain's coverage ended; ``diff_limit``
    how many rows of each kind of difference are listed.
    """

    first: int | None = None
    last: int | None = None
    limit: int = 100
    source: bool = True
    destination: bool = True
    record: bool = True
    rows_per_comparison: int = 200_000
    history: int = 10_000
    diff_limit: int = 20


async def verify_stream(
    spec: StreamSpec,
    store: StateStore,
    options: VerifyOptions | None = None,
    *,
    names: Sequence[str] | None = None,
    reports: Reports | None = None,
    codecs: CodecRegistry | None = None,
) -> Report:
    """Verify ``spec``'s certificates (under each of ``names``, default the stream's own name) as the
    module docstring says. ``reports`` reads what Dagster received (``None``: Dagster is not asked);
    it is called from a worker thread."""
    options = options or VerifyOptions()
    codecs = codecs or default_codec_registry()
    began = time.perf_counter()
    log = VerificationLog(store)
    verifications: list[Verification] = []
    replayed_rows = compared_rows = 0
    notes: list[str] = []
    for name in names or (spec.name,):
        chain_report = await _verify_chain_name(spec, store, log, name, options, codecs, reports)
        verifications.extend(chain_report.verifications)
        replayed_rows += chain_report.rows_replayed
        compared_rows += chain_report.rows_compared
        notes.extend(chain_report.notes)
    return Report(
        tuple(verifications), time.perf_counter() - began, replayed_rows, compared_rows, tuple(notes)
    )


async def _verify_chain_name(
    spec: StreamSpec,
    store: StateStore,
    log: VerificationLog,
    name: str,
    options: VerifyOptions,
    codecs: CodecRegistry,
    reports: Reports | None,
) -> Report:
    latest = log.last_sequence(name)
    first = options.first if options.first is not None else log.verified_through(name) + 1
    last = min(options.last if options.last is not None else first + options.limit - 1, latest)
    if first > last:
        return Report(
            (), notes=(f"{name}: no certificate to verify after {first - 1} (the last is {latest})",)
        )
    stored = log.certificates(name, after=first - 1, through=last)
    history, complete = _history(log, name, first, stored, options.history)
    chain = check_chain(
        stored,
        history,
        log.positions(name),
        codecs,
        first=first,
        last=last,
        latest=latest,
        history_complete=complete,
    )
    if reports is not None:
        reported = await asyncio.to_thread(reports, name, first, last)
        check_reports(chain, stored, reported, store.reported_through(name))
    findings: dict[int, list[Finding]] = {sequence: list(items) for sequence, items in chain.findings.items()}
    rows_replayed = rows_compared = 0
    notes: list[str] = []
    certificates = [chain.certificates[sequence] for sequence in sorted(chain.certificates)]
    known = dict(chain.certificates)
    if history and history[0].sequence == first - 1:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            known[first - 1] = EpochCertificate.from_json(history[0].body)
    if (options.source or options.destination) and certificates:
        replayer = Replayer(spec, codecs)
        refused = log.refused_rows(name, [certificate.sequence for certificate in certificates])
        reader = await _reader(spec, name, findings, certificates) if options.destination else None
        try:
            if reader is not None:
                await _check_committed(reader, chain, name, latest, store, codecs, findings, notes)
            for group in _groups(certificates, options.rows_per_comparison):
                replays = await replayer.replay(group, refused, CancelToken())
                for replayed in replays:
                    rows_replayed += replayed.rows
                    if options.source:
                        findings.setdefault(replayed.certificate.sequence, []).extend(replayed.findings)
                if reader is not None:
                    rows_compared += await _compare_group(
                        reader, spec, replays, known, latest, refused, options, findings
                    )
        finally:
            if reader is not None:
                await reader.close()
    verifications = []
    for sequence in range(first, last + 1):
        items = tuple(findings.get(sequence, ()))
        aspects = _aspects(items, options, sequence in chain.certificates)
        verifications.append(Verification(name, sequence, aspects, items))
    if options.record:
        log.record(name, {item.sequence: (item.outcome.value, item.summary()) for item in verifications})
    return Report(tuple(verifications), 0.0, rows_replayed, rows_compared, tuple(notes))


def _groups(certificates: Sequence[EpochCertificate], rows: int) -> list[list[EpochCertificate]]:
    """Consecutive certificates, in runs that sealed about ``rows`` rows: what one replay re-reads
    (its batches held for one destination comparison)."""
    groups: list[list[EpochCertificate]] = [[]]
    held = 0
    for certificate in certificates:
        if groups[-1] and held >= rows:
            groups.append([])
            held = 0
        groups[-1].append(certificate)
        held += sum(certificate.row_counts.values()) + sum(certificate.dead_lettered.values())
    return [group for group in groups if group]


def _aspects(findings: Sequence[Finding], options: VerifyOptions, readable: bool) -> dict[Aspect, Outcome]:
    """Each aspect's outcome: the worst of its findings. The chain holds when it found nothing; a
    source or destination asked for that found nothing to say was not checked (not verifiable). A
    certificate that is missing or unreadable has only its chain."""
    seen: dict[Aspect, list[Outcome]] = {}
    for finding in findings:
        seen.setdefault(finding.aspect, []).append(finding.outcome)
    aspects = {aspect: Outcome.worst(outcomes) for aspect, outcomes in seen.items()}
    aspects.setdefault(Aspect.CHAIN, Outcome.VERIFIED)
    if readable:
        for aspect, wanted in ((Aspect.SOURCE, options.source), (Aspect.DESTINATION, options.destination)):
            if wanted:
                aspects.setdefault(aspect, Outcome.NOT_VERIFIABLE)
    return aspects


def _history(
    log: VerificationLog, name: str, first: int, stored: Sequence[StoredCertificate], cap: int
) -> tuple[list[StoredCertificate], bool]:
    """The certificates before ``first``, newest first, back to the last one covering each domain the
    range covers (at most ``cap``); and whether they reach the stream's first certificate."""
    wanted: set[tuple[str, str, str]] = set()
    for record in stored:
        try:
            wanted.update(item.domain.lineage for item in EpochCertificate.from_json(record.body).coverage)
        except (ValueError, KeyError, TypeError):
            continue
    history: list[StoredCertificate] = []
    cursor = first
    while len(history) < cap:
        page = log.before(name, cursor, min(HISTORY_PAGE, cap - len(history)))
        history.extend(page)
        for record in page:
            try:
                wanted.difference_update(
                    item.domain.lineage for item in EpochCertificate.from_json(record.body).coverage
                )
            except (ValueError, KeyError, TypeError):
                continue
        if not page or page[-1].sequence <= 1:
            return history, True
        if not wanted and history:
            return history, False
        cursor = page[-1].sequence
    return history, False


async def _reader(
    spec: StreamSpec, name: str, findings: dict[int, list[Finding]], certificates: Sequence[EpochCertificate]
) -> DestinationReader | None:
    """The sink's reader, or None with a not-verifiable finding on every certificate saying why."""
    sink = spec.sink
    try:
        if not isinstance(sink, ReadableStreamingSink):
            raise UnsupportedOperation(
                f"the {sink.connector_name} streaming sink cannot read back what a stream wrote", where=name
            )
        return await sink.reader(name, spec.policy, spec.key)
    except FaucetError as exc:
        for certificate in certificates:
            findings.setdefault(certificate.sequence, []).append(
                Finding(Aspect.DESTINATION, Outcome.NOT_VERIFIABLE, "no reader", name, str(exc))
            )
        return None


async def _check_committed(
    reader: DestinationReader,
    chain: ChainResult,
    name: str,
    latest: int,
    store: StateStore,
    codecs: CodecRegistry,
    findings: dict[int, list[Finding]],
    notes: list[str],
) -> None:
    """The destination's last committed epoch and watermarks against the store's last certificate."""
    try:
        committed = await reader.committed()
    except FaucetError as exc:
        notes.append(f"{name}: the destination's watermark could not be read: {exc}")
        return
    if committed is None or latest == 0:
        return
    sequence = committed.epoch.sequence
    target = latest if latest in chain.certificates else max(chain.certificates)
    if sequence < latest:
        findings.setdefault(target, []).append(
            Finding(
                Aspect.DESTINATION,
                Outcome.DIVERGED,
                "destination behind",
                name,
                f"the destination's last committed epoch is {sequence}, the state store certified up to "
                f"{latest}: certified epochs are not at the destination (restored from a backup?)",
            )
        )
        return
    if sequence > latest:
        notes.append(
            f"{name}: the destination committed epoch {sequence}, one the store has not certified yet "
            "(the worker is between its commit and its certificate, or recovers it on its next start)"
        )
        return
    certified = {position.domain.lineage: position for position in store.certified_positions(name)}
    for watermark in committed.watermarks:
        position = certified.get(watermark.domain.lineage)
        try:
            same = position is not None and compare_positions(position, watermark, codecs) == 0
        except FaucetError:
            same = False
        if not same:
            findings.setdefault(target, []).append(
                Finding(
                    Aspect.DESTINATION,
                    Outcome.DIVERGED,
                    "watermark differs",
                    str(watermark.domain),
                    f"the destination's watermark is {watermark.value}, the certified position "
                    f"{None if position is None else position.value}",
                )
            )


async def _compare_group(
    reader: DestinationReader,
    spec: StreamSpec,
    group: Sequence[Replayed],
    known: Mapping[int, EpochCertificate],
    latest: int,
    refused: Mapping[int, Mapping[str, set[str]]],
    options: VerifyOptions,
    findings: dict[int, list[Finding]],
) -> int:
    """Compare the replayed rows of ``group`` with the destination, resource by resource."""
    complete = [replayed for replayed in group if replayed.complete]

    def not_compared(why: str) -> Callable[[int], Finding]:
        return lambda sequence: Finding(
            Aspect.DESTINATION, Outcome.NOT_VERIFIABLE, "not compared", f"certificate {sequence}", why
        )

    incomplete = [replayed.certificate.sequence for replayed in group if not replayed.complete]
    note_all(
        findings, incomplete, not_compared("its range could not be re-read whole: nothing to compare with")
    )
    if spec.policy.keyed and incomplete:
        # The last change of a key may be in an epoch that was not re-read: compare nothing of it.
        why = "an epoch next to it could not be re-read: a key's last change may be there"
        note_all(findings, [replayed.certificate.sequence for replayed in complete], not_compared(why))
        return 0
    epochs = [
        EpochRows(
            replayed.certificate.sequence,
            [
                (
                    batch.resource,
                    batch.records,
                    [batch.identities.at(batch.domain, i) for i in range(len(batch.identities))],
                )
                for batch in replayed.batches
            ],
        )
        for replayed in complete
    ]
    receipts: dict[str, dict[int, Receipt]] = {}
    before = known.get(group[0].certificate.sequence - 1)
    for certificate in [*([before] if before is not None else []), *(item.certificate for item in complete)]:
        for receipt in certificate.receipts:
            receipts.setdefault(receipt.resource, {})[certificate.sequence] = receipt
    resources = sorted({batch.resource for replayed in complete for batch in replayed.batches})
    compared = 0
    for resource in resources:
        gone = {sequence: refused.get(sequence, {}).get(resource, set()) for sequence in refused}
        expected = expected_rows(
            resource, epochs, spec.policy, spec.key, latest, receipts.get(resource, {}), gone
        )
        if expected is None:
            continue
        at_least_once = any(item.certificate.delivery is Delivery.AT_LEAST_ONCE for item in complete)
        result: Comparison = await compare(
            reader, expected, options.diff_limit, duplicates_allowed=at_least_once
        )
        compared += result.compared
        for sequence, items in result.findings.items():
            findings.setdefault(sequence, []).extend(items)
    for replayed in complete:
        if not any(batch.records.num_rows for batch in replayed.batches):
            findings.setdefault(replayed.certificate.sequence, []).append(
                Finding(
                    Aspect.DESTINATION,
                    Outcome.VERIFIED,
                    "no rows",
                    f"certificate {replayed.certificate.sequence}",
                    "the epoch handed the sink no rows: nothing must be at the destination",
                )
            )
    return compared


__all__ = ["Reports", "VerifyOptions", "verify_stream"]
