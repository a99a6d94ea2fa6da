"""Prepare a change source's server before a stream reads it: its replication slot and publication.

The change source is an installed connector's stream source, built from its config through the
connector registry (this module imports no connector). A stream source that can prepare its server
for change data capture has an ``async setup_replication(tables)`` method
(:class:`ReplicationSetupSource`); the PostgreSQL change source's creates the publication for
``tables`` (adding the ones it lacks), the slot, and the marker that records the slot's incarnation,
and raises :class:`~faucet_dagster.protocol.ConfigError` when ``wal_level`` is not ``logical`` or a
table has no primary key and no replica identity (publishing it would break the application's UPDATE
and DELETE; ``replica_identity_full`` sets REPLICA IDENTITY FULL on such tables instead). It is
idempotent: running it again keeps the slot and its incarnation.

:func:`setup_change_source` is the one implementation; ``faucet cdc setup`` and the Dagster resource
method :meth:`faucet_dagster.declarations.resources.FaucetConnection.setup_replication` call it.
"""

import dataclasses
from collections.abc import Mapping, Sequence
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


__all__ = ["ReplicationSetupSource", "setup_change_source"]
