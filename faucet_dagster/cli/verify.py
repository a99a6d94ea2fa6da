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
from typing import TypeVar

from faucet_dagster.declarations.code_location import import_code_location
from faucet_dagster.declarations.declared import DECLARED
from faucet_dagster.protocol import FaucetError
from faucet_dagster.runner.sync import run_sync
from faucet_dagster.state import StateStore
from faucet_dagster.state.members import group_stream
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.verification import instance_reports
from faucet_dagster.syncs.declaration import FaucetSync
from faucet_dagster.syncs.verification import verify_sync_from_home
from faucet_dagster.verify import Outcome, Report, VerifyOptions, render_table, verify_stream

T = TypeVar("T")
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
    streams = _selected(args.stream) if args.stream or not args.sync else []
    syncs = _syncs(args.sync)
    reports = [_verify(stream, options) for stream in streams]
    reports += [verify_sync_from_home(sync, args.runs) for sync in syncs]
    merged = _merge(reports)
    if args.json:
        print(json.dumps(merged.to_dict(), indent=2))
    elif not streams and not syncs:
        print("no faucet stream or sync selected")
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
    """The declared streams named (all of them when none is named, unless syncs are)."""
    declared = {name: stream for name, stream in DECLARED.streams.items() if isinstance(stream, FaucetStream)}
    return _pick("stream", declared, names)


def _syncs(names: Sequence[str]) -> list[FaucetSync]:
    """The declared syncs named (none unless named: their runs are read from $DAGSTER_HOME)."""
    declared = {name: sync for name, sync in DECLARED.syncs.items() if isinstance(sync, FaucetSync)}
    return _pick("sync", declared, names) if names else []


def _pick(kind: str, declared: dict[str, T], names: Sequence[str]) -> list[T]:
    unknown = sorted(set(names) - set(declared))
    if unknown:
        raise FaucetError(
            f"no {kind} {', '.join(unknown)} is declared (declared: {', '.join(declared) or 'none'})",
            where="faucet verify",
        )
    return [item for name, item in declared.items() if not names or name in names]


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
