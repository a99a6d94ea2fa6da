"""What a tick reports to Dagster: one materialization of the sink asset covering every certificate
certified since the last report, and one evaluation of its ``faucet_epoch_certificate`` check.

However many epochs a stream certifies between two ticks (one a second when epochs are sealed by age),
Dagster's event log receives one materialization and one certificate-check evaluation per asset and
tick. Each certificate stays in the state store, individually checkable (``faucet streams status``,
the check executed on demand), and is listed in the report's ``faucet/certificates`` table.

The report's metadata (:func:`report_metadata`), what Dagster plots and what it does not:

* numbers a plot draws (``IntMetadataValue``/``FloatMetadataValue``): ``faucet/epochs``,
  ``faucet/rows_written``, ``faucet/rows_per_second`` (rows over the epochs' busy seconds, see
  :func:`busy_seconds`), ``faucet/busy_seconds``, ``faucet/lag_positions`` and ``faucet/lag_seconds``
  (the newest certificate's lag: the one the tick's summary states);
* identifiers a plot must not draw, as text: ``faucet/first_sequence``, ``faucet/last_sequence``,
  ``faucet/fencing_token``, ``faucet/rows_dead_lettered``, ``faucet/digest_covers``;
* ``faucet/rows_missing_fields``: per resource and field, the rows stored with null there because
  their record lacked the field (JSON);
* tables: ``faucet/coverage`` (per ordering domain, the start of the first certificate and the end of
  the last), ``faucet/certificates`` (sequence, coverage, rows, digest and fingerprint of each),
  ``faucet/lag``;
* ``faucet/last_certificate``: the newest certificate as stored, incarnations included.

An ordering domain is shown by :func:`domain_label` (``kafka/orders/3``): its incarnation (a Kafka
cluster and topic id, a JetStream creation time, a PostgreSQL system id) stays in the certificates.
"""

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

# Dagster's own set of the standard table keys; dagster 1.13 exports it from here only.
from dagster._core.definitions.metadata import TableMetadataSet

from faucet_dagster.protocol import EpochCertificate, OrderingDomain, SourceLag
from faucet_dagster.state import StateStore
from faucet_dagster.state.certificates import fingerprint_and_body
from faucet_dagster.streams.certificates import (
    CERTIFICATE_CHECK,
    MAX_REPORTS_PER_TICK,
    certificate_problems,
    chain_problems,
)

IDLE_TIMING = "read_idle"
"""The timing (seconds) an epoch's reads spent waiting on a source that had nothing new: not busy
time. Recorded by the runner in a certificate's ``timings`` where it measures it; absent, every timed
second of the epoch counts as busy."""
DIGEST_COVERS = (
    "Each certificate's digest is blake2b-256 over what its epoch handed to the destination, in order: "
    "every batch's resource, ordering domain, row count, Arrow schema and Arrow IPC encoding. Rows routed "
    "to the dead-letter route are not in it. The same rows read again from the same positions give the "
    "same digest on any machine."
)


def domain_label(domain: OrderingDomain) -> str:
    """``source/resource[/partition]``: an ordering domain as people look for it (its incarnation stays
    in the certificate)."""
    return "/".join(part for part in (domain.source, domain.resource, domain.partition) if part)


def busy_seconds(certificate: EpochCertificate) -> float:
    """The seconds an epoch was busy: its timed steps (lease to commit) less the time its reads waited
    on a source with nothing new (:data:`IDLE_TIMING`)."""
    timings = dict(certificate.timings)
    idle = timings.pop(IDLE_TIMING, 0.0)
    return max(0.0, sum(timings.values()) - idle)


def rows_of(certificate: EpochCertificate) -> int:
    return sum(certificate.row_counts.values())


def metadata_table(columns: Mapping[str, str], rows: Sequence[Mapping[str, Any]]) -> dg.TableMetadataValue:
    """A metadata table of ``rows`` with ``columns`` (name to Dagster column type), in that order."""
    return dg.TableMetadataValue(
        records=[dg.TableRecord({name: row[name] for name in columns}) for row in rows],
        schema=dg.TableSchema(columns=[dg.TableColumn(name, kind) for name, kind in columns.items()]),
    )


# -- lag ---------------------------------------------------------------------------------------


def describe_lag(lag: Sequence[SourceLag]) -> str:
    """The lag for people: ``0 (caught up)``, ``120 messages (1.5s) in nats/EVENTS``, or over several
    domains the total and the domain furthest behind."""
    if not lag:
        return "unknown (the source does not say where its head is)"
    units = sorted({item.unit for item in lag})
    behind = sum(item.behind for item in lag)
    if behind == 0:
        return f"0 {'/'.join(units)} (caught up)"
    worst = max(lag, key=lambda item: item.behind)
    seconds = [item.seconds for item in lag if item.seconds is not None]
    age = f" ({max(seconds):.1f}s)" if seconds else ""
    if len(lag) == 1:
        return f"{behind} {worst.unit}{age} in {domain_label(worst.domain)}"
    return (
        f"{behind} {'/'.join(units)}{age} over {len(lag)} domains "
        f"(most: {worst.behind} in {domain_label(worst.domain)})"
    )


