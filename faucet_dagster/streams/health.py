"""Stream health as Dagster metadata and check evaluations: the lag, the numbers Dagster plots, stalls.

* :func:`lag_metadata`, :func:`throughput_metadata`, :func:`table_metadata`: the parts of a certificate's
  metadata that Dagster plots on the asset's Plots tab (lag behind the source's head, epoch seconds,
  rows per second) and Dagster's standard table keys a stream can state exactly;
* :func:`tick_health`: the ``faucet_stream_health`` evaluation of a tick, passing when it certified,
  failing with the reason and the operator's remedy when the stream stalled (:class:`Stall`: halted on
  an error, uncertain, waiting on a lease), and the tick's log lines;
* :func:`stored_health`, :func:`check_result`: the evaluation an executed check returns, from the
  state store (one piece of code for streams on one owner and on workers).
"""

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

# Dagster's own set of the standard table keys; dagster 1.13 exports it from here only.
from dagster._core.definitions.metadata import TableMetadataSet

from faucet_dagster.protocol import EpochCertificate, ErrorKind, FaucetError, OwnershipLost, SourceLag
from faucet_dagster.state import StateStore, StateStoreUnavailable
from faucet_dagster.streams.declaration import AssetKeyLike, FaucetStream

HEALTH_CHECK = "faucet_stream_health"
logger = logging.getLogger(__name__)


def metadata_table(columns: Mapping[str, str], rows: Sequence[Mapping[str, Any]]) -> dg.TableMetadataValue:
    """A metadata table of ``rows`` with ``columns`` (name to Dagster column type), in that order."""
    return dg.TableMetadataValue(
        records=[dg.TableRecord({name: row[name] for name in columns}) for row in rows],
        schema=dg.TableSchema(columns=[dg.TableColumn(name, kind) for name, kind in columns.items()]),
    )


def throughput_metadata(certificate: EpochCertificate) -> dict[str, Any]:
    """The epoch's seconds (its timed steps, lease to commit) and the rows it sealed per second: numbers
    Dagster plots on the asset's Plots tab."""
    seconds = sum(certificate.timings.values())
    rows = sum(certificate.row_counts.values())
    return {
        "faucet/epoch_seconds": dg.MetadataValue.float(round(seconds, 3)),
        "faucet/rows_per_second": dg.MetadataValue.float(round(rows / seconds, 1) if seconds > 0 else 0.0),
    }


