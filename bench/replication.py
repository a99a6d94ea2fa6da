"""What the CDC scenarios share: peeking a slot, and copies of a slot that a run may consume."""

from typing import Any

import psycopg
from faucet_postgres.cdc_config import PostgresCdcConfig

from bench.context import BenchContext


async def peek(
    conn: psycopg.AsyncConnection[Any], config: PostgresCdcConfig
) -> psycopg.AsyncServerCursor[Any]:
    """A server-side cursor over every pgoutput message ``config.slot`` holds (peeked: never consumed)."""
    cursor = conn.cursor("peek", binary=True)
    await cursor.execute(
        "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
        "'proto_version', '1', 'publication_names', %s)",
        (config.slot, config.publication),
    )
    return cursor


def copy_slot(ctx: BenchContext, config: PostgresCdcConfig, prefix: str) -> PostgresCdcConfig:
    """``config`` on a new copy of its slot, from the same point (a runner advances the slot it reads);
    the copy is dropped when the run ends."""
    copy = config.model_copy(update={"slot": ctx.unique(prefix)})
    with psycopg.connect(ctx.postgres_url, autocommit=True) as conn:
        conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (config.slot, copy.slot))

    def drop() -> None:
        with psycopg.connect(ctx.postgres_url, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                (copy.slot,),
            )

    ctx.on_close(drop)
    return copy