def lag_metadata(lag: Sequence[SourceLag]) -> dict[str, Any]:
    """How far the source's head was ahead of the certified coverage (empty when the source cannot tell).

    ``faucet/lag_positions`` sums ``behind`` over the domains (in ``faucet/lag_unit``: messages,
    offsets, WAL bytes); ``faucet/lag_seconds`` is the largest lag in time, present only when every
    domain knows its times; ``faucet/lag`` is the table per domain.
    """
    if not lag:
        return {}
    seconds = [item.seconds for item in lag]
    metadata: dict[str, Any] = {
        "faucet/lag_positions": dg.MetadataValue.int(sum(item.behind for item in lag)),
        "faucet/lag_unit": dg.MetadataValue.text(", ".join(sorted({item.unit for item in lag}))),
        "faucet/lag": metadata_table(
            {
                "domain": "string",
                "position": "string",
                "head": "string",
                "behind": "int",
                "seconds": "string",
            },
            [
                {
                    "domain": domain_label(item.domain),
                    "position": item.position or "",
                    "head": item.head or "",
                    "behind": item.behind,
                    "seconds": "" if item.seconds is None else f"{item.seconds:.3f}",
                }
                for item in lag
            ],
        ),
    }
    known = [value for value in seconds if value is not None]
    if known and len(known) == len(seconds):
        metadata["faucet/lag_seconds"] = dg.MetadataValue.float(round(max(known), 3))
    return metadata


# -- the report of a tick ----------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    """The certificates one tick reports for one asset, oldest first (of one stream, or of the
    partition groups of a stream on workers), and the resources the asset covers (None: all)."""

    certificates: tuple[EpochCertificate, ...]
    resources: frozenset[str] | None = None

    @property
    def rows(self) -> int:
        return sum(self.rows_in(certificate) for certificate in self.certificates)

    @property
    def newest(self) -> EpochCertificate:
        return max(self.certificates, key=lambda certificate: certificate.created_at)

    @property
    def touched(self) -> bool:
        """Whether the certificates wrote any of this report's resources (rows or receipts)."""
        return self.rows > 0 or any(
            receipt.resource in (self.resources or ())
            for certificate in self.certificates
            for receipt in certificate.receipts
        )

    def rows_in(self, certificate: EpochCertificate) -> int:
        """The rows ``certificate`` sealed of this report's resources."""
        return sum(
            count
            for resource, count in certificate.row_counts.items()
            if self.resources is None or resource in self.resources
        )

    def lag(self) -> tuple[SourceLag, ...]:
        """The newest lag per domain (each stream's newest certificate's: one per group on workers)."""
        newest: dict[str, EpochCertificate] = {}
        for certificate in self.certificates:
            newest[certificate.stream] = certificate
        return tuple(item for certificate in newest.values() for item in certificate.lag)

    def rows_per_second(self) -> float:
        busy = sum(busy_seconds(certificate) for certificate in self.certificates)
        return round(self.rows / busy, 1) if busy > 0 else 0.0

    def describe(self) -> str:
        """For people (the tick's summary): ``certified 3 epochs (12 to 14), 13500 rows; lag ...``."""
        certificates = self.certificates
        epochs = "1 epoch" if len(certificates) == 1 else f"{len(certificates)} epochs"
        lag = describe_lag(self.lag())
        return f"certified {epochs} ({sequences(certificates)}), {self.rows} rows; lag {lag}"


def sequences(certificates: Sequence[EpochCertificate]) -> str:
    """``12 to 14``, or per partition group ``events[0/2] 3 to 5, events[1/2] 7 to 9``."""
    by_stream: dict[str, list[int]] = {}
    for certificate in certificates:
        by_stream.setdefault(certificate.stream, []).append(certificate.sequence)
    ranges = {stream: f"{min(found)} to {max(found)}" for stream, found in by_stream.items()}
    if len(ranges) == 1:
        return next(iter(ranges.values()))
    return ", ".join(f"{stream} {span}" for stream, span in ranges.items())


