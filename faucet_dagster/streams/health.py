"""Stream health: why a stream stalls, what the operator does about it, and the
``faucet_stream_health`` check.

* :class:`Stall` and its makers: halted on an error (:func:`halt_stall`, the remedy by the error's
  kind), waiting on a lease another worker holds or this process lost (:func:`lease_stall`, naming the
  real holder), marked uncertain (:func:`uncertain_stall`);
* :func:`health_evaluation`: the check's evaluation, failing with a stall's reason and remedy, or
  passing with the newest lag. A sensor reports it when the stream's health changes (a stall begins,
  changes or ends), not on every tick;
* :func:`stored_health`, :func:`check_result`: the evaluation an executed check returns, from the
  state store (one piece of code for streams on one owner and on workers).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

from faucet_dagster.protocol import EpochCertificate, ErrorKind, FaucetError
from faucet_dagster.state import StateStore, StateStoreUnavailable
from faucet_dagster.streams.cursor import Halt
from faucet_dagster.streams.reports import lag_metadata

HEALTH_CHECK = "faucet_stream_health"


# -- health: lag and stalls -------------------------------------------------------------------

_REMEDIES: Mapping[ErrorKind, str] = {
    ErrorKind.CONNECTION: "the next tick retries; check that the server named is reachable",
    ErrorKind.AUTH: "fix the credentials of the server named, then reload the code location",
    ErrorKind.CONFIG: "fix the stream's configuration where the error points, then reload the code location",
    ErrorKind.SCHEMA: "make the destination accept the rows (schema_evolution, or change the table), then "
    "the next tick retries",
    ErrorKind.PLAN: "choose a policy and delivery the pair supports (`faucet plan` explains), then reload",
    ErrorKind.DATA: "fix the record at the source or route bad rows to the dead-letter route "
    "(on_bad_row: dead_letter); the stream stays halted at the certified position until then",
    ErrorKind.POSITION_UNAVAILABLE: "the source no longer holds the certified position (retention removed "
    "unread data): faucet never skips ahead; restore the data or start a stream under a new name",
    ErrorKind.INCARNATION_CHANGED: "the source was deleted and recreated, so its old positions mean nothing "
    "there: restore it or start a stream under a new name",
    ErrorKind.INTEGRITY: "certificates, source and destination disagree: investigate before anything "
    "else (`faucet streams status`); nothing is acknowledged meanwhile",
    ErrorKind.UNCERTAIN_OUTCOME: "check the destination holds the last epoch's effects or none of them, then "
    "run `faucet streams release {stream}`",
}


@dataclass(frozen=True)
class Stall:
    """Why a stream makes no progress, and what the operator does about it. ``key`` stays the same
    while the stall does (a tick reports the health check again only when it changes)."""

    reason: str
    remedy: str
    severity: dg.AssetCheckSeverity
    key: str

    def describe(self) -> str:
        return f"stalled: {self.reason}. Remedy: {self.remedy}"


def remedy_of(stream: str, failure: FaucetError) -> str:
    """What the operator does about ``failure`` of ``stream``, by the error's kind."""
    remedy = _REMEDIES.get(failure.kind, "read the error; the next tick runs the stream again")
    return remedy.format(stream=stream)


def halt_stall(halt: Halt) -> Stall:
    """A stream halted on an error (ERROR): its runner tries again from the certified positions on
    each tick. The key is the error's type: a halt reported once is not reported again while it lasts,
    whatever its message says from tick to tick (a server that went away, then refuses connections)."""
    kind = halt.reason.split(":", 1)[0]
    return Stall(f"halted on {halt.reason}", halt.remedy, dg.AssetCheckSeverity.ERROR, f"halt:{kind}")


def lease_stall(stream: str, lease_seconds: float, holder: str | None, *, mine: bool, detail: str) -> Stall:
    """A stream whose lease this process does not hold (WARN), naming the real holder.

    ``holder`` is the live holder the state store names (None: nobody holds it now); ``mine``: that
    holder is this process itself (it lost its lease, for example while the state store could not
    be reached, and takes it again), never "another worker".
    """
    if holder is not None and not mine:
        return Stall(
            f"waiting on a lease another worker holds: {holder} ({detail})",
            "none while that worker runs (its certificates are reported here); if that process is gone, "
            f"the lease expires by itself within lease_seconds ({lease_seconds:.0f}s), or run "
            f"`faucet streams release --force {stream}` to take over at once (fencing stops the old worker)",
            dg.AssetCheckSeverity.WARN,
            f"lease:{holder}",
        )
    who = "this process holds it again" if mine else "nobody holds it now"
    return Stall(
        f"this process lost its lease ({detail}); {who}",
        "none: the next tick takes the lease again and resumes at the certified positions; if it recurs, "
        "check that the state store answers within a third of lease_seconds "
        f"({lease_seconds / 3:.0f}s)",
        dg.AssetCheckSeverity.WARN,
        "lease:lost",
    )


