"""``faucet cdc setup``: create the replication slot and publication a change source reads.

Flags override the config file's values; ``--replica-identity-full`` sets REPLICA IDENTITY FULL on a
table without a primary key instead of refusing it. The work is
:func:`faucet_dagster.runner.replication.setup_change_source`, which the Dagster resource method calls
too.
"""

import argparse
import json
from pathlib import Path

from faucet_dagster.cli.files import parse_flag_value, read_yaml
from faucet_dagster.protocol import ConfigError
from faucet_dagster.runner.replication import setup_change_source


def add_cdc_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``cdc setup`` to the ``faucet`` command line."""
    cdc = commands.add_parser(
        "cdc",
        help="prepare a database for change data capture",
        description="Prepare a database for change data capture: the publication and the replication "
        "slot a change source reads.",
    )
    actions = cdc.add_subparsers(dest="cdc_command", required=True)
    setup = actions.add_parser(
        "setup",
        help="create the replication slot and publication of a change source (idempotent)",
        description="Create (or complete) the publication for the tables, the replication slot and "
        "its incarnation marker. Flags override the config file's values.",
    )
    setup.add_argument("--connector", default="postgres", help="an installed connector (default: postgres)")
    setup.add_argument("-c", "--config", type=Path, help="YAML/JSON config of the connector's stream source")
    setup.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="set a config field (YAML value)"
    )
    setup.add_argument(
        "--table", action="append", default=[], metavar="SCHEMA.TABLE", help="a table to publish (repeatable)"
    )
    setup.add_argument(
        "--replica-identity-full",
        action="store_true",
        help="set REPLICA IDENTITY FULL on a table without a primary key instead of refusing it "
        "(config field replica_identity_full)",
    )
    setup.add_argument("--json", action="store_true", help="print JSON")
    setup.set_defaults(handler=_setup_command)


def _setup_command(args: argparse.Namespace) -> int:

    config = read_yaml(args.config) if args.config else {}
    for assignment in args.set:
        field, sep, value = assignment.partition("=")
        if not sep or not field.strip():
            raise ConfigError(f"--set takes FIELD=VALUE, got {assignment!r}", where="faucet cdc setup")
        config[field.strip()] = parse_flag_value(value)
    if args.replica_identity_full:
        config["replica_identity_full"] = True
    result = setup_change_source(args.connector, config, args.table)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return 0
    for name, value in result.items():
        shown = ", ".join(map(str, value)) if isinstance(value, list | tuple) else value
        print(f"{name}: {shown}")
    return 0


__all__ = ["add_cdc_parser"]