def report_metadata(report: Report) -> dict[str, Any]:
    """The metadata of a tick's materialization (see the module docstring)."""
    certificates = report.certificates
    newest = report.newest
    busy = sum(busy_seconds(certificate) for certificate in certificates)
    dead = sum(
        count
        for certificate in certificates
        for resource, count in certificate.dead_lettered.items()
        if report.resources is None or resource in report.resources
    )
    missing: dict[str, dict[str, int]] = {}
    for certificate in certificates:
        for resource, fields in certificate.missing_fields.items():
            if report.resources is None or resource in report.resources:
                counts = missing.setdefault(resource, {})
                for name, count in fields.items():
                    counts[name] = counts.get(name, 0) + count
    receipts = [
        receipt
        for certificate in certificates
        for receipt in certificate.receipts
        if report.resources is None or receipt.resource in report.resources
    ]
    return {
        "faucet/epochs": dg.MetadataValue.int(len(certificates)),
        "faucet/first_sequence": dg.MetadataValue.text(_first_last(certificates, first=True)),
        "faucet/last_sequence": dg.MetadataValue.text(_first_last(certificates, first=False)),
        "faucet/rows_written": dg.MetadataValue.int(sum(receipt.rows_written for receipt in receipts)),
        "faucet/rows_dead_lettered": dg.MetadataValue.text(str(dead)),
        "faucet/rows_missing_fields": dg.MetadataValue.json(missing),
        "faucet/rows_per_second": dg.MetadataValue.float(report.rows_per_second()),
        "faucet/busy_seconds": dg.MetadataValue.float(round(busy, 3)),
        "faucet/coverage": coverage_table(certificates),
        "faucet/certificates": certificates_table(report),
        "faucet/digest_covers": dg.MetadataValue.text(DIGEST_COVERS),
        "faucet/fencing_token": dg.MetadataValue.text(str(newest.fencing_token)),
        "faucet/worker": dg.MetadataValue.text(newest.worker),
        "faucet/delivery": dg.MetadataValue.text(newest.delivery.value),
        "faucet/certified_at": dg.MetadataValue.text(newest.created_at),
        "faucet/last_certificate": dg.MetadataValue.json(json.loads(newest.to_json())),
        **lag_metadata(report.lag()),
        **table_metadata(receipts),
    }


def _first_last(certificates: Sequence[EpochCertificate], *, first: bool) -> str:
    by_stream: dict[str, int] = {}
    for certificate in certificates:
        if first:
            by_stream.setdefault(certificate.stream, certificate.sequence)
        else:
            by_stream[certificate.stream] = certificate.sequence
    if len(by_stream) == 1:
        return str(next(iter(by_stream.values())))
    return ", ".join(f"{stream}: {sequence}" for stream, sequence in by_stream.items())


def coverage_table(certificates: Iterable[EpochCertificate]) -> dg.TableMetadataValue:
    """Per ordering domain, where the first certificate covering it started and the last one ended."""
    merged: dict[tuple[str, str, str], dict[str, str]] = {}
    for certificate in certificates:
        for item in certificate.coverage:
            entry = merged.setdefault(
                item.domain.lineage, {"domain": domain_label(item.domain), "start": item.start or ""}
            )
            entry["end"] = item.end
    return metadata_table({"domain": "string", "start": "string", "end": "string"}, list(merged.values()))


def certificates_table(report: Report) -> dg.TableMetadataValue:
    """One row per certificate reported: stream (a partition group's, on workers), sequence, coverage,
    rows, digest, and the certificate's fingerprint as stored (``faucet verify`` finds a certificate
    changed in the store after it was reported by comparing the two)."""
    columns = {
        "stream": "string",  # a partition group's name on workers (a report may hold one group only)
        "sequence": "string",
        "coverage": "string",
        "rows": "int",
        "digest": "string",
        "certified_at": "string",
        "fingerprint": "string",
    }
    return metadata_table(
        columns,
        [
            {
                "stream": certificate.stream,
                "sequence": str(certificate.sequence),
                "coverage": "; ".join(
                    f"{domain_label(item.domain)} {item.start or 'start'}..{item.end}"
                    for item in certificate.coverage
                ),
                "rows": report.rows_in(certificate),
                "digest": certificate.digest,
                "certified_at": certificate.created_at,
                "fingerprint": fingerprint_and_body(certificate)[0],
            }
            for certificate in report.certificates
        ],
    )


def table_metadata(receipts: Sequence[Any]) -> dict[str, Any]:
    """Dagster's table keys a stream can state exactly: ``dagster/table_name`` (database.schema.table)
    when every receipt names the same table with its database. Never ``dagster/row_count``: that is the
    table's rows, which a sink cannot count cheaply and exactly (the epochs' are ``faucet/rows_written``)."""
    names = {
        f"{receipt.details['database']}.{receipt.details['table']}"
        if receipt.details.get("database") and receipt.details.get("table")
        else None
        for receipt in receipts
    }
    if len(names) != 1 or None in names:
        return {}
    [name] = names
    return dict(TableMetadataSet(table_name=name))


@dataclass(frozen=True)
class AssetTarget:
    """An asset a stream's reports materialize, and the resources it stands for (None: all of them;
    a stream with an asset per replicated table has one target per resource)."""

    key: dg.AssetKey
    resources: frozenset[str] | None = None


