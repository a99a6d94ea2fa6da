"""The ``faucet`` command line: one entry point, a module per command.

``faucet plan`` (:mod:`.plan`) checks a source/sink pair before anything runs; ``faucet check``
(:mod:`.check`) connects to every connection of a code location; ``faucet streams`` (:mod:`.streams`)
shows and releases streams; ``faucet cdc`` (:mod:`.cdc`) prepares a database for change data capture;
``faucet partitions`` (:mod:`.partitions`) adds the partitions of new shards; ``faucet verify``
(:mod:`.verify`) checks certificates again against the source and the destination; ``faucet
conformance`` (:mod:`.conformance`) runs the battery against an installed connector. Exit codes: 0
success, 1 refused or failed, 2 bad input (``faucet verify``: 3 not verifiable).
"""

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from faucet_dagster.cli.cdc import add_cdc_parser
from faucet_dagster.cli.conformance import add_conformance_parser
from faucet_dagster.cli.plan import EXIT_REFUSED, add_plan_parser
from faucet_dagster.cli.streams import add_streams_parser
from faucet_dagster.protocol import FaucetError

EXIT_BAD_INPUT = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
    except FaucetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="faucet",
        description="Check, run and inspect faucet-dagster's syncs and streams: move data between systems "
        "inside Dagster with delivery guarantees it can prove.",
        epilog="Run 'faucet COMMAND --help' for a command's options. Exit codes: 0 success, 1 refused or "
        "failed, 2 bad input.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(commands)
    add_streams_parser(commands)
    add_cdc_parser(commands)
    _add_check_parser(commands)
    _add_partitions_parser(commands)
    _add_verify_parser(commands)
    add_conformance_parser(commands)
    return parser


def _add_check_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "check",
        help="connect to every connection of a code location and plan every pair",
        description="Import a code location, connect to every connection of its faucet syncs and "
        "streams (secrets from the environment), check what each names exists, plan each pair, and "
        "print a table. Exit codes: 0 every check passed, 1 one failed, 2 bad input.",
    )
    _add_code_location_arguments(parser)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds each connector's check may take")
    parser.set_defaults(handler=_dagster_command("faucet_dagster.cli.check", "check_command"))


def _add_partitions_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "partitions",
        help="the dynamic partitions of sharded syncs",
        description="The dynamic partitions of sharded syncs: one partition per shard (a file of a sync "
        "with shard_by_file), added by each sync's partitions sensor or by 'refresh'.",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    refresh = actions.add_parser(
        "refresh",
        help="add a partition for each new shard of every sharded sync of a code location",
        description="Evaluate every faucet partitions sensor of the code location once, against the "
        "instance of $DAGSTER_HOME, and add the partitions they request.",
    )
    _add_code_location_arguments(refresh)
    refresh.add_argument("-a", "--attribute", default="defs", help="its Definitions (default: defs)")
    refresh.set_defaults(handler=_dagster_command("faucet_dagster.cli.partitions", "refresh_command"))


def _add_code_location_arguments(parser: argparse.ArgumentParser) -> None:
    """``-m MODULE`` and ``-d DIRECTORY``: a code location as Dagster's own commands name it."""
    parser.add_argument("-m", "--module", required=True, help="the code location's module (Dagster's -m)")
    parser.add_argument(
        "-d",
        "--working-directory",
        type=Path,
        default=Path.cwd(),
        help="where to import it from (default: .)",
    )


def _add_verify_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "verify",
        help="check certificates again against the source and the destination",
        description="Import a code location and verify its streams' certificates after the last ones "
        "verified: the chain in the state store, the covered ranges re-read at the source, the rows at "
        "the destination and, with $DAGSTER_HOME set, what Dagster received. Prints a line per "
        "certificate. Exit codes: 0 verified (or nothing new), 1 diverged, 2 bad input, 3 not verifiable.",
    )
    _add_code_location_arguments(parser)
    parser.add_argument("--stream", action="append", default=[], help="only this stream (repeatable)")
    parser.add_argument(
        "--sync",
        action="append",
        default=[],
        help="this sync's latest runs too (repeatable; needs $DAGSTER_HOME)",
    )
    parser.add_argument("--runs", type=int, default=1, help="runs per sync (default: the latest)")
    parser.add_argument(
        "--from", dest="first", type=int, help="first certificate (default: after the last verified)"
    )
    parser.add_argument(
        "--to", dest="last", type=int, help="last certificate (default: --limit from the first)"
    )
    parser.add_argument("--limit", type=int, default=100, help="certificates per stream without --to")
    parser.add_argument("--no-source", action="store_true", help="do not re-read the source")
    parser.add_argument("--no-destination", action="store_true", help="do not read the destination")
    parser.add_argument("--no-record", action="store_true", help="do not record the outcomes in the store")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=_dagster_command("faucet_dagster.cli.verify", "verify_command"))


def _dagster_command(module: str, name: str) -> Any:
    """A handler imported when it runs: these commands load Dagster, which `faucet plan` does not."""

    def handler(args: argparse.Namespace) -> int:
        code: int = getattr(importlib.import_module(module), name)(args)
        return code

    return handler


__all__ = ["EXIT_BAD_INPUT", "EXIT_REFUSED", "main"]


if __name__ == "__main__":
    sys.exit(main())
