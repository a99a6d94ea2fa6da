"""``faucet verify``: check the certificates of a code location's streams (and its syncs' runs) again.

``faucet verify -m example_project.definitions`` imports the module as Dagster's code server would
(its faucet streams and syncs are recorded as they are built), then verifies each stream's
certificates after the last one verified (at most ``--limit``; ``--from``/``--to`` choose a range):
the chain in the state store, the covered ranges re-read at the source, the rows at the destination,
and, with ``$DAGSTER_HOME`` set, the materializations Dagster received (:mod:`faucet_dagster.verify`).
It prints a table with a line per certificate (``--json``: the report as JSON) and exits with 0 when
everything was verified (or nothing was new), 1 when something diverged, 3 when nothing diverged but
something could not be verified, 2 on bad input. docs/verification.md says how to read the result.
"""

import argparse
import json
import sys
from collections.abc import Sequence

from faucet_dagster.declarations.code_location import import_code_location
from faucet_dagster.declarations.declared import DECLARED
from faucet_dagster.protocol import FaucetError
from faucet_dagster.runner.sync import run_sync
from faucet_dagster.state import StateStore
from faucet_dagster.state.members import group_stream
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.verification import instance_reports
from faucet_dagster.verify import Outcome, Report, VerifyOptions, render_table, verify_stream

EXIT_DIVERGED = 1
EXIT_NOT_VERIFIABLE = 3


def verify_command(args: argparse.Namespace) -> int:
    try:
        import_code_location(args.module, args.working_directory)
    except FaucetError:
        raise
    except Exception as exc:  # noqa: BLE001 - the code location's own import error, shown as bad input
        print(f"error: {args.module} does not load: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    options = VerifyOptions(
        first=args.first,
        last=args.last,
        limit=args.limit,
        source=not args.no_source,
        destination=not args.no_destination,
        record=not args.no_record,
    )
    streams = _selected(args.stream)
    reports = [_verify(stream, options) for stream in streams]
    merged = _merge(reports)
    if args.json:
        print(json.dumps(merged.to_dict(), indent=2))
    elif not streams:
        print("no faucet stream declared")
    else:
        print(render_table(merged))
    return exit_code(merged)


def exit_code(report: Report) -> int:
    """0 verified (or nothing to verify), 1 diverged, 3 not verifiable."""
    return {
        Outcome.VERIFIED: 0,
        Outcome.DIVERGED: EXIT_DIVERGED,
        Outcome.NOT_VERIFIABLE: EXIT_NOT_VERIFIABLE,
    }[report.outcome]


def _selected(names: Sequence[str]) -> list[FaucetStream]:
    declared = {name: stream for name, stream in DECLARED.streams.items() if isinstance(stream, FaucetStream)}
    unknown = sorted(set(names) - set(declared))
    if unknown:
        raise FaucetError(
            f"no stream {', '.join(unknown)} is declared (declared: {', '.join(declared) or 'none'})",
            where="faucet verify",
        )
    return [stream for name, stream in declared.items() if not names or name in names]


def _verify(stream: FaucetStream, options: VerifyOptions) -> Report:
    names = (
        [group_stream(stream.name, group, stream.group_count) for group in range(stream.group_count)]
        if stream.workers > 1
        else [stream.name]
    )
    spec = stream.build_spec()
    reports = instance_reports(stream.asset_spec().key)
    with StateStore(stream.state_url) as store:
        return run_sync(verify_stream(spec, store, options, names=names, reports=reports))


def _merge(reports: Sequence[Report]) -> Report:
    return Report(
        tuple(item for report in reports for item in report.verifications),
        sum(report.seconds for report in reports),
        sum(report.rows_replayed for report in reports),
        sum(report.rows_compared for report in reports),
        tuple(note for report in reports for note in report.notes),
    )


__all__ = ["EXIT_DIVERGED", "EXIT_NOT_VERIFIABLE", "exit_code", "verify_command"]
