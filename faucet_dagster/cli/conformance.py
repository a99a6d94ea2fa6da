"""``faucet conformance``: run the battery on installed connectors and print the table of checks.

``faucet conformance NAME`` runs every role of an installed connector (``faucet.connectors``) that
has a conformance setup (``faucet.conformance`` entry point, or this repository's
:mod:`faucet_dagster.conformance.targets`: see :mod:`faucet_dagster.conformance.registry`); ``--all``
every such connector; ``--role`` and ``--check`` restrict to roles and check ids; ``--seed`` and
``--examples`` choose the generated scenarios (a failure prints the command that replays it).
``--self-test`` runs each check against the deliberately broken connectors (the scenarios under
``--seeds`` seeds each) and prints which check, and which step of which scenario, caught each. The
real servers come from :mod:`faucet_dagster.testing` (started here, on free ports, and stopped at
the end), or from ``FAUCET_TEST_POSTGRES_URL`` / ``FAUCET_TEST_NATS_URL`` /
``FAUCET_TEST_KAFKA_BOOTSTRAP``. Exit code: 0 when nothing failed, 1 when a check failed.
"""

import argparse
import asyncio
import dataclasses
import time
from typing import Any

from faucet_dagster.cli.terminal import fit_text, fold_pipe_table, terminal_width
from faucet_dagster.conformance.fixtures import Fixtures
from faucet_dagster.conformance.harness import Subject
from faucet_dagster.conformance.options import ConformanceFailure, ConformanceOptions
from faucet_dagster.conformance.registry import conformance_setups
from faucet_dagster.conformance.setup import ConfigFactory
from faucet_dagster.conformance.suites import SUITES, Check, run_check
from faucet_dagster.conformance.table import Result, format_table
from faucet_dagster.protocol import ConfigError, ConnectorSpec, Role, load_connectors


def add_conformance_parser(commands: Any) -> None:
    """Add ``faucet conformance`` to the ``faucet`` command's subparsers."""
    parser = commands.add_parser(
        "conformance",
        help="run the conformance battery on connectors and print the table of checks",
        description="Run the conformance battery on installed connectors (the faucet.connectors entry "
        "point) that have a conformance setup (the faucet.conformance entry point), and print the table "
        "of checks by connector. The servers the checks need (PostgreSQL, NATS JetStream, a "
        "Kafka-protocol broker) start on free local ports and stop at the end, unless "
        "FAUCET_TEST_POSTGRES_URL, FAUCET_TEST_NATS_URL or FAUCET_TEST_KAFKA_BOOTSTRAP name your own. "
        "Exit codes: 0 nothing failed, 1 a check failed, 2 bad input.",
    )
    parser.add_argument("connectors", nargs="*", help="names of installed connectors")
    parser.add_argument("--all", action="store_true", help="every installed connector with a setup")
    parser.add_argument("--check", action="append", default=[], help="run only this check id (repeatable)")
    parser.add_argument(
        "--role", action="append", default=[], choices=[role.value for role in Role], help="only this role"
    )
    parser.add_argument("--seed", type=int, default=None, help="the seed of the generated scenarios")
    parser.add_argument("--examples", type=int, default=None, help="scenarios per connector role")
    parser.add_argument(
        "--self-test",
        action="store_true",
        help="run the checks on deliberately broken connectors and print which check caught each",
    )
    parser.add_argument("--seeds", type=int, default=None, help="--self-test: seeds per scenario case")
    parser.set_defaults(handler=conformance_command)


