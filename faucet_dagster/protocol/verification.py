"""Verification: what a connector offers so a certified range can be checked again later.

``faucet verify`` (:mod:`faucet_dagster.verify`) re-reads a certified range at the source and compares
it with what the destination holds. Both sides are optional parts of the protocol; a connector that
does not implement one is reported *not verifiable* for it (the defaults raise
:class:`UnsupportedOperation`), never *verified*:

* the source side is ``StreamSource.replay`` (:mod:`.streaming`) and, for bounded syncs,
  ``Source.replay_pages`` (:mod:`.bounded`): the range re-read through the same decoding and event
  identities, without side effects;
* the destination side is a :class:`DestinationReader`, opened by a streaming sink's ``reader``
  (:class:`ReadableStreamingSink`) or a bounded sink's (:class:`ReadableSink`): read-only access to
  what the destination holds, compared with the rows the range must have left there
  (:class:`ExpectedRows`), answered as a :class:`DestinationDiff`. A sink without ``reader`` is not
  verifiable at its destination.

The engine decides what must be there (the policy's semantics: each event once for APPEND, the last
change per key for the keyed policies); a reader only knows how to look, and compares in the way that
suits its destination (a PostgreSQL reader inside the database, a NATS reader message by message).
"""

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

from faucet_dagster.protocol.capabilities import WritePolicy
from faucet_dagster.protocol.positions import EventIdentity
from faucet_dagster.protocol.streaming import Receipt, SinkCommitState

DEFAULT_DIFF_LIMIT = 100
"""How many rows of each kind of difference a reader returns (the totals count them all)."""


@dataclass(frozen=True)
class ExpectedRows:
    """The rows a run of certified epochs (or a bounded sync's run) handed the sink for one resource.

    ``rows`` are every row the pipeline handed the sink (less those the destination refused into the
    dead-letter route), in the order it handed them, in the resource's Arrow schema. What they must
    have left follows from ``policy``, which the reader applies as its sink does: APPEND (and a bounded
    REPLACE) each row once; UPSERT the last row of each ``key``; VERSIONED_UPSERT the newest version of
    each key; APPLY_CHANGES the last change of each key (a key whose last change deleted it is absent).
    ``epochs[i]`` is the certificate sequence of the epoch that wrote ``rows[i]`` (a bounded run: its
    number), ``identities[i]`` its event identity (``None`` where the source has none: a bounded page).
    ``receipts`` are the destination facts of each epoch for this resource, by sequence (a NATS
    receipt's stream sequences), and of the epoch just before the first when the store has it (where
    the destination's earlier writes end). ``sequences`` are the compared epochs, ascending; ``latest`` is the
    stream's last certified sequence when the verification began: a keyed row that an epoch after the
    compared ones changed is *superseded*, not a difference.
    """

    resource: str
    policy: WritePolicy
    key: tuple[str, ...]
    rows: pa.Table
    epochs: Sequence[int]
    identities: Sequence[EventIdentity | None]
    sequences: tuple[int, ...]
    latest: int
    receipts: Mapping[int, Receipt] = field(default_factory=dict)


@dataclass(frozen=True)
class FoundRow:
    """A row the destination holds that no expected row explains, with the epoch that wrote it when the
    destination records it (``None``: it does not)."""

    row: Mapping[str, Any]
    epoch: int | None = None


@dataclass(frozen=True)
class DestinationDiff:
    """How the destination differs from :class:`ExpectedRows` (empty tuples: it holds exactly them).

    Row references are indexes into ``ExpectedRows.rows`` (``resurrected``: the delete that a key's
    row is still there after; ``changed``: the row that should be there, with the one that is). Each
    tuple holds at most the reader's ``limit`` items; ``totals`` counts every one, by the field's
    name. ``compared`` is how many expected rows (and absent keys) were compared; ``superseded`` how
    many keyed rows an epoch after the compared ones changed (not compared). ``unchecked`` says what
    the reader could not check, and why (``"duplicates: the table records no epoch"``): the engine
    reports the range as not verifiable for that, never as verified.
    """

    compared: int
    missing: tuple[int, ...] = ()
    changed: tuple[tuple[int, Mapping[str, Any]], ...] = ()
    duplicated: tuple[tuple[int, int], ...] = ()
    unexpected: tuple[FoundRow, ...] = ()
    resurrected: tuple[int, ...] = ()
    superseded: int = 0
    unchecked: tuple[str, ...] = ()
    totals: Mapping[str, int] = field(default_factory=dict)

    def total(self, kind: str) -> int:
        """Every difference of ``kind`` (a field name), not only the ones listed."""
        listed: tuple[Any, ...] = getattr(self, kind)
        return self.totals.get(kind, len(listed))


class DestinationReader(ABC):
    """Read-only access to what one stream's (or sync's) certified writes left at a destination.

    Opened by ``StreamingSink.reader`` or ``Sink.reader``. It never writes to the destination's
    tables or streams, never claims an owner fence, and holds no lock a live session waits for (a
    reader may create session-private scratch space: a temporary table). Methods are called one at a
    time; ``close`` releases its clients.
    """

    @abstractmethod
    async def committed(self) -> SinkCommitState | None:
        """What the destination last committed for the stream (its epoch and watermarks), read
        without a writing session; ``None`` when it holds nothing or keeps no watermark."""

    @abstractmethod
    async def compare(self, expected: ExpectedRows, *, limit: int = DEFAULT_DIFF_LIMIT) -> DestinationDiff:
        """Compare ``expected`` with what the destination holds, as the policy promises.

        APPEND: every expected row is there exactly once among the rows its epoch wrote (a reader
        that cannot tell an epoch's rows checks that each is there at least once, and says in
        ``unchecked`` that duplicates were not checked). Keyed policies: the row of each key equals
        the one the policy makes of the expected rows, unless an epoch after ``expected.sequences``
        changed it (``superseded``); a key whose last change deleted it is not there. Raises a
        FaucetError when the destination cannot be read (ConnectionFailed, ConfigError for a table
        that does not exist); a destination that holds something else is a difference, never an
        error.
        """

    async def close(self) -> None:
        """Release the reader's clients. Idempotent."""


@runtime_checkable
class ReadableStreamingSink(Protocol):
    """A :class:`~faucet_dagster.protocol.streaming.StreamingSink` whose destination ``faucet verify``
    can read back (optional: a sink without ``reader`` is reported not verifiable there)."""

    async def reader(self, stream: str, policy: WritePolicy, key: Sequence[str]) -> DestinationReader:
        """Open a :class:`DestinationReader` on what ``stream``'s epochs wrote with ``policy`` (keyed
        by ``key``). Connects (a FaucetError says why it cannot); claims no fence, changes nothing."""
        ...


@runtime_checkable
class ReadableSink(Protocol):
    """A bounded :class:`~faucet_dagster.protocol.bounded.Sink` whose destination ``faucet verify`` can
    read back (optional: a sink without ``reader`` is reported not verifiable there)."""

    async def reader(self, name: str) -> DestinationReader:
        """Open a :class:`DestinationReader` on what this configured sink wrote, with the write mode and
        key it applies (``write_mode``); ``name`` names the sync in messages. Connects (a FaucetError
        says why it cannot); changes nothing."""
        ...


__all__ = [
    "DEFAULT_DIFF_LIMIT",
    "DestinationDiff",
    "DestinationReader",
    "ExpectedRows",
    "FoundRow",
    "ReadableSink",
    "ReadableStreamingSink",
]
