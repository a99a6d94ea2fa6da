"""The lifecycle of a streaming sink session that holds each epoch's batches until its commit.

A sink whose epoch is one destination transaction or one table-format commit (DuckDB, Delta) sends
nothing during ``apply``: it keeps the batches and writes them all at ``commit_epoch``.
:class:`HeldEpochs` is that session's epoch bookkeeping: it enforces the lifecycle order
(:class:`LifecycleError`, :class:`EpochMismatch`), refuses at ``apply`` a batch that cannot be upserted
by its key (the epoch then fails: only abort remains), and keeps the rest. :class:`ResourceTally`
counts what a commit did to one resource, for its :class:`Receipt`. Pure: no I/O.
"""

from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from faucet_dagster.protocol.errors import DataError, EpochMismatch, LifecycleError, SchemaError
from faucet_dagster.protocol.keys import first_row_without_key
from faucet_dagster.protocol.streaming import EpochId, SinkBatch
from faucet_dagster.protocol.watermarks import KeptRows


class _Active(Protocol):
    @property
    def epoch(self) -> EpochId: ...


ActiveT = TypeVar("ActiveT", bound=_Active)


def active_epoch(active: ActiveT | None, epoch: EpochId, doing: str, where: str) -> ActiveT:
    """``active``, the session's active epoch, which must be ``epoch``: else LifecycleError (none is
    active) or EpochMismatch (another is). ``doing`` names the call in the error."""
    if active is None:
        raise LifecycleError(f"{doing} of epoch {epoch} without an active epoch", where=where)
    if active.epoch != epoch:
        raise EpochMismatch(f"{doing} of epoch {epoch} while {active.epoch} is active", where=where)
    return active


@dataclass
class HeldEpoch:
    """The active epoch: its batches, in the order they were applied, and whether it failed."""

    epoch: EpochId
    batches: list[SinkBatch] = field(default_factory=list)
    failed: bool = False


@dataclass
class ResourceTally:
    """What a committed epoch did to one resource: rows written and skipped (replays), and the first
    and last positions written."""

    written: int = 0
    skipped: int = 0
    first: str | None = None
    last: str | None = None

    def add(self, kept: KeptRows, written: int | None = None) -> None:
        """Count a batch's ``kept`` rows (``written`` of them landed: fewer when an upsert kept the
        last row of a key only; default: all)."""
        self.skipped += kept.skipped
        positions = kept.identities.positions
        if not positions:
            return
        self.written += len(positions) if written is None else written
        self.first = self.first or positions[0]
        self.last = positions[-1]

    def positions(self) -> dict[str, str]:
        """The receipt details naming the first and last positions written (none: nothing written)."""
        if self.first is None or self.last is None:
            return {}
        return {"first_position": self.first, "last_position": self.last}


class HeldEpochs:
    """The epochs of one session of ``stream`` under ``fencing_token``: at most one active at a time.

    ``key`` is the upsert key (empty: no key checks); ``where`` names the session in errors.
    """

    def __init__(self, stream: str, fencing_token: int, key: tuple[str, ...], where: str) -> None:
        self.stream = stream
        self.fencing_token = fencing_token
        self.key = key
        self.where = where
        self.active: HeldEpoch | None = None

    def begin(self, epoch: EpochId) -> None:
        if self.active is not None:
            raise LifecycleError(f"epoch {self.active.epoch} is still active", where=self.where)
        if epoch.stream != self.stream or epoch.fencing_token != self.fencing_token:
            raise EpochMismatch(
                f"epoch {epoch} is not for stream {self.stream} under fencing token {self.fencing_token}",
                where=self.where,
            )
        self.active = HeldEpoch(epoch)

    def current(self, epoch: EpochId, doing: str) -> HeldEpoch:
        """The active epoch, which must be ``epoch`` (``doing`` names the call in the error)."""
        return active_epoch(self.active, epoch, doing, self.where)

    def committable(self, epoch: EpochId) -> HeldEpoch:
        """The active epoch, ready to commit (not failed)."""
        state = self.current(epoch, "commit")
        if state.failed:
            raise LifecycleError(f"epoch {epoch} failed; abort it", where=self.where)
        return state

    def hold(self, epoch: EpochId, batch: SinkBatch, where: str) -> None:
        """Keep ``batch`` for the commit of ``epoch``, after checking what can be checked without the
        destination: a missing key column (SchemaError) or a row without its key (DataError naming
        its event identity) fails the epoch. ``where`` names the destination table."""
        state = self.current(epoch, "apply")
        if batch.epoch != epoch:
            raise EpochMismatch(f"a batch of epoch {batch.epoch} applied to {epoch}", where=self.where)
        if state.failed:
            raise LifecycleError(f"epoch {epoch} failed; abort it", where=self.where)
        if self.key:
            missing = [name for name in self.key if name not in batch.records.schema.names]
            if missing:
                state.failed = True
                raise SchemaError(f"the records lack key column(s) {', '.join(missing)}", where=where)
            row = first_row_without_key(batch.records, self.key)
            if row is not None:
                state.failed = True
                raise DataError(
                    f"the row has no value in a key column ({', '.join(self.key)})",
                    where=f"{where} @ {batch.identities.at(batch.domain, row)}",
                )
        if batch.records.num_rows:
            state.batches.append(batch)


__all__ = ["HeldEpoch", "HeldEpochs", "ResourceTally"]
