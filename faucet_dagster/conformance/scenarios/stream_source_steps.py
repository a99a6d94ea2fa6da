"""The scenarios of a stream source, as steps, and how they are drawn from what it declares.

See :mod:`.stream_source` for what a scenario does and how each step is judged.
"""

import random
from dataclasses import dataclass
from typing import Any

from faucet_dagster.conformance.scenarios.engine import Step
from faucet_dagster.protocol import (
    Operation,
)

ORDER_RULE = (
    "stream 3 an epoch certifies the next changes of each domain, in order: nothing skipped, nothing twice"
)
TRANSACTION_RULE = "stream 3 no coverage inside an open transaction"
IDENTITY_RULE = "stream 8 an event keeps its identity on every replay, whichever worker reads it"
UNWRITTEN_RULE = "stream 3 a position whose rows were not written is never certified"
SPECULATIVE_RULE = "stream 5 only certified work is acknowledged, and only in acknowledge()"
OWNERSHIP_RULE = "stream 5 authority() before every acknowledgement"
UNAVAILABLE_RULE = "stream 1 an unavailable resume position is refused, never replaced by the latest"
INCARNATION_RULE = "stream 1 a position of another incarnation is refused, never read in the new one"
WORKS_RULE = "stream 2 a read of a valid config works, or fails with the typed error the contract names"


@dataclass(frozen=True)
class StreamSourceDeclaration:
    transactions: bool
    changes: bool
    """The setup changes and deletes rows, and the source emits those operations."""
    acknowledged: bool
    purge: bool
    recreate: bool
    domains: bool
    """The setup says which ordering domain each row lands in (``domain_of``)."""


@dataclass(frozen=True)
class Cast(Step):
    fixed = True

    def describe(self) -> str:
        return "a stream source on a fresh dataset"


@dataclass(frozen=True)
class Add(Step):
    count: int

    def describe(self) -> str:
        return f"source: {self.count} rows added in one transaction"


@dataclass(frozen=True)
class Change(Step):
    """Rows updated (``delete`` False) or deleted, in one transaction, chosen by number."""

    picks: tuple[int, ...]
    delete: bool = False

    def describe(self) -> str:
        return (
            f"source: {len(self.picks)} row(s) {'deleted' if self.delete else 'updated'} in one transaction"
        )


@dataclass(frozen=True)
class Read(Step):
    """One epoch: a read with a record limit, sealed; certified or not (the worker dies between the
    commit and the certificate), then acknowledged or not."""

    records: int | None
    certify: bool = True
    acknowledge: bool = True

    def describe(self) -> str:
        limit = "no record limit" if self.records is None else f"a limit of {self.records} record(s)"
        if not self.certify:
            return f"an epoch read with {limit}, committed, then the worker dies before the certificate"
        return f"an epoch read with {limit}, certified{', acknowledged' if self.acknowledge else ''}"


@dataclass(frozen=True)
class Acknowledge(Step):
    def describe(self) -> str:
        return "the certified epochs not yet acknowledged are acknowledged"


@dataclass(frozen=True)
class Close(Step):
    def describe(self) -> str:
        return "the session is closed (nothing more acknowledged)"


@dataclass(frozen=True)
class Crash(Step):
    at_effect: int | None = None

    def describe(self) -> str:
        if self.at_effect is None:
            return "the worker process is killed"
        return f"the worker process is killed at effect {self.at_effect} of its next call"


@dataclass(frozen=True)
class Takeover(Step):
    """A newer worker takes the stream; the old one acknowledges what it certified anyway."""

    def describe(self) -> str:
        return "a newer worker (higher fencing token) takes over; the old one tries to acknowledge"


@dataclass(frozen=True)
class Purge(Step):
    def describe(self) -> str:
        return "retention removes every stored row, read or not"


@dataclass(frozen=True)
class Recreate(Step):
    def describe(self) -> str:
        return "the stream (topic) is deleted and created again"


@dataclass(frozen=True)
class Drain(Step):
    def describe(self) -> str:
        return "epochs until every change is certified"


def declaration(subject: Any) -> StreamSourceDeclaration:
    setup = subject.source_setup
    caps = subject.stream_source().capabilities()
    changes = setup.update_rows is not None and setup.delete_rows is not None
    return StreamSourceDeclaration(
        transactions=caps.transaction_boundaries,
        changes=changes and {Operation.UPDATE, Operation.DELETE} <= caps.operations,
        acknowledged=setup.acknowledged is not None,
        purge=setup.make_unavailable is not None,
        recreate=setup.recreate is not None,
        domains=setup.domain_of is not None,
    )


def generate(rng: random.Random, declared: StreamSourceDeclaration) -> list[Step]:
    def add() -> Step:
        return Add(3 + rng.randrange(4))

    def limit() -> int | None:
        return rng.choice([1, 2, 5, None])

    steps: list[Step] = [Cast(), add(), add(), Read(1), Read(limit()), add()]
    if declared.changes:
        steps += [Change((rng.randrange(50), rng.randrange(50))), Change((rng.randrange(50),), delete=True)]
    steps += [Read(2, acknowledge=False), Acknowledge()]
    steps += [add(), Read(limit(), certify=False), Read(None)]
    steps += [add(), Read(limit(), acknowledge=False), Close(), add(), Read(limit())]
    steps += [add(), Read(limit(), acknowledge=False), Takeover(), Read(limit())]
    steps += [add(), Read(2, acknowledge=False), Crash(at_effect=rng.randrange(3)), Acknowledge(), Read(None)]
    for _ in range(10):
        choice = rng.choices(
            ["add", "read", "unsure", "ack", "close", "crash", "takeover", "change"], [4, 5, 1, 2, 1, 1, 1, 1]
        )[0]
        if choice == "add" or (choice == "change" and not declared.changes):
            steps.append(add())
        elif choice == "read":
            steps.append(Read(limit(), acknowledge=rng.random() < 0.7))
        elif choice == "unsure":
            steps.append(Read(limit(), certify=False))
        elif choice == "ack":
            steps.append(Acknowledge())
        elif choice == "close":
            steps.append(Close())
        elif choice == "crash":
            steps.append(Crash(None if rng.random() < 0.5 else rng.randrange(4)))
        elif choice == "takeover":
            steps.append(Takeover())
        else:
            steps.append(Change((rng.randrange(50),), delete=rng.random() < 0.3))
    steps += [add(), Drain()]
    if declared.recreate:
        steps += [add(), Read(None), Recreate(), add(), Drain()]
    if declared.purge:
        steps += [add(), Purge()]  # the last step: what remedies a purge depends on the provider
    return steps


__all__ = [
    "IDENTITY_RULE",
    "INCARNATION_RULE",
    "ORDER_RULE",
    "OWNERSHIP_RULE",
    "SPECULATIVE_RULE",
    "TRANSACTION_RULE",
    "UNAVAILABLE_RULE",
    "UNWRITTEN_RULE",
    "WORKS_RULE",
    "Acknowledge",
    "Add",
    "Cast",
    "Change",
    "Close",
    "Crash",
    "Drain",
    "Purge",
    "Read",
    "Recreate",
    "StreamSourceDeclaration",
    "Takeover",
    "declaration",
    "generate",
]
