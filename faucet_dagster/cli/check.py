"""``faucet check``: connect to every connection of a code location and plan every pair, with a table.

``faucet check -m example_project.definitions`` imports the module as Dagster's code server would
(its faucet syncs and component streams are recorded as they are built), then, for each sync and
stream: builds each connector with its secrets read from the environment, runs its ``check()``
(connect, authenticate, verify that the table, topic or stream exists) within a timeout, and plans
the pair. Exit codes: 0 every check passed, 1 one failed, 2 bad input (the module does not load).
"""

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from faucet_dagster.cli.terminal import Column, format_grid, terminal_width
from faucet_dagster.declarations.code_location import import_code_location
from faucet_dagster.declarations.declared import DECLARED
from faucet_dagster.declarations.preflight import pair_problems
from faucet_dagster.declarations.resources import FaucetEndpoint
from faucet_dagster.protocol import ConnectionFailed, FaucetError, Mode, Role, StreamingSink, StreamSource
from faucet_dagster.runner.sync import run_sync


@dataclass(frozen=True)
class CheckRow:
    """One line of the table: a declaration's role, the connector, what it names, the outcome."""

    declaration: str
    role: str
    connector: str
    dataset: str
    ok: bool
    outcome: str


def check_command(args: argparse.Namespace) -> int:
    try:
        import_code_location(args.module, args.working_directory)
    except FaucetError:
        raise  # a faucet declaration refused while loading: main() prints it, exit 2
    except Exception as exc:  # noqa: BLE001 - the code location's own import error, shown as bad input
        print(f"error: {args.module} does not load: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    rows = check_declared(args.timeout)
    print_table(rows)
    return 0 if all(row.ok for row in rows) else 1


def check_declared(timeout: float) -> list[CheckRow]:
    """Check every sync and stream this process declared (see the module docstring)."""
    rows: list[CheckRow] = []
    for name, sync in DECLARED.syncs.items():
        where = f"sync {name}"
        sides = [("source", sync.source, Role.SOURCE), ("sink", sync.sink, Role.SINK)]
        if sync.dead_letter is not None:
            sides.append(("dead_letter", sync.dead_letter, Role.SINK))
        rows.extend(_check_endpoint(where, side, endpoint, role, timeout) for side, endpoint, role in sides)
        rows.append(_plan_row(where, pair_problems(sync.pair_check()), Mode.BOUNDED))
    for name, stream in DECLARED.streams.items():
        where = f"stream {name}"
        rows.append(_check_endpoint(where, "source", stream.source, Role.STREAM_SOURCE, timeout))
        rows.append(_check_endpoint(where, "sink", stream.sink, Role.STREAMING_SINK, timeout))
    return rows


def _plan_row(where: str, problems: Sequence[str], mode: Mode) -> CheckRow:
    return CheckRow(
        where, "plan", "", mode.value, not problems, "accepted" if not problems else "; ".join(problems)
    )


def _check_endpoint(where: str, side: str, endpoint: FaucetEndpoint, role: Role, timeout: float) -> CheckRow:
    label = endpoint.label
    if isinstance(endpoint.connection, str):
        return CheckRow(where, side, label, "", False, "a resource key: bind it and check from a run")
    dataset = ""
    try:
        connection = endpoint.connection
        config = connection.resolved_config(endpoint.config)
        built = connection.spec().build(role, config)
        dataset = str(built.dataset_uri()) if hasattr(built, "dataset_uri") else _stream_dataset(config)
        check, close = _check_and_close(built)
        if check is None:
            return CheckRow(where, side, label, dataset, True, "no check (the connector has none)")
        run_sync(_within(check, close, timeout, f"{where} {side}"))
    except FaucetError as exc:
        return CheckRow(where, side, label, dataset, False, str(exc))
    return CheckRow(where, side, label, dataset, True, "ok")


def _stream_dataset(config: dict[str, Any]) -> str:
    """What a stream connector names, for the table (no secrets: names only)."""
    for key in ("stream", "topics", "table", "slot"):
        value = config.get(key)
        if value:
            return f"{key}={','.join(map(str, value)) if isinstance(value, list | tuple) else value}"
    return ""


def _check_and_close(
    built: object,
) -> tuple[Callable[[], Awaitable[None]] | None, Callable[[], Awaitable[None]] | None]:
    close = getattr(built, "close", None)
    if isinstance(built, StreamSource) and type(built).check is StreamSource.check:
        return None, close
    if isinstance(built, StreamingSink) and type(built).check is StreamingSink.check:
        return None, close
    return getattr(built, "check", None), close


async def _within(
    check: Callable[[], Awaitable[None]],
    close: Callable[[], Awaitable[None]] | None,
    timeout: float,
    where: str,
) -> None:
    try:
        await asyncio.wait_for(check(), timeout)
    except TimeoutError:
        raise ConnectionFailed(f"no answer within {timeout:g} s", where=where) from None
    finally:
        if close is not None:
            await close()


def print_table(rows: Sequence[CheckRow]) -> None:
    """The table, fitted to the terminal (what each connection names and the result wrap), and the
    count of checks that passed and failed."""
    if not rows:
        print("no faucet sync or stream declared")
        return
    cells = [
        (
            row.declaration,
            row.role,
            row.connector,
            row.dataset,
            row.outcome if row.ok else f"FAILED: {row.outcome}",
        )
        for row in rows
    ]
    for line in format_grid(CHECK_COLUMNS, cells, terminal_width()):
        print(line)
    failed = sum(not row.ok for row in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")


CHECK_COLUMNS = (
    Column("declaration", wraps=True),
    Column("role"),
    Column("connector"),
    Column("dataset", wraps=True),
    Column("result", wraps=True),
)


__all__ = ["CheckRow", "check_command", "check_declared", "print_table"]
