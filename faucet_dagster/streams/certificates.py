"""The ``faucet_epoch_certificate`` check and the problems it looks for in stored certificates:
receipts that do not add up, a replica that diverged, a gap in the chain. A tick evaluates it over the
certificates it reports (:mod:`.reports`); executed on demand, it reads the state store."""

from collections.abc import Callable, Sequence

import dagster as dg

from faucet_dagster.protocol import EpochCertificate, compare_positions
from faucet_dagster.protocol.positions import Position
from faucet_dagster.state import StateStore

CERTIFICATE_CHECK = "faucet_epoch_certificate"


MAX_REPORTS_PER_TICK = 250
"""The most certificates one tick reports (in one materialization); a backlog is reported over ticks."""


def certificate_check(
    state_url: str | None, streams: Callable[[StateStore], Sequence[str]], asset_key: dg.AssetKey
) -> dg.AssetChecksDefinition:
    """The ``faucet_epoch_certificate`` check of ``asset_key``: the certificates stored under the names
    ``streams(store)`` gives (the stream's own, or its partition groups') add up and chain.

    Evaluated by the sensor over the certificates each tick reports; executed on demand, it re-checks
    each name's last ``MAX_REPORTS_PER_TICK`` certificates (shared between them) in the state store.
    """

    @dg.asset_check(
        asset=asset_key, name=CERTIFICATE_CHECK, description="Epoch certificates chain and add up."
    )
    def _check() -> dg.AssetCheckResult:
        problems: list[str] = []
        checked = 0
        with StateStore(state_url) as store:
            names = streams(store)
            per_stream = max(1, MAX_REPORTS_PER_TICK // max(1, len(names)))
            for name in names:
                last = store.last_certificate(name)
                after = 0 if last is None else max(0, last.sequence - per_stream)
                certificates = store.certificates(name, after=after)
                checked += len(certificates)
                problems.extend(p for c in certificates for p in certificate_problems(c))
                prefix = f"{name}: " if len(names) > 1 else ""
                problems.extend(prefix + problem for problem in chain_problems(certificates))
        return dg.AssetCheckResult(
            passed=not problems,
            metadata={
                "faucet/certificates_checked": dg.MetadataValue.int(checked),
                "faucet/problems": dg.MetadataValue.text("\n".join(problems)),
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


__all__ = [
    "CERTIFICATE_CHECK",
    "MAX_REPORTS_PER_TICK",
    "certificate_check",
    "certificate_problems",
    "chain_problems",
]
