"""``python -m bench``: run scenarios and their baselines in one process, print a table, write JSON."""

import argparse
import datetime
import json
import platform
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
    name: str
    baseline: str | None
    rows: int | None = None
    seconds: float | None = None
    rows_per_s: float | None = None
    ratio: float | None = None
    error: str | None = None
    details: Mapping[str, object] = field(default_factory=dict)


def run_scenarios(scenarios: Sequence[Scenario], ctx: BenchContext) -> list[Result]:
    """Run ``scenarios`` in order on ``ctx``; a failing scenario is recorded and the run goes on."""
    results: dict[str, Result] = {}
    for item in scenarios:
        result = Result(item.name, item.baseline)
        print(f"# {item.name}: {item.description}", flush=True)
        try:
            measured = item.fn(ctx)
        except Exception as exc:  # noqa: BLE001 - printed, reported, and the exit status is 1
            traceback.print_exc()
            result.error = f"{type(exc).__name__}: {exc}"
        else:
            result.rows, result.seconds, result.details = measured.rows, measured.seconds, measured.details
            result.rows_per_s = measured.rows / measured.seconds if measured.seconds > 0 else None
        results[item.name] = result
    for result in results.values():
        base = results.get(result.baseline) if result.baseline else None
        if base is not None and base.rows_per_s and result.rows_per_s:
            result.ratio = result.rows_per_s / base.rows_per_s
    return list(results.values())


def format_table(results: Sequence[Result]) -> str:
    """The results as a plain-text table; ratio is rows/s divided by the baseline's rows/s."""
    header = ("scenario", "rows", "seconds", "rows/s", "vs baseline")
    lines: list[tuple[str, ...]] = [header]
    for r in results:
        if r.error is not None:
            lines.append((r.name, "-", "-", "-", f"FAILED: {r.error}"[:60]))
            continue
        ratio = f"{r.ratio:.2f}x {r.baseline}" if r.ratio is not None else ""
        lines.append(
            (
                r.name,
                f"{r.rows:,}",
                f"{r.seconds:.3f}",
                f"{r.rows_per_s:,.0f}" if r.rows_per_s is not None else "-",
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
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    if args.rows <= 0:
        parser.error("--rows must be positive")
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
        results = run_scenarios(scenarios, ctx)
        servers = ctx.servers()
    finally:
        ctx.close()

    print()
    print(format_table(results))
    path: Path = args.json or RESULTS_DIR / f"{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "started_at": started.isoformat(),
        "wall_seconds": round(time.perf_counter() - began, 3),
        "rows": args.rows,
        "only": args.only,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "servers": servers,
        "results": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 1 if any(r.error is not None for r in results) else 0
