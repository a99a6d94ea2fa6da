"""Epoch certificates as Dagster sees them: a materialization of the sink asset per certificate, its
``faucet_epoch_certificate`` check evaluation, and the problems that check looks for (receipts that do
not add up, a replica that diverged, a gap in the chain)."""

import json
from collections.abc import Sequence
from typing import Any

import dagster as dg

from faucet_dagster.protocol import EpochCertificate, compare_positions
from faucet_dagster.protocol.positions import Position
from faucet_dagster.state import StateStore
from faucet_dagster.streams.declaration import AssetKeyLike, FaucetStream
from faucet_dagster.streams.health import lag_metadata, metadata_table, table_metadata, throughput_metadata

CERTIFICATE_CHECK = "faucet_epoch_certificate"


MAX_REPORTS_PER_TICK = 500


def certificate_check(
    stream: FaucetStream, asset_key: AssetKeyLike | None = None
) -> dg.AssetChecksDefinition:
    """The ``faucet_epoch_certificate`` check: the stored certificates chain and add up.

    Evaluated by the sensor for every certificate it reports; executed on demand, it re-checks the
    last ``MAX_REPORTS_PER_TICK`` certificates of the stream in the state store.
    """
    key = stream.asset_spec(asset_key).key

    @dg.asset_check(asset=key, name=CERTIFICATE_CHECK, description="Epoch certificates chain and add up.")
    def _check() -> dg.AssetCheckResult:
        with StateStore(stream.state_url) as store:
            last = store.last_certificate(stream.name)
            after = 0 if last is None else max(0, last.sequence - MAX_REPORTS_PER_TICK)
            certificates = store.certificates(stream.name, after=after)
        problems = [problem for certificate in certificates for problem in certificate_problems(certificate)]
        problems.extend(chain_problems(certificates))
        return dg.AssetCheckResult(
            passed=not problems,
            metadata={
                "faucet/certificates_checked": len(certificates),
                "faucet/problems": "\n".join(problems),
            },
        )

    return _check


def certificate_problems(certificate: EpochCertificate) -> list[str]:
    """What is wrong with one certificate on its own: no coverage, or receipts that do not add up."""
    problems = []
    if not certificate.coverage:
        problems.append(f"certificate {certificate.certificate_id} covers nothing")
    handled = sum(receipt.rows_written + receipt.rows_skipped for receipt in certificate.receipts)
    sealed = sum(certificate.row_counts.values())
    if handled != sealed:
        problems.append(
            f"certificate {certificate.certificate_id}: the sink handled {handled} rows "
            f"(written + skipped), the pipeline sealed {sealed}"
        )
    for receipt in certificate.receipts:
        # A replica that met rows it did not expect diverged from its source: not effectively-once.
        surprises = {
            name: receipt.details.get(name, "0") for name in ("unexpected_inserts", "unexpected_changes")
        }
        if any(value != "0" for value in surprises.values()):
            problems.append(
                f"certificate {certificate.certificate_id}: {receipt.resource} diverged from its source ("
                + ", ".join(f"{name} {value}" for name, value in surprises.items())
                + ")"
            )
    return problems


def chain_problems(certificates: Sequence[EpochCertificate]) -> list[str]:
    """Where consecutive certificates do not chain: a gap in sequence or coverage between them."""
    problems = []
    ends: dict[tuple[str, str, str], Position] = {}
    previous: EpochCertificate | None = None
    for certificate in certificates:
        if previous is not None and certificate.sequence != previous.sequence + 1:
            problems.append(f"certificate {certificate.sequence} follows {previous.sequence}")
        for item in certificate.coverage:
            end = ends.get(item.domain.lineage)
            start = None if item.start is None else Position(item.domain, item.start)
            if end is not None and (start is None or compare_positions(start, end) != 0):
                problems.append(
                    f"certificate {certificate.sequence} starts at {item.start} in {item.domain}, "
                    f"the previous one ended at {end.value}"
                )
            ends[item.domain.lineage] = Position(item.domain, item.end)
        previous = certificate
    return problems


def certificate_metadata(certificate: EpochCertificate) -> dict[str, Any]:
    """The certificate as asset metadata: epoch, coverage and receipts tables, counts, digest, token,
    and the numbers Dagster plots (throughput, lag)."""
    coverage = metadata_table(
        dict.fromkeys(("source", "resource", "partition", "incarnation", "start", "end"), "string"),
        [
            {
                "source": item.domain.source,
                "resource": item.domain.resource,
                "partition": item.domain.partition,
                "incarnation": item.domain.incarnation,
                "start": item.start or "",
                "end": item.end,
            }
            for item in certificate.coverage
        ],
    )
    receipts = metadata_table(
        {"resource": "string", "rows_written": "int", "rows_skipped": "int", "details": "string"},
        [
            {
                "resource": receipt.resource,
                "rows_written": receipt.rows_written,
                "rows_skipped": receipt.rows_skipped,
                "details": json.dumps(dict(receipt.details), sort_keys=True),
            }
            for receipt in certificate.receipts
        ],
    )
    return {
        "faucet/epoch": str(certificate.epoch),
        "faucet/sequence": certificate.sequence,
        "faucet/coverage": coverage,
        "faucet/receipts": receipts,
        "faucet/rows_written": sum(receipt.rows_written for receipt in certificate.receipts),
        "faucet/row_counts": dict(certificate.row_counts),
        "faucet/rows_dead_lettered": sum(certificate.dead_lettered.values()),
        "faucet/rows_missing_fields": {
            resource: dict(fields) for resource, fields in certificate.missing_fields.items()
        },
        "faucet/digest": certificate.digest,
        "faucet/fencing_token": certificate.fencing_token,
        "faucet/worker": certificate.worker,
        "faucet/delivery": certificate.delivery.value,
        "faucet/timings": dict(certificate.timings),
        "faucet/certified_at": certificate.created_at,
        "faucet/certificate": dg.MetadataValue.json(json.loads(certificate.to_json())),
        **throughput_metadata(certificate),
        **lag_metadata(certificate.lag),
        **table_metadata(certificate),
    }


def certificate_events(
    certificate: EpochCertificate, asset_key: dg.AssetKey
) -> tuple[dg.AssetMaterialization, dg.AssetCheckEvaluation]:
    """The materialization of the sink asset for ``certificate`` and its check evaluation."""
    problems = certificate_problems(certificate)
    materialization = dg.AssetMaterialization(
        asset_key=asset_key,
        description=f"certified epoch {certificate.epoch}",
        metadata=certificate_metadata(certificate),
    )
    evaluation = dg.AssetCheckEvaluation(
        asset_key=asset_key,
        check_name=CERTIFICATE_CHECK,
        passed=not problems,
        metadata={"faucet/epoch": str(certificate.epoch), "faucet/problems": "\n".join(problems)},
        severity=dg.AssetCheckSeverity.ERROR,
        description="the certificate's receipts add up to its sealed rows" if not problems else problems[0],
    )
    return materialization, evaluation


__all__ = [
    "CERTIFICATE_CHECK",
    "MAX_REPORTS_PER_TICK",
    "certificate_check",
    "certificate_events",
    "certificate_metadata",
    "certificate_problems",
    "chain_problems",
]
