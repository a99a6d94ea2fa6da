"""Local servers to try the example's streams: ``python -m example_project.servers``.

Starts PostgreSQL, NATS with JetStream and a Kafka-protocol broker (Tansu) on free local ports, from
the wheels of faucet-dagster's ``dev`` extra (the servers the test suite uses), creates the database
``example``, the JetStream stream ``ORDER_EVENTS`` and the Kafka topic ``order_events`` that the
streams read (so their sensors find them on their first tick, before anything is published), prints
the ``export`` lines that enable the example's streams, and keeps the servers
running until Ctrl-C (or SIGTERM); they are then stopped and their data deleted.
"""

import asyncio
import signal
import sys

import nats

from example_project import KAFKA_BOOTSTRAP_ENV, NATS_URL_ENV, POSTGRES_URL_ENV
from example_project.publish import ensure_kafka_topic, ensure_nats_stream
from faucet_dagster.testing import KafkaServer, NatsServer, PostgresServer

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def main() -> int:
    with PostgresServer() as postgres, NatsServer() as nats_server, KafkaServer() as kafka:
        for server in (postgres, nats_server, kafka):
            server.start()
        asyncio.run(_create_stream(nats_server.url))
        ensure_kafka_topic(kafka.bootstrap)
        print(f"export {POSTGRES_URL_ENV}={postgres.create_database('example')}")
        print(f"export {NATS_URL_ENV}={nats_server.url}")
        print(f"export {KAFKA_BOOTSTRAP_ENV}={kafka.bootstrap}")
        print("# running; Ctrl-C stops the servers and deletes their data", flush=True)
        # Leaving the `with` block stops every server: wait there for Ctrl-C (SIGINT) or SIGTERM, both
        # blocked first so that they neither kill this process nor (SIGINT in a shell's background
        # job) go ignored. Blocked only now: the servers' processes must not inherit the mask.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        signal.sigwait(STOP_SIGNALS)
    return 0


async def _create_stream(url: str) -> None:
    client = await nats.connect([url], connect_timeout=5)
    try:
        await ensure_nats_stream(client.jetstream())
    finally:
        await client.close()


if __name__ == "__main__":
    sys.exit(main())
