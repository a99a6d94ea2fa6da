"""The quixstreams peer of ``stream.kafka_to_pg``: a topic's JSON messages into PostgreSQL.

Runs with the Python of the quixstreams virtual environment (``$QUIX_VENV``) and imports nothing from
this project. ``python bench/quix_child.py BOOTSTRAP TOPIC POSTGRES_URL TABLE N [CLOCK]`` reads ``TOPIC`` from
its earliest offsets through a new consumer group into ``TABLE`` (created by the sink) and prints one
JSON line, ``{"rows": N, "seconds": S}``; it exits with status 1 if ``TABLE`` does not then hold ``N``
rows, or if ``N`` rows did not arrive within ``TIMEOUT_S``.

The pipeline is the shared peer script's (``quix_peer.py``): ``Application`` without changelog topics,
a checkpoint every 10,000 messages, JSON values, ``PostgreSQLSink`` without its metadata columns. Two
things differ, so that it measures the same work as faucet on the same messages: it reads a given topic
(the one the faucet scenario and the raw loop read), and ``S`` runs from the partition assignment to
the commit of the sink write that holds the ``N``-th row. Tansu completes a new consumer group's first
join only after about half of ``session.timeout.ms``; the raw baseline leaves the join out the same way,
and it has the raw loop's consumer settings (``STEADY_STATE_CONSUMER``).

With ``CLOCK`` = ``from_start`` it measures as ``quix_peer.py`` itself does: quixstreams' default
consumer settings, and ``S`` from ``Application.run()`` to that commit, the group join included (faucet
assigns partitions by its lease and has no join, so this is the user-visible time to move the topic).
"""

import json
import sys
import threading
import time
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from quixstreams import Application  # type: ignore[import-not-found]
from quixstreams.sinks import SinkBatch  # type: ignore[import-not-found]
from quixstreams.sinks.community.postgresql import PostgreSQLSink  # type: ignore[import-not-found]

TIMEOUT_S = 1800.0
SESSION_TIMEOUT_MS = 6000
STEADY_STATE_CONSUMER = {"session.timeout.ms": SESSION_TIMEOUT_MS, "fetch.queue.backoff.ms": 10}
"""The consumer settings the raw loop has: the short session timeout, and librdkafka's fetch backoff
after a full prefetch queue at 10 ms instead of 1 s (``faucet_kafka.client.FETCH_DEFAULTS``)."""


class TimedApplication(Application):  # type: ignore[misc]
    """An ``Application`` that notes when its consumer was first assigned partitions."""

    assigned_at: float | None = None

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        if partitions and self.assigned_at is None:
            self.assigned_at = time.perf_counter()
        super()._on_assign(consumer, partitions)


class CountingSink(PostgreSQLSink):  # type: ignore[misc]
    """``PostgreSQLSink`` that counts the rows it committed and calls ``done`` once it reached ``want``."""

    def __init__(self, want: int, done: threading.Event, **settings: Any) -> None:
        super().__init__(**settings)
        self.want, self.done = want, done
        self.written = 0
        self.done_at: float | None = None

    def write(self, batch: SinkBatch) -> None:
        super().write(batch)  # one transaction, committed on return
        self.written += batch.size
        if self.written >= self.want and self.done_at is None:
            self.done_at = time.perf_counter()
            self.done.set()


def main(bootstrap: str, topic: str, url: str, table: str, want: int, clock: str) -> int:
    params = conninfo_to_dict(url)
    done = threading.Event()
    sink = CountingSink(
        want,
        done,
        host=params.get("host", "127.0.0.1"),
        port=int(str(params.get("port", 5432))),
        dbname=params["dbname"],
        user=params.get("user", "postgres"),
        password=params.get("password", ""),
        table_name=table,
        include_metadata=False,
    )
    app = TimedApplication(
        broker_address=bootstrap,
        consumer_group=f"quix_{table}",
        auto_offset_reset="earliest",
        use_changelog_topics=False,
        commit_every=10_000,
        consumer_extra_config={} if clock == "from_start" else STEADY_STATE_CONSUMER,
    )
    app.dataframe(app.topic(topic, value_deserializer="json")).sink(sink)

    def stop_when_done() -> None:
        done.wait(TIMEOUT_S)
        app.stop()

    threading.Thread(target=stop_when_done, daemon=True).start()
    started = time.perf_counter()
    app.run()
    if sink.done_at is None or app.assigned_at is None:
        print(f"quixstreams wrote {sink.written} of {want} rows in {TIMEOUT_S:.0f} s", file=sys.stderr)
        return 1
    with psycopg.connect(url) as connection:
        row = connection.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
    if row is None or row[0] != want:
        print(f"{table} holds {row and row[0]} rows, expected {want}", file=sys.stderr)
        return 1
    began = started if clock == "from_start" else app.assigned_at
    print(json.dumps({"rows": want, "seconds": sink.done_at - began}), flush=True)
    return 0


if __name__ == "__main__":
    bootstrap, topic, url, table, rows = sys.argv[1:6]
    clock = sys.argv[6] if len(sys.argv) > 6 else "from_assignment"
    if clock not in ("from_assignment", "from_start"):
        sys.exit(f"CLOCK must be from_assignment or from_start, not {clock!r}")
    sys.exit(main(bootstrap, topic, url, table, int(rows), clock))
