"""What the state store (:mod:`.store`) checks and stores of a certificate beside its lease: the
positions in canonical form, the move of each covered domain's certified position (checked against
the stored one), and the fingerprint that tells an identical retry from a conflicting certificate.
"""

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from sqlalchemy.engine import Connection

from faucet_dagster.protocol import (
    CodecRegistry,
    DomainCoverage,
    EpochCertificate,
    FaucetError,
    IncarnationChanged,
    IntegrityError,
    OrderingDomain,
)
from faucet_dagster.state import tables as q


def canonical_certificate(certificate: EpochCertificate, codecs: CodecRegistry) -> EpochCertificate:
    """The certificate with every position in its codec's canonical form."""

    def canonical(domain: OrderingDomain, raw: str | None) -> str | None:
        if raw is None:
            return None
        codec = codecs.get(domain.codec)
        try:
            return codec.canonicalize(codec.validate(raw))
        except FaucetError as exc:
            raise IntegrityError(
                f"certificate {certificate.certificate_id} holds an invalid position: {exc.message}",
                where=str(domain),
            ) from exc

    coverage = []
    for item in certificate.coverage:
        end = canonical(item.domain, item.end)
        assert end is not None
        coverage.append(DomainCoverage(item.domain, canonical(item.domain, item.start), end))
    return replace(certificate, coverage=tuple(coverage))


def advance_positions(
    conn: Connection,
    codecs: CodecRegistry,
    stream: str,
    sequence: int,
    coverage: Sequence[DomainCoverage],
) -> None:
    """Move each covered domain's certified position from ``item.start`` to ``item.end`` (checked):
    one read of the stream's positions, then one insert or update per domain."""
    stored_rows = {
        (row.source, row.resource, row.partition): row
        for row in conn.execute(q.POSITIONS_OF, {"stream": stream})
    }
    inserts: list[dict[str, Any]] = []
    moves: list[dict[str, Any]] = []
    for item in coverage:
        domain = item.domain
        where = str(domain)
        codec = codecs.get(domain.codec)
        stored = stored_rows.get(domain.lineage)
        start = None if item.start is None else codec.validate(item.start)
        end = codec.validate(item.end)
        if start is not None and codec.compare(end, start) < 0:
            raise IntegrityError(f"coverage goes back from {item.start} to {item.end}", where=where)
        if stored is None:
            inserts.append(
                {
                    "stream": stream,
                    "source": domain.source,
                    "resource": domain.resource,
                    "partition": domain.partition,
                    "incarnation": domain.incarnation,
                    "codec": domain.codec,
                    "position": item.end,
                    "sequence": sequence,
                }
            )
            continue
        if stored.incarnation != domain.incarnation:
            raise IncarnationChanged(
                f"coverage of incarnation {domain.incarnation!r} follows certified positions of "
                f"{stored.incarnation!r}",
                where=where,
            )
        if stored.codec != domain.codec:
            raise IntegrityError(
                f"coverage uses codec {domain.codec!r}, the certified {stored.codec!r}", where=where
            )
        certified = codec.validate(stored.position)
        if start is None or codec.compare(start, certified) != 0:
            order = codec.compare(end, certified)
            problem = "goes back before" if order < 0 else "does not start at"
            raise IntegrityError(
                f"coverage {item.start}..{item.end} {problem} the certified position {stored.position}",
                where=where,
            )
        moves.append(
            {
                "at_stream": stream,
                "at_source": domain.source,
                "at_resource": domain.resource,
                "at_partition": domain.partition,
                "to_position": item.end,
                "to_sequence": sequence,
            }
        )
    if inserts:
        conn.execute(q.INSERT_POSITION, inserts)
    if moves:
        conn.execute(q.MOVE_POSITION, moves)


def fingerprint_and_body(certificate: EpochCertificate) -> tuple[str, str]:
    """What makes two certificates the same epoch (a digest of everything but timings and the
    creation time), and the stored body (``certificate.to_json()``), from one ``asdict``."""
    plain = asdict(certificate)
    return _fingerprint(plain), json.dumps(plain, sort_keys=True, separators=(",", ":"))


def body_fingerprint(body: str) -> str:
    """The fingerprint of a stored body, as :func:`fingerprint_and_body` computed it when the
    certificate was stored (``faucet verify`` finds a body changed since by comparing the two)."""
    return _fingerprint(json.loads(body))


def _fingerprint(plain: dict[str, Any]) -> str:
    same = {**plain, "timings": {}, "created_at": ""}
    return hashlib.blake2b(json.dumps(same, sort_keys=True, default=str).encode(), digest_size=32).hexdigest()
