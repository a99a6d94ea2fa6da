"""The ``faucet_verify`` asset check of a continuous stream: its certificates checked again, on demand
(the UI, a schedule: :func:`faucet_dagster.declarations.verification.verify_schedule`).

Each execution verifies the certificates after the last one verified, at most ``limit``
(:func:`faucet_dagster.verify.verify_stream`): the chain in the state store, what Dagster was sent
(the materializations of the sink asset), the covered ranges re-read at the source, and the rows at
the destination. A stream on several workers is verified partition group by partition group.
"""

import os
from collections.abc import Mapping

import dagster as dg

from faucet_dagster.declarations.verification import VERIFY_CHECK, verification_result
from faucet_dagster.runner.sync import run_sync
from faucet_dagster.state import StateStore
from faucet_dagster.state.members import group_stream
from faucet_dagster.streams.declaration import AssetKeyLike, FaucetStream
from faucet_dagster.verify import VerifyOptions, verify_stream
from faucet_dagster.verify.streams import Reports

DEFAULT_LIMIT = 100
"""Certificates one execution verifies (per partition group), after the last one verified."""
REPORT_PAGES = 20
"""Pages of materializations read back (newest first) to find the reports of the verified range."""


def verify_check(
    stream: FaucetStream, asset_key: AssetKeyLike | None = None, *, limit: int = DEFAULT_LIMIT
) -> dg.AssetChecksDefinition:
    """The ``faucet_verify`` check of ``stream``'s sink asset (see the module docstring)."""
    key = stream.asset_spec(asset_key).key
    resource_keys = {
        endpoint.resource_key for endpoint in (stream.source, stream.sink) if endpoint.resource_key
    }
    names = (
        [group_stream(stream.name, group, stream.group_count) for group in range(stream.group_count)]
        if stream.workers > 1
        else [stream.name]
    )

    @dg.asset_check(
        asset=key,
        name=VERIFY_CHECK,
        description=(
            "Certificates checked again: the chain, the covered ranges re-read at the source, and the "
            "rows at the destination."
        ),
        required_resource_keys=resource_keys or None,
        blocking=False,
    )
    def _check(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        spec = stream.build_spec(context.resources)
        with StateStore(stream.state_url) as store:
            report = run_sync(
                verify_stream(
                    spec,
                    store,
                    VerifyOptions(limit=limit),
                    names=names,
                    reports=materialized(context.instance, key),
                )
            )
        return verification_result(report)

    return _check


def materialized(instance: dg.DagsterInstance, key: dg.AssetKey) -> Reports:
    """What the materializations of ``key`` report, as :data:`~faucet_dagster.verify.streams.Reports`:
    the fingerprint of each certificate of a chain from ``first`` to ``last``, from the reports'
    ``faucet/certificates`` tables, read back newest first until the range is passed (at most
    ``REPORT_PAGES`` pages)."""

    def reports(name: str, first: int, last: int) -> Mapping[int, str]:
        found: dict[int, str] = {}
        cursor = None
        for _ in range(REPORT_PAGES):
            page = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=key), limit=200, cursor=cursor
            )
            oldest = None
            for record in page.records:
                materialization = record.asset_materialization
                table = (
                    None if materialization is None else materialization.metadata.get("faucet/certificates")
                )
                for row in table.records if isinstance(table, dg.TableMetadataValue) else ():
                    data = row.data
                    if data.get("stream") != name or not data.get("fingerprint"):
                        continue
                    sequence = int(str(data["sequence"]))
                    oldest = sequence if oldest is None else min(oldest, sequence)
                    if first <= sequence <= last:
                        found.setdefault(sequence, str(data["fingerprint"]))
            if not page.has_more or (oldest is not None and oldest < first):
                break
            cursor = page.cursor
        return found

    return reports


def instance_reports(key: dg.AssetKey) -> Reports | None:
    """:func:`materialized` on the instance of ``$DAGSTER_HOME`` (for ``faucet verify``); None when it
    is not set (Dagster is then not asked)."""
    if not os.environ.get("DAGSTER_HOME"):
        return None
    return materialized(dg.DagsterInstance.get(), key)


__all__ = ["DEFAULT_LIMIT", "instance_reports", "materialized", "verify_check"]