def conformance_command(args: argparse.Namespace) -> int:
    if args.self_test:
        return _self_test(args.check, args.seeds)
    setups = conformance_setups()
    installed = load_connectors()
    testable = sorted(name for name in setups if name in installed)
    names = testable if args.all else list(args.connectors)
    if not names:
        raise ConfigError("name a connector, or pass --all", where="faucet conformance")
    for name in names:
        if name not in installed:
            raise ConfigError(
                f"no connector named {name!r} is installed "
                f"(installed: {', '.join(sorted(installed)) or 'none'})",
                where="faucet conformance",
            )
        if name not in setups:
            raise ConfigError(
                f"connector {name!r} is installed, but has no conformance setup: its package registers "
                f"one in the faucet.conformance entry-point group (see docs/conformance.md); testable: "
                f"{', '.join(testable) or 'none'}",
                where="faucet conformance",
            )
    results: list[Result] = []
    with Fixtures() as fixtures:
        for name in names:
            spec = installed[name]
            for role, (factory, options) in setups[name].roles().items():
                if args.role and role.value not in args.role:
                    continue
                chosen = _scenario_options(options, args.seed, args.examples)
                for check in SUITES[role].checks:
                    if args.check and check.id not in args.check:
                        continue
                    label = f"{name} {role.value}"
                    result = _run(check, label, spec, role, fixtures, factory, chosen)
                    _print(f"{label:<26} {check.id:<32} {result.status}")
                    results.append(result)
    print()
    print(fold_pipe_table(format_table(results), terminal_width()))
    return 1 if any(result.status == "fail" for result in results) else 0


def _scenario_options(
    options: ConformanceOptions, seed: int | None, examples: int | None
) -> ConformanceOptions:
    if seed is not None:
        options = dataclasses.replace(options, seed=seed)
    if examples is not None:
        options = dataclasses.replace(options, examples=examples)
    return options


def _self_test(only: list[str], seeds: int | None) -> int:
    """Every self-test case (every scenario case under each seed): broken connector -> what caught it."""
    from faucet_dagster.conformance.selftest import CASES, SEEDS, caught_at, run_case

    count = SEEDS if seeds is None else seeds
    rows = 0
    missed: list[str] = []
    started = time.monotonic()
    with Fixtures() as fixtures:
        for case in CASES:
            if only and case.check not in only:
                continue
            where = f"{case.broken} ({case.spec().name} {case.role.value})"
            for seed in range(count) if case.seeded else (0,):
                rows += 1
                try:
                    failure = run_case(
                        case, fixtures.setup(case.factory), seed=seed, fresh=fixtures.fresh(case.factory)
                    )
                except AssertionError as exc:
                    verdict = f"NOT CAUGHT: {exc}"
                    missed.append(f"{where} seed {seed}")
                else:
                    verdict = f"caught [{failure.rule}]" + (
                        f" at {caught_at(failure)}" if case.seeded else ""
                    )
                label = f"{case.check} seed {seed}" if case.seeded else case.check
                _print(f"{where:<58} -> {label:<36} {verdict}")
    print()
    print(
        f"{rows - len(missed)} of {rows} broken connector runs caught "
        f"(the scenarios under {count} seed(s) each) in {time.monotonic() - started:.0f}s"
    )
    return 1 if missed else 0


def _print(line: str) -> None:
    """A line of progress, wrapped to the terminal and shown at once."""
    print(fit_text(line, terminal_width()), flush=True)


def _run(
    check: Check,
    label: str,
    spec: ConnectorSpec,
    role: Role,
    fixtures: Fixtures,
    factory: ConfigFactory,
    options: ConformanceOptions,
) -> Result:
    """One check of one connector role, with a fresh setup; a failure becomes a ``fail`` row."""
    try:
        subject = Subject(spec, role, fixtures.setup(factory), options, fresh=fixtures.fresh(factory))
        outcome = asyncio.run(run_check(check, subject))
    except ConformanceFailure as exc:
        return Result(label, check.id, "fail", str(exc))
    except Exception as exc:  # noqa: BLE001 - an unexpected error is a failed check, shown in the table
        return Result(label, check.id, "fail", f"{type(exc).__name__}: {exc}")
    return Result(label, check.id, outcome.status.value, outcome.detail, outcome.exercised)


__all__ = ["add_conformance_parser", "conformance_command"]