def one_line(text: str, limit: int = 400) -> str:
    """``text`` on one line, at most ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def uncertain_stall(stream: str, reason: str | None) -> Stall:
    """The stall of a stream marked uncertain in the state store (no worker takes it over)."""
    return Stall(
        f"the stream is marked uncertain: {reason}",
        _REMEDIES[ErrorKind.UNCERTAIN_OUTCOME].format(stream=stream),
        dg.AssetCheckSeverity.ERROR,
        f"uncertain:{reason}",
    )


def health_evaluation(
    asset_key: dg.AssetKey, stall: Stall | None, last: EpochCertificate | None
) -> dg.AssetCheckEvaluation:
    """The ``faucet_stream_health`` evaluation: failing with the stall's reason and remedy, or passing
    with the lag as of ``last`` (the newest certificate)."""
    metadata: dict[str, Any] = (
        {}
        if last is None
        else {"faucet/epoch": dg.MetadataValue.text(str(last.epoch)), **lag_metadata(last.lag)}
    )
    if stall is not None:
        metadata |= {
            "faucet/reason": dg.MetadataValue.text(stall.reason),
            "faucet/remedy": dg.MetadataValue.text(stall.remedy),
        }
    lacking = describe_missing_fields(last)
    if lacking:
        metadata["faucet/rows_missing_fields"] = dg.MetadataValue.text(lacking)
    healthy = "the stream certifies epochs" + (f"; rows lacked fields: {lacking}" if lacking else "")
    return dg.AssetCheckEvaluation(
        asset_key=asset_key,
        check_name=HEALTH_CHECK,
        passed=stall is None,
        metadata=metadata,
        severity=dg.AssetCheckSeverity.ERROR if stall is None else stall.severity,
        description=healthy if stall is None else stall.describe(),
    )


def describe_missing_fields(certificate: EpochCertificate | None) -> str:
    """The fields the rows of ``certificate``'s epoch lacked, for people (``orders.name: 12 rows``);
    "" when none lacked any: a field that stops arriving shows in the health check."""
    if certificate is None:
        return ""
    return "; ".join(
        f"{resource}.{name}: {count} rows"
        for resource, fields in sorted(certificate.missing_fields.items())
        for name, count in sorted(fields.items())
        if count
    )


def stored_health(
    store: StateStore, asset_key: dg.AssetKey, streams: Sequence[str], stall: Stall | None = None
) -> dg.AssetCheckEvaluation:
    """The ``faucet_stream_health`` evaluation from the state store, for a stream certified under
    ``streams`` (its own name, or its partition groups' names): failing with ``stall`` when given,
    else while one of them is marked uncertain, else passing with the lag of the newest certificate."""
    names = set(streams)  # every known stream's status: one not started yet has none
    statuses = [status for status in store.status() if status.stream in names]
    if stall is None:
        stuck = next((status for status in statuses if status.uncertain), None)
        stall = None if stuck is None else uncertain_stall(stuck.stream, stuck.uncertain_reason)
    lasts = [store.last_certificate(status.stream) for status in statuses]
    newest = max((c for c in lasts if c is not None), key=lambda c: c.created_at, default=None)
    return health_evaluation(asset_key, stall, newest)


def check_result(evaluation: dg.AssetCheckEvaluation) -> dg.AssetCheckResult:
    """An evaluation as what an executed asset check returns."""
    return dg.AssetCheckResult(
        passed=evaluation.passed,
        metadata=evaluation.metadata,
        severity=evaluation.severity,
        description=evaluation.description,
    )


def health_check(
    state_url: str | None, streams: Sequence[str], asset_key: dg.AssetKey
) -> dg.AssetChecksDefinition:
    """The ``faucet_stream_health`` check of ``asset_key``, for a stream certified under ``streams``
    (its name): the stream certifies epochs and is not stalled.

    Reported by the sensor when the stream's health changes: failing with the reason and the remedy
    when it stalls, passing again when it makes progress. Executed on demand, it reads the state store:
    failing while the stream is marked uncertain, else passing with the lag of the last certificate.
    """

    @dg.asset_check(
        asset=asset_key,
        name=HEALTH_CHECK,
        description="The stream certifies epochs: not halted, uncertain or waiting on a lease.",
    )
    def _check() -> dg.AssetCheckResult:
        try:
            with StateStore(state_url) as store:
                return check_result(stored_health(store, asset_key, streams))
        except StateStoreUnavailable as exc:  # within the store's timeout: "state store unreachable: ..."
            return dg.AssetCheckResult(
                passed=False, severity=dg.AssetCheckSeverity.ERROR, description=str(exc)
            )

    return _check
