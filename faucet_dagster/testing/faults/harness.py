"""Schedules of fault cases, running them against one set of servers, and the pair x fault table.

:func:`battery` is every named fault once per pair (what the test suite runs). :func:`random_schedule`
draws ``iterations`` cases from a seed: the pair, the fault (half of them signals at random moments,
half the named faults with random hits and sizes) and its parameters, so the same seed gives the same
schedule again, and ``--only N`` reruns case ``N`` of it alone.
"""

import math
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from faucet_dagster.protocol import Mode
from faucet_dagster.runner.faults import Action
from faucet_dagster.testing.faults.case import CaseParams, CaseResult
from faucet_dagster.testing.faults.catalog import Fault, FaultKind, named_faults, not_applicable
from faucet_dagster.testing.faults.pairs import PAIRS, Pair, Servers
from faucet_dagster.testing.faults.scenarios import run_case
from faucet_dagster.testing.faults.verification import verified_cell
from faucet_dagster.testing.servers import (
    ConformantFetchKafkaServer,
    NatsServer,
    PostgresServer,
    make_unique_name,
)


@dataclass(frozen=True)
class ScheduledCase:
    """Case ``index`` of a schedule: a fault on a pair, with its parameters."""

    index: int
    pair: Pair
    fault: Fault
    params: CaseParams


def battery(pairs: Sequence[Pair], params: CaseParams | None = None) -> list[ScheduledCase]:
    """Every named fault once per pair, with the same parameters (default: :class:`CaseParams`)."""
    params = params or CaseParams()
    cases = [(pair, fault) for pair in pairs for fault in named_faults(pair)]
    return [ScheduledCase(index, pair, fault, params) for index, (pair, fault) in enumerate(cases)]


def random_schedule(seed: int, iterations: int, pairs: Sequence[Pair]) -> list[ScheduledCase]:
    """``iterations`` cases drawn from ``seed`` (the same seed, the same schedule)."""
    rng = random.Random(seed)
    return [_draw(rng, index, pairs) for index in range(iterations)]


def _draw(rng: random.Random, index: int, pairs: Sequence[Pair]) -> ScheduledCase:
    pair = rng.choice(list(pairs))
    if rng.random() < 0.5:
        fault = Fault(FaultKind.RANDOM, rng.choice((Action.KILL, Action.TERM)))
    else:
        fault = rng.choice(named_faults(pair))
    records = rng.randint(1_000, 5_000)
    size = rng.choice([size for size in (100, 200, 400, 800) if size <= records // 4])
    epochs = math.ceil(records / size)
    params = CaseParams(
        records=records,
        epoch_records=size,
        # Leave epochs after the hit: a zombie's successor must certify some.
        hit=rng.randint(1, max(1, min(4, epochs - 3))),
        random_after=rng.randint(0, epochs - 1),
        random_delay=rng.uniform(0.0, 0.05),
        kill_delay=rng.uniform(0.0, 0.003),
        restart_after=rng.randint(1, 3),
    )
    return ScheduledCase(index, pair, fault, params)


def run_schedule(
    servers: Servers,
    root: Path,
    schedule: Sequence[ScheduledCase],
    report: Callable[[ScheduledCase, CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Run every case in order, each under ``root``; ``report`` is called after each."""
    results = []
    for case in schedule:
        result = run_case(servers, root, case.pair, case.fault, case.params)
        results.append(result)
        if report is not None:
            report(case, result)
    return results


@contextmanager
def managed_servers(pairs: Sequence[Pair], base_dir: Path | None = None) -> Iterator[Servers]:
    """Servers started for ``pairs`` (only those they use; PostgreSQL always, for the state of
    bounded sinks), owned so they can be restarted, closed on exit."""
    used = {server for pair in pairs for server in pair.servers_used}
    with ExitStack() as stack:
        postgres = stack.enter_context(PostgresServer(base_dir=base_dir))
        nats = NatsServer(base_dir=base_dir)
        # Tansu's answer to a deleted topic's Fetch crashes librdkafka: see ConformantFetchKafkaServer.
        kafka = ConformantFetchKafkaServer(base_dir=base_dir)
        for name, server in (("nats", nats), ("kafka", kafka)):
            stack.callback(server.close)
            if name in used:
                server.start()
        url = postgres.create_database(make_unique_name("faults"))
        yield Servers(postgres, nats, kafka, url)


def table(results: Sequence[CaseResult], pairs: Sequence[Pair] = PAIRS) -> str:
    """The pair x fault table (markdown): runs, how many faults fired as scheduled, records, lost,
    duplicated, halted correctly, how the certificates verified (``faucet verify``), passed; each
    pair headed by the planner's delivery guarantee, and the faults left out, with why, below."""
    head = (
        "| pair | fault | runs | fired | records | lost | duplicated | halted correctly | verified | passed |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    left_out: dict[str, list[str]] = {}
    for pair in pairs:
        mine = [result for result in results if result.pair == pair.name]
        if not mine:
            continue
        delivery = mine[0].delivery.replace("_", "-")
        lines.append(f"| **{pair.label}** | *{delivery}* | | | | | | | | |")
        for fault in dict.fromkeys(result.fault for result in mine):
            rows = [result for result in mine if result.fault == fault]
            runs = len(rows)
            lines.append(
                f"| {pair.name} | {fault} | {runs} | {sum(r.fired for r in rows)} | "
                f"{sum(r.verdict.records for r in rows)} | {sum(r.verdict.lost for r in rows)} | "
                f"{sum(r.verdict.duplicated for r in rows)} | "
                f"{sum(r.halted_correctly for r in rows)}/{runs} | {verified_cell(rows)} | "
                f"{sum(r.passed for r in rows)}/{runs} |"
            )
        for fault_name, reason in not_applicable(pair):
            left_out.setdefault(f"{fault_name}: {reason}", []).append(pair.name)
    for reason, names in left_out.items():
        lines.append(f"\nNot run for {', '.join(names)}: {reason}.")
    return "\n".join(lines)


def summary(results: Sequence[CaseResult]) -> str:
    """Totals, and the lost and duplicated records of the pairs the planner calls effectively-once."""
    once = [result for result in results if result.delivery == "effectively_once"]
    failed = [result for result in results if not result.passed]
    return (
        f"{len(results)} runs, {len(failed)} failed; effectively-once pairs: {len(once)} runs, "
        f"{sum(r.verdict.records for r in once)} records, {sum(r.verdict.lost for r in once)} lost, "
        f"{sum(r.verdict.duplicated for r in once)} duplicated"
    )


def describe(case: ScheduledCase) -> str:
    params = case.params
    extra = ""
    if case.fault.kind is FaultKind.RANDOM:
        extra = f" {params.random_delay:.2f}s after step {params.random_after}"
    elif case.fault.kind in (FaultKind.POINT, FaultKind.ZOMBIE, FaultKind.FAILED_COMMIT):
        extra = f" hit {params.hit}"
    elif case.fault.kind is FaultKind.RESTART:
        unit = "epochs" if case.pair.mode is Mode.CONTINUOUS else "pages"
        extra = f" after {params.restart_after} {unit}"
    return (
        f"{case.pair.name} {case.fault.name}{extra} "
        f"({params.records} records, {params.epoch_records} per epoch)"
    )


__all__ = [
    "ScheduledCase",
    "battery",
    "describe",
    "managed_servers",
    "random_schedule",
    "run_schedule",
    "summary",
    "table",
]
