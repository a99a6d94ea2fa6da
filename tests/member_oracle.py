"""Checks of a stream divided among workers, from its certificates alone (shared by the member tests)."""

from collections.abc import Iterable
from dataclasses import dataclass

from faucet_dagster.protocol import EpochCertificate, OrderingDomain


@dataclass(frozen=True)
class Ownership:
    """What the certificates say about one ordering domain: its owners in order, where it ended."""

    group: str
    owners: tuple[tuple[int, str], ...]
    """(fencing token, worker) in certificate order, consecutive repeats collapsed."""
    end: str | None


def check_ownership(chains: dict[str, list[EpochCertificate]]) -> dict[OrderingDomain, Ownership]:
    """Check every domain of every group chain and return its ownership, by domain.

    Raises AssertionError when a domain appears in two groups, when a group's sequences have a gap,
    when a domain's coverage does not start where its previous certificate ended (a loss or a
    duplicate), when a fencing token goes back (two owners at a time), or when one token was used by
    two workers.
    """
    found: dict[OrderingDomain, Ownership] = {}
    for group, certificates in chains.items():
        assert [c.sequence for c in certificates] == list(range(1, len(certificates) + 1)), group
        token_worker: dict[int, str] = {}
        for certificate in certificates:
            worker = token_worker.setdefault(certificate.fencing_token, certificate.worker)
            assert worker == certificate.worker, (
                f"{group}: token {certificate.fencing_token} used by {worker} and {certificate.worker}"
            )
            for item in certificate.coverage:
                name = item.domain
                earlier = found.get(name)
                if earlier is not None:
                    assert earlier.group == group, f"{name} is certified in {earlier.group} and {group}"
                    assert item.start == earlier.end, (
                        f"{name}: {certificate.certificate_id} starts at {item.start}, "
                        f"the previous certificate ended at {earlier.end}"
                    )
                    last_token = earlier.owners[-1][0]
                    assert certificate.fencing_token >= last_token, (
                        f"{name}: token {certificate.fencing_token} after {last_token}"
                    )
                    owners = earlier.owners
                else:
                    assert item.start is None, f"{name} first certified from {item.start}"
                    owners = ()
                owner = (certificate.fencing_token, certificate.worker)
                if not owners or owners[-1] != owner:
                    owners = (*owners, owner)
                found[name] = Ownership(group, owners, item.end)
    return found


def workers_of(ownership: Iterable[Ownership]) -> set[str]:
    return {worker for item in ownership for _, worker in item.owners}
