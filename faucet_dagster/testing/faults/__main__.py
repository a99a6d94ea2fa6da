"""``python -m faucet_dagster.testing.faults``: run fault cases on fresh servers and print the table.

Without ``--iterations`` it runs every named fault once per selected pair. With ``--iterations N``
it runs ``N`` cases drawn from ``--seed`` (printed, so a run can be repeated); ``--only I`` runs case
``I`` of that schedule alone. Exit code 0 when every case passed, 1 otherwise, 2 for bad arguments.
"""

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from faucet_dagster.testing.faults.case import CaseParams, CaseResult
from faucet_dagster.testing.faults.harness import (
    ScheduledCase,
    battery,
    describe,
    managed_servers,
    random_schedule,
    run_schedule,
    summary,
    table,
)
from faucet_dagster.testing.faults.pairs import PAIRS, Pair, pair_named


def _pairs(text: str) -> list[Pair]:
    if text == "all":
        return list(PAIRS)
    try:
        return [pair_named(name.strip()) for name in text.split(",") if name.strip()]
    except KeyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(
        prog="python -m faucet_dagster.testing.faults",
        description="Crash and recover real faucet pipelines; check every record.",
    )
    parse.add_argument(
        "--pairs",
        type=_pairs,
        default=list(PAIRS),
        help=f"'all' or a comma-separated list of: {', '.join(pair.name for pair in PAIRS)}",
    )
    parse.add_argument("--iterations", type=int, default=0, help="randomized cases (0: the named battery)")
    parse.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: drawn, printed)")
    parse.add_argument("--only", type=int, default=None, help="run only this case of the schedule")
    parse.add_argument("--records", type=int, default=None, help="records per case of the named battery")
    parse.add_argument(
        "--workdir", type=Path, default=None, help="keep case files here (default: a temp dir)"
    )
    parse.add_argument("--json", type=Path, default=None, help="write every case's result here")
    return parse


def _schedule(args: argparse.Namespace) -> tuple[list[ScheduledCase], str]:
    if args.iterations <= 0:
        params = CaseParams() if args.records is None else CaseParams(records=args.records)
        return battery(args.pairs, params), "the named faults, once per pair"
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    schedule = random_schedule(seed, args.iterations, args.pairs)
    if args.only is not None:
        schedule = [case for case in schedule if case.index == args.only]
    return schedule, f"{args.iterations} randomized cases, seed {seed}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    schedule, title = _schedule(args)
    if not schedule:
        print("nothing to run", file=sys.stderr)
        return 2
    print(f"fault injection: {title}", flush=True)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="faucet-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def report(case: ScheduledCase, result: CaseResult) -> None:
        verdict = "pass" if result.passed else "FAIL"
        notes = f" - {'; '.join(result.notes)}" if result.notes and not result.passed else ""
        print(
            f"[{case.index}] {verdict} {describe(case)}: {result.verdict.lost} lost, "
            f"{result.verdict.duplicated} duplicated, {result.seconds:.1f}s{notes}",
            flush=True,
        )

    with managed_servers(sorted({case.pair for case in schedule}, key=PAIRS.index)) as servers:
        results = run_schedule(servers, root, schedule, report)
    print()
    print(table(results))
    print()
    print(f"{summary(results)} ({title}, {time.monotonic() - started:.0f}s, files in {root})")
    if args.json is not None:
        plain = [
            {"case": describe(case), **result.to_dict()}
            for case, result in zip(schedule, results, strict=True)
        ]
        args.json.write_text(json.dumps(plain, indent=2))
    return 0 if all(result.passed for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
