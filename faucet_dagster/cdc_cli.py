"""``faucet cdc setup``: create the replication slot and publication a change source reads.

The change source is an installed connector's stream source, built from its config through the
connector registry (this module imports no connector). A stream source that can prepare its server
for change data capture has an ``async setup_replication(tables)`` method
(:class:`ReplicationSetupSource`); the PostgreSQL change source's creates the publication for
``tables`` (adding the ones it lacks), the slot, and the marker that records the slot's incarnation,
and raises :class:`~faucet_dagster.protocol.ConfigError` when ``wal_level`` is not ``logical`` or a
table has no primary key and no replica identity (publishing it would break the application's UPDATE
and DELETE; ``--replica-identity-full`` sets REPLICA IDENTITY FULL on such tables instead). It is
idempotent: running it again keeps the slot and its incarnation.

:func:`setup_change_source` is the one implementation; the CLI and the Dagster resource method
:meth:`faucet_dagster.resources.FaucetConnection.setup_replication` call it. No Dagster import here.
"""

import argparse
import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from faucet_dagster.protocol import ConfigError, get_connector
from faucet_dagster.runner.sync import run_sync


@runtime_checkable
class ReplicationSetupSource(Protocol):
    """A stream source that can create what it reads from (a slot and a publication, say).

    ``setup_replication`` is idempotent, returns a dataclass describing what it found or made, and
    raises a :class:`~faucet_dagster.protocol.FaucetError` naming what is wrong.
    """

    async def setup_replication(self, tables: Sequence[str] = ()) -> Any: ...


def setup_change_source(
    connector: str, config: Mapping[str, Any], tables: Sequence[str] = ()
) -> dict[str, Any]:
    """Build ``connector``'s stream source from ``config`` and run its replication setup for ``tables``
    (none: the tables its config names). Blocks until done; returns what the setup reports, as plain data.

    Raises :class:`ConfigError` when the connector has no stream source or its source no setup, and
    whatever the setup raises (a FaucetError).
    """
    source = get_connector(connector).stream_source(dict(config))
    if not isinstance(source, ReplicationSetupSource):
        raise ConfigError(
            f"the {connector} stream source has no replication setup (it reads what exists)", where=connector
        )
    result = run_sync(source.setup_replication(tuple(tables)))
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return dataclasses.asdict(result)
    if isinstance(result, Mapping):
        return dict(result)
    raise ConfigError(
        f"the {connector} replication setup returned a {type(result).__name__}, not a description",
        where=connector,
    )


def add_cdc_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``cdc setup`` to the ``faucet`` command line."""
    cdc = commands.add_parser("cdc", help="prepare a database for change data capture")
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
    # Imported here: faucet_dagster.cli imports this module to add the parser.
    from faucet_dagster.cli import _parse_flag_value, _read_yaml

    config = _read_yaml(args.config) if args.config else {}
    for assignment in args.set:
        field, sep, value = assignment.partition("=")
        if not sep or not field.strip():
            raise ConfigError(f"--set takes FIELD=VALUE, got {assignment!r}", where="faucet cdc setup")
        config[field.strip()] = _parse_flag_value(value)
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


__all__ = ["ReplicationSetupSource", "add_cdc_parser", "setup_change_source"]
