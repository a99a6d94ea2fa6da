"""The bytewax peer of ``stream.kafka_to_pg``: a topic's JSON messages into PostgreSQL by COPY.

Runs with the Python of the bytewax virtual environment (``$BYTEWAX_VENV``, ``pip install
"bytewax[kafka]" "psycopg[binary]"``) and imports nothing from this project. ``python
bench/bytewax_child.py BOOTSTRAP TOPIC POSTGRES_URL TABLE N`` reads ``TOPIC`` from its earliest offsets
to its end into ``TABLE`` (created here as ``(i bigint, name text, score double precision)``, the columns
faucet parses the same payloads into) and prints one JSON line, ``{"rows": N, "seconds": S}``; it exits
with status 1 if ``TABLE`` does not then hold ``N`` rows.

The dataflow is what a bytewax user writes for this job: its own ``KafkaSource`` (one consumer per
partition, no consumer group, ``tail=False`` so the flow ends at the topic's end, batches of 10,000 like
the raw loop's ``consume``), a ``map`` parsing each JSON value, and a sink whose ``write_batch`` COPYs a
batch and commits it (bytewax ships no PostgreSQL sink). Bytewax keeps no Kafka offsets unless recovery
is configured, so this is the peer without any delivery bookkeeping, a favourable comparison for it.
``S`` runs from the start of the dataflow to its end (the last batch committed); bytewax assigns
partitions itself, so there is no group join to leave out.
"""

import json
import sys
import time
from typing import Any

import psycopg
from bytewax import operators as op  # type: ignore[import-not-found]
from bytewax.connectors.kafka import KafkaSource, KafkaSourceMessage  # type: ignore[import-not-found]
from bytewax.dataflow import Dataflow  # type: ignore[import-not-found]
from bytewax.outputs import DynamicSink, StatelessSinkPartition  # type: ignore[import-not-found]
from bytewax.testing import run_main  # type: ignore[import-not-found]
from psycopg import sql

BATCH = 10_000
Row = tuple[int, str, float]


class _CopyPartition(StatelessSinkPartition[Row]):  # type: ignore[misc]
    def __init__(self, url: str, table: str) -> None:
        self._connection = psycopg.connect(url)
        self._copy = sql.SQL("COPY {} (i, name, score) FROM STDIN").format(sql.Identifier(table))

    def write_batch(self, items: list[Row]) -> None:
        with self._connection.cursor() as cursor, cursor.copy(self._copy) as copy:
            for item in items:
                copy.write_row(item)
        self._connection.commit()

    def close(self) -> None:
        self._connection.close()


class CopySink(DynamicSink[Row]):  # type: ignore[misc]
    """Each worker COPYs the batches it is handed into ``table``, one transaction per batch."""

    def __init__(self, url: str, table: str) -> None:
        self._url, self._table = url, table

    def build(self, step_id: str, worker_index: int, worker_count: int) -> _CopyPartition:
        return _CopyPartition(self._url, self._table)


def _parse(message: KafkaSourceMessage[Any, bytes]) -> Row:
    value = json.loads(message.value)
    return (value["i"], value["name"], value["score"])


def main(bootstrap: str, topic: str, url: str, table: str, want: int) -> int:
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(
            sql.SQL("CREATE TABLE {} (i bigint, name text, score double precision)").format(
                sql.Identifier(table)
            )
        )
    flow = Dataflow(f"bytewax_{table}")
    # The fetch setting faucet's consumers and the raw loop have: librdkafka's default 1 s backoff
    # after a full prefetch queue would stall it (see faucet_kafka.client.FETCH_DEFAULTS).
    source = KafkaSource(
        [bootstrap], [topic], tail=False, batch_size=BATCH, add_config={"fetch.queue.backoff.ms": "10"}
    )
    rows = op.map("parse", op.input("kafka", flow, source), _parse)
    op.output("postgres", rows, CopySink(url, table))
    started = time.perf_counter()
    run_main(flow)
    seconds = time.perf_counter() - started
    with psycopg.connect(url) as connection:
        row = connection.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
    if row is None or row[0] != want:
        print(f"{table} holds {row and row[0]} rows, expected {want}", file=sys.stderr)
        return 1
    print(json.dumps({"rows": want, "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    bootstrap, topic, url, table, rows = sys.argv[1:6]
    sys.exit(main(bootstrap, topic, url, table, int(rows)))
