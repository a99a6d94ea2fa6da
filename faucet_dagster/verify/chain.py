"""The chain: what the state store holds of a stream's certificates, checked against itself.

For each certificate of the range (DESIGN.md section 6.1):

* its body matches the fingerprint written with it, and names the epoch its row names (an *altered*
  certificate otherwise);
* every sequence of the range is there (a *missing* certificate otherwise: removed);
* fencing tokens never go back;
* per ordering domain, its coverage starts exactly where the previous certificate covering the domain
  ended, in the same incarnation (a *gap*, an *overlap*, or a *source re-created* otherwise), and never
  ends before it starts; a domain's first coverage starts at the domain's beginning;
* the receipts add up to the rows the pipeline sealed;
* the certified position of each domain it covers was moved there by it or by a later certificate,
  and a position the store holds was moved by a certificate that is there, ending exactly there (a
  certificate written into the table without going through the store moves no position);

and, when Dagster's materializations were read, the certificate Dagster was sent is the one stored.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from faucet_dagster.protocol import CodecRegistry, DomainCoverage, EpochCertificate, FaucetError
from faucet_dagster.state.certificates import body_fingerprint
from faucet_dagster.state.verifications import CertifiedPosition, StoredCertificate
from faucet_dagster.verify.results import Aspect, Finding, Outcome

Lineage = tuple[str, str, str]


@dataclass
class ChainResult:
    """The findings per sequence (chain and reports), and the certificates that could be read."""

    findings: dict[int, list[Finding]] = field(default_factory=dict)
    certificates: dict[int, EpochCertificate] = field(default_factory=dict)

    def add(self, sequence: int, finding: Finding) -> None:
        self.findings.setdefault(sequence, []).append(finding)


def _diverged(kind: str, where: str, detail: str, aspect: Aspect = Aspect.CHAIN) -> Finding:
    return Finding(aspect, Outcome.DIVERGED, kind, where, detail)


def check_chain(
    stored: Sequence[StoredCertificate],
    history: Sequence[StoredCertificate],
    positions: Sequence[CertifiedPosition],
    codecs: CodecRegistry,
    *,
    first: int,
    last: int,
    latest: int,
    history_complete: bool,
) -> ChainResult:
    """Check certificates ``first..last`` (``stored``, ascending) against each other, the certificates
    before them (``history``, newest first: enough to find each domain's previous coverage, all of them
    when ``history_complete``) and the store's certified ``positions``; ``latest`` is the store's last
    sequence (a position moved by a later one names a certificate that is not there)."""
    result = ChainResult()
    for record in stored:
        certificate = _read(record, result)
        if certificate is not None:
            result.certificates[record.sequence] = certificate
    present = {record.sequence for record in stored}
    for sequence in range(first, last + 1):
        if sequence not in present:
            result.add(
                sequence,
                _diverged(
                    "missing certificate",
                    f"certificate {sequence}",
                    "the state store holds no certificate with this sequence between its neighbours: "
                    "it was removed",
                ),
            )
    _check_links(result, history, codecs, history_complete)
    _check_positions(result, positions, codecs, last, latest)
    return result


def _read(record: StoredCertificate, result: ChainResult) -> EpochCertificate | None:
    where = f"certificate {record.sequence}"
    try:
        certificate = EpochCertificate.from_json(record.body)
        fingerprint = body_fingerprint(record.body)
    except (ValueError, KeyError, TypeError) as exc:
        result.add(
            record.sequence, _diverged("unreadable certificate", where, f"its body does not parse: {exc!r}")
        )
        return None
    if fingerprint != record.fingerprint:
        result.add(
            record.sequence,
            _diverged(
                "altered certificate",
                where,
                "the stored body does not match the fingerprint written with it: it was changed after "
                "it was certified",
            ),
        )
    named = (certificate.stream, certificate.sequence, certificate.fencing_token, certificate.worker)
    row = (record.stream, record.sequence, record.fencing_token, record.worker)
    if named != row:
        result.add(
            record.sequence,
            _diverged("altered certificate", where, f"the body names epoch {named}, its row {row}"),
        )
    handled = sum(receipt.rows_written + receipt.rows_skipped for receipt in certificate.receipts)
    sealed = sum(certificate.row_counts.values())
    if certificate.receipts and handled != sealed:
        result.add(
            record.sequence,
            _diverged(
                "receipts do not add up",
                where,
                f"the sink handled {handled} rows (written + skipped), the pipeline sealed {sealed}",
            ),
        )
    if not certificate.coverage:
        result.add(record.sequence, _diverged("empty coverage", where, "the certificate covers nothing"))
    return certificate


def _check_links(
    result: ChainResult, history: Sequence[StoredCertificate], codecs: CodecRegistry, complete: bool
) -> None:
    """Fencing tokens and per-domain coverage, from the newest certificate before the range on."""
    previous: dict[Lineage, tuple[int, DomainCoverage]] = {}
    token: tuple[int, int] | None = None
    for record in history:  # newest first: the first seen of each domain is its latest
        try:
            earlier = EpochCertificate.from_json(record.body)
        except (ValueError, KeyError, TypeError):
            continue
        if token is None:
            token = (earlier.sequence, earlier.fencing_token)
        for item in earlier.coverage:
            previous.setdefault(item.domain.lineage, (earlier.sequence, item))
    for sequence, certificate in sorted(result.certificates.items()):
        where = f"certificate {sequence}"
        if token is not None and certificate.fencing_token < token[1]:
            result.add(
                sequence,
                _diverged(
                    "fencing token went back",
                    where,
                    f"fencing token {certificate.fencing_token} follows {token[1]} of certificate {token[0]}",
                ),
            )
        token = (sequence, certificate.fencing_token)
        for item in certificate.coverage:
            finding = _link(item, previous.get(item.domain.lineage), codecs, complete)
            if finding is not None:
                result.add(sequence, finding)
            previous[item.domain.lineage] = (sequence, item)


def _link(
    item: DomainCoverage,
    before: tuple[int, DomainCoverage] | None,
    codecs: CodecRegistry,
    complete: bool,
) -> Finding | None:
    """What is wrong with ``item`` following ``before`` (the previous coverage of its domain)."""
    where = str(item.domain)
    try:
        codec = codecs.get(item.domain.codec)
        start = None if item.start is None else codec.validate(item.start)
        end = codec.validate(item.end)
    except FaucetError as exc:
        return _diverged("invalid position", where, exc.message)
    if start is not None and codec.compare(end, start) < 0:
        return _diverged(
            "coverage goes back", where, f"the coverage goes back from {item.start} to {item.end}"
        )
    if before is None:
        if start is None or not complete:
            return None
        return _diverged(
            "gap",
            where,
            f"the domain's first certificate starts after {item.start}, not at its beginning: the "
            f"positions up to {item.start} are covered by no certificate",
        )
    sequence, earlier = before
    if earlier.domain.incarnation != item.domain.incarnation or earlier.domain.codec != item.domain.codec:
        return _diverged(
            "source re-created",
            where,
            f"certificate {sequence} covered incarnation {earlier.domain.incarnation!r} up to "
            f"{earlier.end}; this one covers {item.domain.incarnation!r}: the source was re-created under "
            "the same name and read as if it were the same",
        )
    if start is None:
        return _diverged(
            "overlap",
            where,
            f"the coverage starts at the domain's beginning, certificate {sequence} already covered it "
            f"up to {earlier.end}",
        )
    order = codec.compare(start, codec.validate(earlier.end))
    if order > 0:
        return _diverged(
            "gap",
            where,
            f"certificate {sequence} ended at {earlier.end} and this one starts after {item.start}: the "
            f"positions after {earlier.end} up to {item.start} are covered by no certificate",
        )
    if order < 0:
        return _diverged(
            "overlap",
            where,
            f"certificate {sequence} ended at {earlier.end} and this one starts after {item.start}: the "
            f"positions after {item.start} up to {earlier.end} are covered twice",
        )
    return None


def _check_positions(
    result: ChainResult,
    positions: Sequence[CertifiedPosition],
    codecs: CodecRegistry,
    last: int,
    latest: int,
) -> None:
    stored = {position.domain.lineage: position for position in positions}
    for sequence, certificate in sorted(result.certificates.items()):
        for item in certificate.coverage:
            found = stored.get(item.domain.lineage)
            if found is None:
                result.add(
                    sequence,
                    _diverged(
                        "position not moved",
                        str(item.domain),
                        "the store holds no certified position for a domain this certificate covers: "
                        "the certificate was not written by the store",
                    ),
                )
            elif found.sequence < sequence:
                result.add(
                    sequence,
                    _diverged(
                        "position not moved",
                        str(item.domain),
                        f"the certified position {found.position} was last moved by certificate "
                        f"{found.sequence}, not by this one, which ends at {item.end}: the certificate was "
                        "not written by the store",
                    ),
                )
            elif found.sequence == sequence and not _same_end(found, item, codecs):
                result.add(
                    sequence,
                    _diverged(
                        "position differs",
                        str(item.domain),
                        f"the store's certified position is {found.position} "
                        f"({found.domain.incarnation!r}), this certificate ends at {item.end} "
                        f"({item.domain.incarnation!r})",
                    ),
                )
    for position in positions:
        if position.sequence > latest:
            result.add(
                last,
                _diverged(
                    "missing certificate",
                    str(position.domain),
                    f"the certified position {position.position} was moved by certificate "
                    f"{position.sequence}, which is not in the state store (its last is {latest})",
                ),
            )


def _same_end(found: CertifiedPosition, item: DomainCoverage, codecs: CodecRegistry) -> bool:
    if found.domain.incarnation != item.domain.incarnation or found.domain.codec != item.domain.codec:
        return False
    codec = codecs.get(item.domain.codec)
    return bool(codec.compare(codec.validate(found.position), codec.validate(item.end)) == 0)


def check_reports(
    result: ChainResult,
    stored: Sequence[StoredCertificate],
    reported: Mapping[int, str],
    reported_through: int,
) -> None:
    """Compare each stored certificate with the one Dagster was sent (``reported``: the fingerprint
    of each certificate the materializations list, by sequence). One the store says Dagster received
    (at or below ``reported_through``) that no materialization lists cannot be checked."""
    for record in stored:
        sent = reported.get(record.sequence)
        where = f"certificate {record.sequence}"
        if sent is None:
            if record.sequence <= reported_through:
                result.add(
                    record.sequence,
                    Finding(
                        Aspect.REPORTS,
                        Outcome.NOT_VERIFIABLE,
                        "no report",
                        where,
                        "the store says Dagster received it, but no materialization of the asset lists it "
                        "(the event log was wiped or trimmed)",
                    ),
                )
            continue
        if body_fingerprint(record.body) == sent:
            result.add(
                record.sequence,
                Finding(
                    Aspect.REPORTS, Outcome.VERIFIED, "reported", where, "Dagster received this certificate"
                ),
            )
            continue
        result.add(
            record.sequence,
            _diverged(
                "reported differently",
                where,
                "Dagster received another certificate under this sequence (its fingerprint differs): the "
                "stored one was changed after it was reported",
                Aspect.REPORTS,
            ),
        )


__all__ = ["ChainResult", "check_chain", "check_reports"]
