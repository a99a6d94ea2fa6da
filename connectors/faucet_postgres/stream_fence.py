"""The stream's own rows at a PostgreSQL destination: its owner fence, last epoch and watermarks.

Two tables, shared by every stream of the destination (created on first use, under an advisory
lock so that two sessions starting at once do not race on ``CREATE TABLE``):

* the **epochs** table, one row per stream: ``fencing_token`` (the owner fence: the highest token
  that claimed the stream), and the last committed epoch (``epoch_sequence``,
  ``epoch_fencing_token``) with its ``commit_id`` (``<random id>:<transaction id>``, written by the
  commit itself, so that a commit whose answer was lost is recognised when read back);
* the **watermarks** table, one row per stream and ordering domain (source, resource, partition):
  the position its last committed epoch ended at, with the domain's incarnation and codec.

:class:`StreamRows` names the statements on them. The session (:mod:`faucet_postgres.stream_sink`)
decides when each runs, inside which transaction; this module holds no state beyond the names.
"""

from typing import Any

import psycopg
from psycopg import sql

from faucet_dagster.protocol import EpochId, OwnershipLost, Position
from faucet_postgres.common import table_name
from faucet_postgres.stream_state import Committed

Connection = psycopg.AsyncConnection[Any]

_STATE_LOCK = 0x66617563  # an advisory lock id ("fauc"), held while the state tables are created
_FENCED = "faucet: the owner fence or the epochs row moved"
"""The commit's fence refuses by asking for this run-time parameter, which does not exist: an error
in the fence's own statement, so the COMMIT sent after it in the same round trip is not executed.
(A ``RAISE`` would need a ``DO`` block, which takes no parameters.)"""
_UNDEFINED_OBJECT = "42704"


def is_fence_refusal(exc: psycopg.Error) -> bool:
    """Whether ``exc`` is the fence of :meth:`StreamRows.fence` refusing a commit."""
    return exc.sqlstate == _UNDEFINED_OBJECT and _FENCED in (exc.diag.message_primary or "")


class StreamRows:
    """The statements on one stream's rows in the epochs and watermarks tables."""

    def __init__(self, stream: str, state_schema: str, epochs_table: str, watermarks_table: str) -> None:
        self.stream = stream
        self._epochs = table_name(state_schema, epochs_table)
        self._watermarks = table_name(state_schema, watermarks_table)

    async def create_and_claim(self, conn: Connection, token: int) -> bool:
        """Create the tables if missing (committed), then claim the owner fence with ``token``
        (committed): False when a higher token holds it."""
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_STATE_LOCK,))
        await conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (stream text PRIMARY KEY, fencing_token bigint NOT NULL, "
                "epoch_sequence bigint, epoch_fencing_token bigint, commit_id text, "
                "committed_at timestamptz)"
            ).format(self._epochs)
        )
        await conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (stream text NOT NULL, source text NOT NULL, "
                "resource text NOT NULL, partition text NOT NULL, incarnation text NOT NULL, "
                "codec text NOT NULL, position text NOT NULL, epoch_sequence bigint NOT NULL, "
                "PRIMARY KEY (stream, source, resource, partition))"
            ).format(self._watermarks)
        )
        await conn.commit()
        cursor = await conn.execute(
            sql.SQL(
                "INSERT INTO {} AS e (stream, fencing_token) VALUES (%s, %s) ON CONFLICT (stream) "
                "DO UPDATE SET fencing_token = EXCLUDED.fencing_token "
                "WHERE e.fencing_token <= EXCLUDED.fencing_token RETURNING fencing_token"
            ).format(self._epochs),
            (self.stream, token),
        )
        claimed = await cursor.fetchone()
        await conn.commit()
        return claimed is not None

    async def read(self, conn: Connection) -> Committed:
        """The stream's committed state as ``conn`` sees it (in its transaction, if one is open)."""
        cursor = await conn.execute(
            sql.SQL(
                "SELECT e.epoch_sequence, e.epoch_fencing_token, e.commit_id, w.source, w.resource, "
                "w.partition, w.incarnation, w.codec, w.position FROM {} e LEFT JOIN {} w "
                "ON w.stream = e.stream WHERE e.stream = %s AND e.epoch_sequence IS NOT NULL"
            ).format(self._epochs, self._watermarks),
            (self.stream,),
        )
        return Committed.from_rows(self.stream, await cursor.fetchall())

    async def holder(self, conn: Connection) -> int | None:
        """The fencing token that holds the stream's fence (None: no epochs row)."""
        cursor = await conn.execute(
            sql.SQL("SELECT fencing_token FROM {} WHERE stream = %s").format(self._epochs),
            (self.stream,),
        )
        row = await cursor.fetchone()
        return None if row is None else int(row[0])

    def fence(self, epoch: EpochId, commit_id: str, begun: Committed) -> tuple[sql.Composed, dict[str, Any]]:
        """The commit's fence: records ``epoch`` as the stream's last, under ``commit_id``, and
        answers the stored commit id, if no higher token claimed the stream and the row's commit id
        is still the one ``begun`` read; else it fails with :func:`is_fence_refusal` true."""
        return (
            sql.SQL(
                "WITH fence AS (UPDATE {} SET fencing_token = %(token)s, epoch_sequence = %(sequence)s, "
                "epoch_fencing_token = %(token)s, "
                "commit_id = %(commit)s::text || ':' || pg_current_xact_id()::text, "
                "committed_at = now() WHERE stream = %(stream)s AND fencing_token <= %(token)s "
                "AND commit_id IS NOT DISTINCT FROM %(begun)s RETURNING commit_id) "
                "SELECT CASE WHEN count(*) = 1 THEN max(commit_id) ELSE current_setting(%(refusal)s) END "
                "FROM fence"
            ).format(self._epochs),
            {
                "token": epoch.fencing_token,
                "sequence": epoch.sequence,
                "commit": commit_id,
                "stream": self.stream,
                "begun": begun.commit_id,
                "refusal": _FENCED,
            },
        )

    def watermarks(self, epoch: EpochId, marks: list[Position]) -> tuple[sql.Composed, list[tuple[Any, ...]]]:
        """The upsert of ``epoch``'s watermarks, and its rows (for ``executemany``)."""
        return (
            sql.SQL(
                "INSERT INTO {} AS w (stream, source, resource, partition, incarnation, "
                "codec, position, epoch_sequence) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (stream, source, resource, partition) DO UPDATE SET "
                "incarnation = EXCLUDED.incarnation, codec = EXCLUDED.codec, "
                "position = EXCLUDED.position, epoch_sequence = EXCLUDED.epoch_sequence"
            ).format(self._watermarks),
            [
                (
                    self.stream,
                    *mark.domain.lineage,
                    mark.domain.incarnation,
                    mark.domain.codec,
                    mark.value,
                    epoch.sequence,
                )
                for mark in marks
            ],
        )


def fenced_out(epoch: EpochId, holder: int | None, where: str) -> OwnershipLost:
    """The error for ``epoch``'s commit refused by its fence, ``holder`` being the token found on
    the stream's fence afterwards (None: it could not be read)."""
    token = epoch.fencing_token
    if holder is not None and holder > token:
        why = f"a fencing token above {token} claimed the stream: fencing token {holder} holds its fence"
    elif holder is not None:
        why = (
            f"another session claimed the stream: fencing token {holder} committed after this session "
            "last read it"
        )
    else:
        why = "the stream's owner fence at the destination could not be read, or is gone"
    return OwnershipLost(f"{why}; epoch {epoch} was rolled back", where=where)
