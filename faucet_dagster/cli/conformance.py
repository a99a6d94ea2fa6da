"""``faucet conformance``: run the battery on installed connectors and print the table of checks.

``faucet conformance NAME`` runs every role of an installed connector (``faucet.connectors``) that
has a conformance setup (``faucet.conformance`` entry point, or this repository's
:mod:`.targets`: see :mod:`.registry`); ``--all`` every such connector; ``--check`` restricts to
check ids; ``--self-test`` runs each check against the deliberately broken connectors and prints
which check caught which. The real servers come from
:mod:`faucet_dagster.testing` (started here, on free ports, and stopped at the end), or from
``FAUCET_TEST_POSTGRES_URL`` / ``FAUCET_TEST_NATS_URL`` / ``FAUCET_TEST_KAFKA_BOOTSTRAP``. Exit code:
0 when nothing failed, 1 when a check failed.
"""

import argparse
import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from faucet_dagster.cli.terminal import fit_text, fold_pipe_table, terminal_width
from faucet_dagster.conformance.harness import Subject
from faucet_dagster.conformance.options import ConformanceFailure, ConformanceOptions
from faucet_dagster.conformance.registry import conformance_setups
from faucet_dagster.conformance.setup import ConfigFactory, factory_fixtures
from faucet_dagster.conformance.suites import SUITES, Check, run_check
from faucet_dagster.conformance.table import Result, format_table
from faucet_dagster.protocol import ConfigError, ConnectorSpec, Role, load_connectors
from faucet_dagster.testing import KafkaServer, NatsServer, PostgresServer, make_unique_name


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
        "--self-test",
        action="store_true",
        help="run the checks on deliberately broken connectors and print which check caught each",
    )
    parser.set_defaults(handler=conformance_command)


def conformance_command(args: argparse.Namespace) -> int:
    if args.self_test:
        return _self_test(args.check)
    setups = conformance_setups()
    installed = load_connectors()
    testable = sorted(name for name in setups if name in installed)
    names = testable if args.all else list(args.connectors)
    if not names:
        raise ConfigError("name a connector, or pass --all", where="faucet conformance")
    unknown = [name for name in names if name not in testable]
    if unknown:
        raise ConfigError(
            f"no installed connector with a conformance setup is named {', '.join(unknown)} "
            f"(testable: {', '.join(testable) or 'none'})",
            where="faucet conformance",
        )
    results: list[Result] = []
    with _Fixtures() as fixtures:
        for name in names:
            spec = installed[name]
            for role, (factory, options) in setups[name].roles().items():
                for check in SUITES[role].checks:
                    if args.check and check.id not in args.check:
                        continue
                    label = f"{name} {role.value}"
                    result = _run(check, label, spec, role, fixtures, factory, options)
                    _print(f"{label:<26} {check.id:<32} {result.status}")
                    results.append(result)
    print()
    print(fold_pipe_table(format_table(results), terminal_width()))
    return 1 if any(result.status == "fail" for result in results) else 0


def _self_test(only: list[str]) -> int:
    """Every self-test case: rule x broken connector -> the check that caught it (or why not)."""
    from faucet_dagster.conformance.selftest import CASES, run_case

    rows: list[tuple[str, str, str, str]] = []
    with _Fixtures() as fixtures:
        for case in CASES:
            if only and case.check not in only:
                continue
            where = f"{case.broken} ({case.spec().name} {case.role.value})"
            try:
                run_case(case, fixtures.call(case.factory, case.check))
            except AssertionError as exc:
                verdict = f"NOT CAUGHT: {exc}"
            else:
                verdict = "caught"
            _print(f"{case.rule:<82} {where:<52} -> {case.check:<30} {verdict}")
            rows.append((case.rule, where, case.check, verdict))
    missed = [row for row in rows if row[3] != "caught"]
    print()
    print(f"{len(rows) - len(missed)} of {len(rows)} broken connectors caught by the check of their rule")
    return 1 if missed else 0


def _print(line: str) -> None:
    """A line of progress, wrapped to the terminal and shown at once."""
    print(fit_text(line, terminal_width()), flush=True)


def _run(
    check: Check,
    label: str,
    spec: ConnectorSpec,
    role: Role,
    fixtures: "_Fixtures",
    factory: ConfigFactory,
    options: ConformanceOptions,
) -> Result:
    """One check of one connector role, with a fresh setup; a failure becomes a ``fail`` row."""
    try:
        subject = Subject(spec, role, fixtures.call(factory, check.id), options)
        outcome = asyncio.run(run_check(check, subject))
    except ConformanceFailure as exc:
        return Result(label, check.id, "fail", str(exc))
    except Exception as exc:  # noqa: BLE001 - an unexpected error is a failed check, shown in the table
        return Result(label, check.id, "fail", f"{type(exc).__name__}: {exc}")
    return Result(label, check.id, outcome.status.value, outcome.detail)


class _Fixtures:
    """The fixtures a config factory may name, outside pytest: servers start on first use."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._postgres: PostgresServer | None = None
        self._nats: NatsServer | None = None
        self._kafka: KafkaServer | None = None

    def __enter__(self) -> "_Fixtures":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def call(self, factory: ConfigFactory, check: str) -> Any:
        """Call ``factory`` with fresh fixture values for one check; they are released at exit."""
        values = {name: self._value(name, check) for name in factory_fixtures(factory)}
        return factory(**values)

    def _value(self, name: str, check: str) -> Any:
        if name == "postgres_url":
            server = self._postgres or self._start(PostgresServer.from_env())
            self._postgres = server
            database = make_unique_name("conformance", check)
            url = server.create_database(database)
            self._stack.callback(server.drop_database, database)
            return url
        if name in ("nats_url", "nats_server"):
            self._nats = self._nats or self._start(NatsServer.from_env())
            return self._nats.url if name == "nats_url" else self._nats
        if name == "kafka_bootstrap":
            self._kafka = self._kafka or self._start(KafkaServer.from_env())
            return self._kafka.bootstrap
        if name == "unique_name":
            return lambda prefix="t": make_unique_name(prefix, check)
        if name == "tmp_path":
            return self._stack.enter_context(_temporary_folder())
        raise ConfigError(f"a config factory asks for fixture {name!r}, which faucet conformance lacks")

    def _start(self, server: Any) -> Any:
        self._stack.callback(server.close)
        return server.start()


@contextmanager
def _temporary_folder() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="faucet-conformance-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["add_conformance_parser", "conformance_command"]
