"""``python -m bench``: run scenarios and their baselines in one process, print a table, write JSON.

One pass cannot tell a regression from noise on a shared machine, so every selected scenario runs
``--repeat`` times, each run just after a run of its baseline (round 1: A B A C, round 2: A B A C, ...):
each round's ratio compares two runs made seconds apart, and the table reports the median ratio with its
range.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.context import BenchContext
from bench.registry import Scenario, all_scenarios, select
from bench.scenarios import load_all

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Result:
    """One scenario over every round: its runs' rows/s and, per round, the ratio to its baseline.

    ``rows_per_s`` and ``seconds`` are the medians of the successful runs; ``ratio`` is the median of
    the per-round ratios (this scenario's rows/s over its baseline's in the same round), ``ratio_min``
    and ``ratio_max`` their range. ``error`` is the first failure (a failed round has no ratio).
    """

    name: str
    baseline: str | None
    rows: int | None = None
    seconds: float | None = None
    rows_per_s: float | None = None
    ratio: float | None = None
    ratio_min: float | None = None
    ratio_max: float | None = None
    runs: list[float | None] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    error: str | None = None
    details: Mapping[str, object] = field(default_factory=dict)
    cpu: list[dict[str, float]] = field(default_factory=list)
    """Per run, the CPU seconds spent while the scenario's function ran (its untimed set-up included):
    ``process`` by this process (its threads: the clients, librdkafka's), ``machine`` by every process
    (the servers too), and the ``wall`` seconds of that call. What tells a run bound by the machine's
    cores from one bound by a single thread (the GIL)."""


def _machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has spent since boot (Linux ``/proc/stat``: all but
    idle and I/O wait); 0.0 where there is no such file."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(value) for value in stat.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _run_once(item: Scenario, ctx: BenchContext, result: Result) -> float | None:
    """Run ``item`` once; record its rows, seconds and details; return its rows/s (None: failed)."""
    process, machine, wall = time.process_time(), _machine_busy_seconds(), time.perf_counter()
    try:
        measured = item.fn(ctx)
    except Exception as exc:  # noqa: BLE001 - printed, reported, and the exit status is 1
        traceback.print_exc()
        result.error = result.error or f"{type(exc).__name__}: {exc}"
        return None
    result.rows, result.details = measured.rows, measured.details
    result.cpu.append(
        {
            "process": round(time.process_time() - process, 3),
            "machine": round(_machine_busy_seconds() - machine, 3),
            "wall": round(time.perf_counter() - wall, 3),
        }
    )
    return measured.rows / measured.seconds if measured.seconds > 0 else None


def run_scenarios(scenarios: Sequence[Scenario], ctx: BenchContext, repeat: int = 1) -> list[Result]:
    """Run ``scenarios`` ``repeat`` rounds on ``ctx``, each round in order; a failing run is recorded
    and the rounds go on.

    A scenario's ratio in a round is its rate over the rate of its baseline's run just before it: when
    another scenario ran in between, the baseline runs again first (A B A C ..., not A B C), so the
    two runs compared are seconds apart whatever the server did during the scenarios before (a
    checkpoint, autovacuum of earlier tables). Every run of a baseline counts in its median rate.
    """
    results = {item.name: Result(item.name, item.baseline) for item in scenarios}
    by_name = {item.name: item for item in scenarios}

    def run(item: Scenario, round_number: int) -> float | None:
        print(f"# [{round_number}/{repeat}] {item.name}: {item.description}", flush=True)
        speed = _run_once(item, ctx, results[item.name])
        results[item.name].runs.append(speed)
        return speed

    for round_number in range(1, repeat + 1):
        ctx.round = round_number
        last: tuple[str, float | None] | None = None
        for item in scenarios:
            base = None
            if item.baseline is not None:
                if last is None or last[0] != item.baseline:
                    last = (item.baseline, run(by_name[item.baseline], round_number))
                base = last[1]
            mine = run(item, round_number)
            if mine and base:
                results[item.name].ratios.append(mine / base)
            last = (item.name, mine)
    for result in results.values():
        speeds_ok = [speed for speed in result.runs if speed]
        if speeds_ok:
            result.rows_per_s = statistics.median(speeds_ok)
            result.seconds = result.rows / result.rows_per_s if result.rows else None
        if result.ratios:
            result.ratio = statistics.median(result.ratios)
            result.ratio_min, result.ratio_max = min(result.ratios), max(result.ratios)
    return list(results.values())


def format_table(results: Sequence[Result]) -> str:
    """The results as a plain-text table: median rows/s, and the median ratio to the baseline with
    its min-max over the rounds."""
    header = ("scenario", "rows", "seconds", "rows/s", "runs", "vs baseline (median, min-max)")
    lines: list[tuple[str, ...]] = [header]
    for r in results:
        if r.rows_per_s is None:
            lines.append((r.name, "-", "-", "-", "0", f"FAILED: {r.error}"[:60]))
            continue
        ratio = (
            f"{r.ratio:.2f}x ({r.ratio_min:.2f}-{r.ratio_max:.2f}) {r.baseline}"
            if r.ratio is not None and r.ratio_min is not None and r.ratio_max is not None
            else ""
        )
        if r.error is not None:
            ratio = f"{ratio} (some runs FAILED: {r.error})"[:100]
        lines.append(
            (
                r.name,
                f"{r.rows:,}" if r.rows is not None else "-",
                f"{r.seconds:.3f}" if r.seconds is not None else "-",
                f"{r.rows_per_s:,.0f}",
                f"{sum(1 for speed in r.runs if speed)}/{len(r.runs)}",
                ratio,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    out = []
    for n, line in enumerate(lines):
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:-1], widths[1:], strict=True)]
        out.append("  ".join([*cells, line[-1]]).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run benchmark scenarios with their baselines on the same data and servers.",
    )
    parser.add_argument("--rows", type=int, default=200_000, help="rows per scenario (default 200000)")
    parser.add_argument(
        "--only",
        action="append",
        metavar="PATTERN",
        help="glob on scenario names, e.g. 'raw.kafka_*' (repeatable; baselines are added)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="where to write results (default bench/results/<ts>.json)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=5,
        metavar="N",
        help="rounds, each scenario interleaved with its baseline (default 5; ratios are medians)",
    )
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    if args.rows <= 0:
        parser.error("--rows must be positive")
    if args.repeat <= 0:
        parser.error("--repeat must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status (1 when a scenario failed)."""
    args = parse_args(argv)
    load_all()
    if args.list:
        for item in all_scenarios().values():
            base = f"  (baseline {item.baseline})" if item.baseline else ""
            print(f"{item.name:28} {item.description}{base}")
        return 0
    try:
        scenarios = select(args.only)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    started = datetime.datetime.now(datetime.UTC)
    began = time.perf_counter()
    ctx = BenchContext(args.rows)
    try:
        results = run_scenarios(scenarios, ctx, args.repeat)
        servers = ctx.servers()
    finally:
        ctx.close()

    print()
    print(format_table(results))
    print("load average (1, 5, 15 min) at the end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    path: Path = args.json or RESULTS_DIR / f"{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "started_at": started.isoformat(),
        "wall_seconds": round(time.perf_counter() - began, 3),
        "rows": args.rows,
        "repeat": args.repeat,
        "load_average": list(os.getloadavg()),
        "only": args.only,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "servers": servers,
        "results": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 1 if any(r.error is not None for r in results) else 0