def lag_metadata(lag: Sequence[SourceLag]) -> dict[str, Any]:
    """How far the source's head was ahead of the certified coverage (empty when the source cannot tell).

    ``faucet/lag_positions`` sums ``behind`` over the domains (in ``faucet/lag_unit``: messages,
    offsets, WAL bytes); ``faucet/lag_seconds`` is the largest lag in time, present only when every
    domain knows its times; ``faucet/lag`` is the table per domain.
    """
    if not lag:
        return {}
    units = sorted({item.unit for item in lag})
    seconds = [item.seconds for item in lag]
    metadata: dict[str, Any] = {
        "faucet/lag_positions": dg.MetadataValue.int(sum(item.behind for item in lag)),
        "faucet/lag_unit": dg.MetadataValue.text(", ".join(units)),
        "faucet/lag": metadata_table(
            {
                "domain": "string",
                "position": "string",
                "head": "string",
                "behind": "int",
                "unit": "string",
                "seconds": "string",
            },
            [
                {
                    "domain": str(item.domain),
                    "position": item.position or "",
                    "head": item.head or "",
                    "behind": item.behind,
                    "unit": item.unit,
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


def table_metadata(certificate: EpochCertificate) -> dict[str, Any]:
    """Dagster's table keys a stream can state exactly: ``dagster/table_name`` (database.schema.table)
    when every receipt names the same table with its database. Never ``dagster/row_count``: that is the
    table's rows, which a sink cannot count cheaply and exactly (the epoch's are ``faucet/rows_written``)."""
    names = {
        f"{receipt.details['database']}.{receipt.details['table']}"
        if receipt.details.get("database") and receipt.details.get("table")
        else None
        for receipt in certificate.receipts
    }
    if len(names) != 1 or None in names:
        return {}
    [name] = names
    return dict(TableMetadataSet(table_name=name))


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
    """Why a tick certified nothing while the stream has work, and what the operator does about it."""

    reason: str
    remedy: str
    severity: dg.AssetCheckSeverity

    def describe(self) -> str:
        return f"stalled: {self.reason}. Remedy: {self.remedy}"


def stall_of(
    stream: str,
    lease_seconds: float,
    *,
    failure: FaucetError | None = None,
    lost: OwnershipLost | None = None,
) -> Stall | None:
    """The stall a tick's outcome means (None: the stream is healthy, idle, or inside a source
    transaction that spans ticks).

    A failure halts the stream (ERROR, remedy by the error's kind); a lease another worker holds
    holds it up (WARN).
    """
    if failure is not None:
        remedy = _REMEDIES.get(failure.kind, "read the error; the next tick runs the stream again")
        return Stall(
            f"halted on {type(failure).__name__}: {failure}",
            remedy.format(stream=stream),
            dg.AssetCheckSeverity.ERROR,
        )
    if lost is not None:
        return Stall(
            f"waiting on a lease another worker holds: {lost}",
            "none while that worker runs (its certificates are reported here); if that process is gone, "
            f"the lease expires by itself within lease_seconds ({lease_seconds:.0f}s), or run "
            f"`faucet streams release {stream}` to take over at once (fencing stops the old worker)",
            dg.AssetCheckSeverity.WARN,
        )
    return None


def uncertain_stall(stream: str, reason: str | None) -> Stall:
    """The stall of a stream marked uncertain in the state store (no worker takes it over)."""
    return Stall(
        f"the stream is marked uncertain: {reason}",
        _REMEDIES[ErrorKind.UNCERTAIN_OUTCOME].format(stream=stream),
        dg.AssetCheckSeverity.ERROR,
    )


def health_evaluation(
    asset_key: dg.AssetKey, stall: Stall | None, last: EpochCertificate | None
) -> dg.AssetCheckEvaluation:
    """The ``faucet_stream_health`` evaluation: failing with the stall's reason and remedy, or passing
    with the lag as of ``last`` (the newest certificate)."""
    metadata: dict[str, Any] = (
        {} if last is None else {"faucet/epoch": str(last.epoch), **lag_metadata(last.lag)}
    )
    if stall is not None:
        metadata |= {"faucet/reason": stall.reason, "faucet/remedy": stall.remedy}
    lacking = describe_missing_fields(last)
    if lacking:
        metadata["faucet/rows_missing_fields"] = lacking
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


@dataclass(frozen=True)
class TickHealth:
    """What a tick adds for health: check evaluations to report, and a skip reason for a stalled tick."""

    events: tuple[dg.AssetCheckEvaluation, ...] = ()
    skip: str | None = None


def tick_health(
    context: dg.SensorEvaluationContext,
    stream: str,
    lease_seconds: float,
    asset_key: dg.AssetKey,
    certificates: Sequence[EpochCertificate],
    *,
    failure: FaucetError | None,
    lost: OwnershipLost | None,
) -> TickHealth:
    """Log what the tick certified (epochs, rows, lag) and say whether the stream stalled.

    A tick that reports certificates passes the health check, unless it also failed. A stalled tick
    reporting nothing gets the failing evaluation and its description as the skip reason; when it is
    about to fail (``failure``), the evaluation goes to the instance at once (the failed tick reports
    no events) and the remedy is added to the error, which the tick shows.

    Only a stall is written to the tick's own log (``context.log``, which opens the Dagster instance
    in the code server and stores the log at the tick's end: a tenth of a second to a second per tick
    on a loaded machine, inside the daemon's serial sensor loop). A healthy tick's reason says what
    it certified already; that line goes to the process's log.
    """
    # Certificates reported mean progress, whoever certified them; a failure after them still halts.
    healthy = bool(certificates) and failure is None
    stall = None if healthy else stall_of(stream, lease_seconds, failure=failure, lost=lost)
    if certificates:
        line = f"stream {stream}: {describe_certified(certificates)}"
        if stall is None:
            logger.info(line)
        else:
            context.log.info(line)
    if stall is None:
        if not certificates:
            return TickHealth()
        return TickHealth((health_evaluation(asset_key, None, certificates[-1]),))
    context.log.warning(f"stream {stream} {stall.describe()}")
    evaluation = health_evaluation(asset_key, stall, certificates[-1] if certificates else None)
    if failure is not None and not certificates:
        failure.add_note(f"Remedy: {stall.remedy}")
        # A context built without an instance (tests) has nowhere to report: the failed tick says it all.
        with contextlib.suppress(dg.DagsterInvariantViolationError):
            context.instance.report_runless_asset_event(evaluation)
        return TickHealth()
    return TickHealth((evaluation,), stall.describe())


def describe_certified(certificates: Sequence[EpochCertificate]) -> str:
    """What a tick reported, for people: ``certified 3 epochs (12 to 14), 13500 rows; lag ...``."""
    rows = sum(sum(certificate.row_counts.values()) for certificate in certificates)
    epochs = "1 epoch" if len(certificates) == 1 else f"{len(certificates)} epochs"
    return (
        f"certified {epochs} ({certificates[0].sequence} to {certificates[-1].sequence}), {rows} rows; "
        f"lag {describe_lag(certificates[-1].lag)}"
    )


def describe_lag(lag: Sequence[SourceLag]) -> str:
    """The lag for people, per domain, or why it is unknown."""
    if not lag:
        return "unknown (the source does not say where its head is)"
    return "; ".join(item.describe() for item in lag)


def health_check(stream: FaucetStream, asset_key: AssetKeyLike | None = None) -> dg.AssetChecksDefinition:
    """The ``faucet_stream_health`` check: the stream certifies epochs and is not stalled.

    Evaluated by the sensor on every tick that certifies (passing, with the lag) or stalls (failing
    with the reason and the remedy). Executed on demand, it reads the state store: failing while the
    stream is marked uncertain, else passing with the lag of the last certificate.
    """
    key = stream.asset_spec(asset_key).key

    @dg.asset_check(
        asset=key,
        name=HEALTH_CHECK,
        description="The stream certifies epochs: not halted, uncertain or waiting on a lease.",
    )
    def _check() -> dg.AssetCheckResult:
        try:
            with StateStore(stream.state_url) as store:
                return check_result(stored_health(store, key, [stream.name]))
        except StateStoreUnavailable as exc:  # within the store's timeout: "state store unreachable: ..."
            return dg.AssetCheckResult(
                passed=False, severity=dg.AssetCheckSeverity.ERROR, description=str(exc)
            )

    return _check
