"""What a config factory hands the battery: a connector config plus hooks into the real system.

A *config factory* is a function whose parameters are named after fixtures (``postgres_url``,
``nats_url``, ``kafka_bootstrap``, ``unique_name``, ``tmp_path``), as a pytest fixture's are. It
creates what the connector needs on the real server (a database, a stream, a topic, a directory) and
returns a :class:`SourceSetup` or :class:`SinkSetup`. It is called once per check: every check starts
from a fresh, empty dataset.

Rows are the battery's standard records ``{"id": <int64>, "name": <string>}``; a setup stores them
in its system as it would store real data (a table row, a JSON message, a CSV line) and reads them
back the same way.
"""

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from faucet_dagster.protocol import WritePolicy

Row = Mapping[str, Any]
"""A standard record: ``{"id": int, "name": str}`` (a destination may hold more columns)."""

AddRows = Callable[[Sequence[Row]], Awaitable[None]]
ReadBack = Callable[[], Awaitable[list[dict[str, Any]]]]
Cleanup = Callable[[], Awaitable[None]]


def make_rows(start: int, count: int, *, width: int = 24) -> list[dict[str, Any]]:
    """Standard rows with ids ``start .. start + count - 1``; names are ``width`` characters long."""
    return [{"id": i, "name": f"row-{i}".ljust(width, ".")} for i in range(start, start + count)]


@dataclass(frozen=True)
class SourceSetup:
    """A source (bounded or continuous) configured against an empty dataset in a real system.

    ``add_rows(rows)`` appends ``rows`` to the dataset, in order; a source with transaction
    boundaries receives them as one source transaction. ``resources`` are what a stream session
    selects. ``unreachable`` is a valid config whose endpoint does not answer (check 6), or ``None``
    when the source has no endpoint. ``add_malformed()`` stores one record the source cannot turn
    into a row (check 6), or ``None`` when the system cannot hold one. ``acknowledged()`` reads the
    provider's own acknowledgement state (a committed offset, a consumer's floor, a slot's confirmed
    position) as text that changes exactly when the source acknowledges; ``None`` when it has none.
    ``cleanup()`` removes what the setup created on shared servers (a replication slot).
    ``redelivered()`` counts the deliveries the provider has repeated so far on the session's
    consumer (``None``: the provider never redelivers on its own, as a Kafka log does not).
    ``make_unavailable()`` removes every row stored so far from the provider (a purge, retention,
    records deleted below the low watermark, a replication slot advanced past them), so a position
    among them can no longer be resumed from; ``None`` when the system cannot remove data under a
    reader.

    For the generated scenarios of a bounded source: ``add_rows_before(rows)`` stores rows where the
    source reads them before everything stored so far (a file whose name sorts first), which a run
    resumed from any earlier bookmark must still deliver; ``cursor_config`` is ``config`` reading the
    same dataset through a cursor column (``update_rows`` moves rows past the others by changing them:
    rows are matched by ``id``, their ``name`` replaced, their cursor advanced; the rows of one
    ``add_rows`` share one cursor value).

    For the generated scenarios of a stream source: ``update_rows`` and ``delete_rows`` change and
    delete rows by ``id``, each call one source transaction (a source emitting changes delivers
    them); ``recreate()`` deletes the stream (topic) and creates it again, empty, under the same name
    (no session is open when it is called); ``domain_of(row)`` names the ordering domain a row lands
    in (any label, the same for rows of one domain: Kafka's ``id % partitions``), so a skipped row is
    seen at once; ``None``: every row lands in one domain.
    """

    config: Mapping[str, Any]
    add_rows: AddRows
    resources: tuple[str, ...] = ()
    unreachable: Mapping[str, Any] | None = None
    add_malformed: Callable[[], Awaitable[None]] | None = None
    acknowledged: Callable[[], Awaitable[str]] | None = None
    cleanup: Cleanup | None = None
    redelivered: Callable[[], Awaitable[int]] | None = None
    make_unavailable: Callable[[], Awaitable[None]] | None = None
    add_rows_before: AddRows | None = None
    cursor_config: Mapping[str, Any] | None = None
    update_rows: AddRows | None = None
    delete_rows: AddRows | None = None
    recreate: Callable[[], Awaitable[None]] | None = None
    domain_of: Callable[[dict[str, Any]], str] | None = None


@dataclass(frozen=True)
class SinkSetup:
    """A sink (bounded or streaming) configured to write the standard rows to a real destination.

        ``read_back()`` returns every row the destination holds (at least ``id`` and ``name``), read
        through the system's own client. ``keyed_config`` is the same destination configured to upsert by
        ``id`` (the keyed-upsert branch of check 4), when the sink has such a mode, writing to another
    table that ``read_keyed()`` reads back. ``refused_rows`` are
        standard rows of which the destination refuses at least one (a constraint, a size limit): the
        failed-write checks. ``unreachable`` is a valid config whose endpoint does not answer.
        ``configure(policy, key)`` is ``config`` with its write mode and key set to these (check 5
        builds append with a key, upsert without one... and asks ``dedups_by_key()``); ``None`` for a
        sink without a configurable mode. ``stall()`` is a context inside which the destination
        stops answering the sink's open sessions (their server processes SIGSTOPped, or a proxy
        holding the responses) and answers again on exit: the shutdown check commits against it.
        ``read_resource(resource)`` returns every row (every column) the destination holds for one
        resource, where each resource lands on its own (a table per resource); ``None`` when every
        resource lands in one place, which ``read_back()`` reads. A read that would wait on a lock
        (an SQL ``lock_timeout`` of a fraction of a second) raises :class:`ReadBlocked`.
        ``write_to(resource, policy, key)`` (bounded sinks) is a config writing ``resource`` (a table
        of that name) with ``policy`` and ``key``, with schema evolution on where the sink has it;
        ``read_resource`` reads it back. The generated scenarios run every policy the sink's configs
        declare, each into a table of its own; ``None``: only ``config``, read by ``read_back()``.
    """

    config: Mapping[str, Any]
    read_back: ReadBack
    read_resource: Callable[[str], Awaitable[list[dict[str, Any]]]] | None = None
    keyed_config: Mapping[str, Any] | None = None
    read_keyed: ReadBack | None = None
    refused_rows: Sequence[Row] | None = None
    unreachable: Mapping[str, Any] | None = None
    cleanup: Cleanup | None = None
    configure: Callable[[WritePolicy, tuple[str, ...]], Mapping[str, Any]] | None = None
    stall: Callable[[], AbstractAsyncContextManager[None]] | None = None
    write_to: Callable[[str, WritePolicy, tuple[str, ...]], Mapping[str, Any]] | None = None


class ReadBlocked(Exception):
    """Raised by a setup's read when the destination makes the reader wait for a lock that an open
    epoch holds (a column added in the epoch's transaction): the reader sees nothing of that epoch.
    The battery reads with a bounded lock wait only while an epoch is open; a read blocked after
    its commit or abort is a lock the sink left behind."""


Setup = SourceSetup | SinkSetup
ConfigFactory = Callable[..., Setup]
"""A function whose parameters name fixtures and which returns a fresh setup (see the module doc)."""


def factory_fixtures(factory: ConfigFactory) -> tuple[str, ...]:
    """The fixture names a config factory asks for, in order."""
    return tuple(inspect.signature(factory).parameters)
