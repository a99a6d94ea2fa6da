"""The error taxonomy of the Faucet Connector Protocol.

Every fallible path of a connector ends in a :class:`FaucetError`. The runner decides what to do from
``kind`` and ``retryable`` (retry, fail, dead-letter, halt the stream), never from the message text.
Third-party exceptions are wrapped with ``raise ConnectionFailed(...) from exc`` so the cause stays in
the traceback while the type stays ours.

Messages name what was wrong and where (a table, a file, a topic/partition/offset) and never contain
secrets: build them from redacted config (:meth:`faucet_dagster.protocol.config.ConnectorConfig.redacted`).
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum


class ErrorKind(StrEnum):
    """What kind of failure an error reports; the runner acts on this, not on the message."""

    CONFIG = "config"
    CONNECTION = "connection"
    AUTH = "auth"
    DATA = "data"
    SCHEMA = "schema"
    PLAN = "plan"
    POSITION_UNAVAILABLE = "position_unavailable"
    INCARNATION_CHANGED = "incarnation_changed"
    OWNERSHIP_LOST = "ownership_lost"
    EPOCH_MISMATCH = "epoch_mismatch"
    INTEGRITY = "integrity"
    UNCERTAIN_OUTCOME = "uncertain_outcome"
    LIFECYCLE = "lifecycle"
    CONFLICT = "conflict"
    UNSUPPORTED = "unsupported"
    INTERNAL = "internal"


class FaucetError(Exception):
    """Root of every error a connector, the pipeline or the runner raises.

    ``where`` names the place the error is about (``"table public.orders"``, ``"orders/2 @ 1042"``),
    so a user can act on it without reading a traceback.
    """

    kind: ErrorKind = ErrorKind.INTERNAL
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        where: str | None = None,
        retryable: bool | None = None,
        details: Mapping[str, str] | None = None,
    ) -> None:
        self.message = message
        self.where = where
        self.details: dict[str, str] = dict(details or {})
        if retryable is not None:
            self.retryable = retryable
        super().__init__(f"{message} ({where})" if where else message)


class ConfigError(FaucetError):
    """The configuration is invalid or names something that does not exist."""

    kind = ErrorKind.CONFIG


class ConnectionFailed(FaucetError):
    """A server could not be reached or dropped the connection; trying again may succeed."""

    kind = ErrorKind.CONNECTION
    retryable = True


class AuthError(FaucetError):
    """The server refused the credentials or the permission."""

    kind = ErrorKind.AUTH


class DataError(FaucetError):
    """One record is malformed; it may go to the dead-letter route instead of halting the run."""

    kind = ErrorKind.DATA


class SchemaError(FaucetError):
    """The records do not fit the destination schema (and evolution is off or cannot help)."""

    kind = ErrorKind.SCHEMA


class PositionUnavailable(FaucetError):
    """A resume position no longer exists at the source (retention, purge, truncation).

    Raised instead of silently resuming from a later position: that would lose data.
    """

    kind = ErrorKind.POSITION_UNAVAILABLE


class IncarnationChanged(FaucetError):
    """The source was deleted and recreated: a stored position belongs to a previous incarnation."""

    kind = ErrorKind.INCARNATION_CHANGED


class OwnershipLost(FaucetError):
    """This worker no longer holds the stream's lease; it must not change source or sink state."""

    kind = ErrorKind.OWNERSHIP_LOST


class EpochMismatch(FaucetError):
    """A batch or a lifecycle call names an epoch other than the active one."""

    kind = ErrorKind.EPOCH_MISMATCH


class IntegrityError(FaucetError):
    """The pipeline has no evidence for what was claimed (coverage, counts, digest, boundary)."""

    kind = ErrorKind.INTEGRITY


class UncertainOutcome(FaucetError):
    """It is unknown whether a commit or a shutdown took effect; takeover must wait for an operator."""

    kind = ErrorKind.UNCERTAIN_OUTCOME


class CommitConflict(FaucetError):
    """Another writer committed to the destination first and the two commits conflict (optimistic
    concurrency: two transactions updated the same rows, two table-format commits claimed the same
    transaction identifier). Nothing of this commit took effect; trying again re-reads the destination
    and may succeed, or find that another owner took over."""

    kind = ErrorKind.CONFLICT
    retryable = True


class LifecycleError(FaucetError):
    """A method was called out of its documented order (commit without begin, apply after commit)."""

    kind = ErrorKind.LIFECYCLE


class UnsupportedOperation(FaucetError):
    """The connector does not implement an optional part of the protocol; its capabilities say so."""

    kind = ErrorKind.UNSUPPORTED


@dataclass(frozen=True)
class Violation:
    """One reason a source/sink pair cannot keep its promise.

    ``code`` is stable across releases (scripts and tests match on it); ``rule`` is the planner rule
    number of DESIGN.md section 2.3; ``message`` is for people.
    """

    code: str
    rule: int
    message: str

    def __str__(self) -> str:
        return f"[{self.code}] rule {self.rule}: {self.message}"


class PlanError(FaucetError):
    """The planner refused a pair; ``violations`` lists every reason, not only the first."""

    kind = ErrorKind.PLAN

    def __init__(self, violations: Iterable[Violation], *, where: str | None = None) -> None:
        self.violations: tuple[Violation, ...] = tuple(violations)
        if not self.violations:
            raise ValueError("PlanError needs at least one violation")
        lines = "\n".join(f"  - {violation}" for violation in self.violations)
        super().__init__(f"the plan was refused for {len(self.violations)} reason(s):\n{lines}", where=where)

    @property
    def codes(self) -> tuple[str, ...]:
        return tuple(violation.code for violation in self.violations)