@dataclass(frozen=True)
class Unreported:
    """The certificates stored after each stream name's report mark (oldest first, at most
    ``MAX_REPORTS_PER_TICK`` in all), the certificate reported last before them per name (what they
    must chain to), and the marks once they are reported."""

    certificates: tuple[EpochCertificate, ...]
    previous: Mapping[str, EpochCertificate]
    marks: dict[str, int]
    after: dict[str, int]
    """Per name, the report mark the certificates follow (what :meth:`StateStore.claim_reported` checks)."""


def unreported(store: StateStore, names: Sequence[str], confirmed: Mapping[str, int]) -> Unreported:
    """What is certified under ``names`` and not reported yet.

    ``confirmed`` are the marks Dagster has (a cursor's): each is recorded in the store first, and the
    report starts after the higher of the cursor's mark and the store's (the store's mark also moves
    when a worker run reports its own certificates, its sensor stopped)."""
    found: list[EpochCertificate] = []
    previous: dict[str, EpochCertificate] = {}
    marks: dict[str, int] = {}
    after: dict[str, int] = {}
    share = max(1, MAX_REPORTS_PER_TICK // max(1, len(names)))
    for name in names:
        if name in confirmed:
            store.mark_reported(name, confirmed[name])
        reported = after[name] = store.reported_through(name)
        certificates = store.certificates(name, after=reported, limit=share)
        if certificates and reported > 0:
            before = store.certificates(name, after=reported - 1, limit=1)
            if before:
                previous[name] = before[0]
        found.extend(certificates)
        marks[name] = certificates[-1].sequence if certificates else reported
    found.sort(key=lambda certificate: (certificate.created_at, certificate.stream, certificate.sequence))
    return Unreported(tuple(found), previous, marks, after)


def report_events(
    certificates: Sequence[EpochCertificate],
    targets: Sequence[AssetTarget],
    previous: Mapping[str, EpochCertificate] | None = None,
) -> list[dg.AssetMaterialization | dg.AssetCheckEvaluation]:
    """A tick's events: per target asset, one materialization covering ``certificates`` and one
    ``faucet_epoch_certificate`` evaluation (every certificate's receipts add up, and each stream's
    certificates chain, to ``previous``, the one reported before them, too). Nothing without
    certificates."""
    if not certificates:
        return []
    events: list[dg.AssetMaterialization | dg.AssetCheckEvaluation] = []
    evaluation = certificate_evaluation(certificates, previous or {})
    for target in targets:
        report = Report(tuple(certificates), target.resources)
        if target.resources is not None and not report.touched:
            continue  # a replicated table these epochs did not change: nothing to report for it
        events.append(
            dg.AssetMaterialization(
                asset_key=target.key, description=report.describe(), metadata=report_metadata(report)
            )
        )
        events.append(evaluation.with_asset_key(target.key))
    return events


@dataclass(frozen=True)
class CertificateEvaluation:
    passed: bool
    description: str
    metadata: Mapping[str, Any]

    def with_asset_key(self, key: dg.AssetKey) -> dg.AssetCheckEvaluation:
        return dg.AssetCheckEvaluation(
            asset_key=key,
            check_name=CERTIFICATE_CHECK,
            passed=self.passed,
            metadata=dict(self.metadata),
            severity=dg.AssetCheckSeverity.ERROR,
            description=self.description,
        )


def certificate_evaluation(
    certificates: Sequence[EpochCertificate], previous: Mapping[str, EpochCertificate]
) -> CertificateEvaluation:
    """The ``faucet_epoch_certificate`` evaluation of reported ``certificates``."""
    problems = [problem for certificate in certificates for problem in certificate_problems(certificate)]
    chains: dict[str, list[EpochCertificate]] = {name: [before] for name, before in previous.items()}
    for certificate in certificates:
        chains.setdefault(certificate.stream, []).append(certificate)
    for chain in chains.values():
        problems.extend(chain_problems(chain))
    span = sequences(certificates)
    return CertificateEvaluation(
        passed=not problems,
        description=f"{len(certificates)} certificate(s) ({span}) add up and chain"
        if not problems
        else problems[0],
        metadata={
            "faucet/certificates_checked": dg.MetadataValue.int(len(certificates)),
            "faucet/sequences": dg.MetadataValue.text(span),
            "faucet/problems": dg.MetadataValue.text("\n".join(problems)),
        },
    )


__all__ = [
    "DIGEST_COVERS",
    "IDLE_TIMING",
    "AssetTarget",
    "Report",
    "Unreported",
    "busy_seconds",
    "certificate_evaluation",
    "describe_lag",
    "domain_label",
    "lag_metadata",
    "metadata_table",
    "report_events",
    "report_metadata",
    "sequences",
    "unreported",
]
