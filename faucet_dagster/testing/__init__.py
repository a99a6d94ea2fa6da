"""Test support for faucet-dagster: real servers on free loopback ports, and pytest fixtures for them.

See :mod:`faucet_dagster.testing.servers` for the server classes and
:mod:`faucet_dagster.testing.pytest_plugin` for the fixtures (registered as the ``faucet_testing`` pytest
plugin). Importing this package imports only the standard library.
"""

from faucet_dagster.testing.servers import (
    KAFKA_BOOTSTRAP_ENV,
    NATS_URL_ENV,
    POSTGRES_OS_USER,
    POSTGRES_URL_ENV,
    ExternalServerError,
    KafkaServer,
    NatsServer,
    PostgresServer,
    S3Server,
    ServerStartError,
    make_unique_name,
)

__all__ = [
    "KAFKA_BOOTSTRAP_ENV",
    "NATS_URL_ENV",
    "POSTGRES_OS_USER",
    "POSTGRES_URL_ENV",
    "ExternalServerError",
    "KafkaServer",
    "NatsServer",
    "PostgresServer",
    "S3Server",
    "ServerStartError",
    "make_unique_name",
]
