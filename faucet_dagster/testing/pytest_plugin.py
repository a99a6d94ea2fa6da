"""pytest fixtures for real servers (registered as the ``faucet_testing`` pytest11 plugin).

Session-scoped servers, started lazily the first time a test asks for them and closed at the end of the
session (also when the session dies: see :mod:`faucet_dagster.testing.servers`):

``postgres_server`` -> :class:`~faucet_dagster.testing.PostgresServer`
``nats_server``     -> :class:`~faucet_dagster.testing.NatsServer`
``kafka_server``    -> :class:`~faucet_dagster.testing.KafkaServer`
``s3_server``       -> :class:`~faucet_dagster.testing.S3Server`

Each uses the external server named by ``FAUCET_TEST_POSTGRES_URL`` / ``FAUCET_TEST_NATS_URL`` /
``FAUCET_TEST_KAFKA_BOOTSTRAP`` / ``FAUCET_TEST_S3_ENDPOINT`` when set. A server that cannot start fails
the test with an error; it is never skipped.

Per-test fixtures, each first making sure its server runs (a previous test may have stopped or killed it):

``postgres_url``     a fresh database, unique to the test, dropped after it (superuser URL)
``nats_url``         the NATS URL; isolate with ``unique_name`` stream and subject names
``kafka_bootstrap``  the ``bootstrap.servers`` string; isolate with ``unique_name`` topics and groups
``s3_bucket``        a new bucket on the session's S3 endpoint, unique to the test
``unique_name``      ``unique_name(prefix="t") -> str``: a new ``[a-z0-9_]`` name on every call,
                     containing the test name (valid as database, stream, subject token and topic)

This module imports only the standard library, pytest and :mod:`faucet_dagster.testing.servers`;
it never imports dagster.
"""

from collections.abc import Callable, Iterator

import pytest

from faucet_dagster.testing.servers import KafkaServer, NatsServer, PostgresServer, S3Server, make_unique_name


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The session's PostgreSQL server (``wal_level=logical``), running when handed out."""
    server = PostgresServer.from_env()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """The session's NATS server with JetStream on file storage, running when handed out."""
    server = NatsServer.from_env()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(scope="session")
def kafka_server() -> Iterator[KafkaServer]:
    """The session's Kafka-protocol broker (Tansu, in memory), running when handed out."""
    server = KafkaServer.from_env()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The session's S3 endpoint (moto's server, in memory), running when handed out."""
    server = S3Server.from_env()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> Callable[..., str]:
    """``unique_name(prefix="t")`` returns a new name embedding the test's name on every call."""
    hint = request.node.name

    def make(prefix: str = "t") -> str:
        return make_unique_name(prefix, hint)

    return make


@pytest.fixture
def postgres_url(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """Superuser URL of a new database for this test; dropped afterwards if the server still runs."""
    postgres_server.start()
    name = make_unique_name("t", request.node.name)
    url = postgres_server.create_database(name)
    yield url
    if postgres_server.is_running:
        postgres_server.drop_database(name)


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    """URL of the (running) session NATS server."""
    return nats_server.start().url


@pytest.fixture
def kafka_bootstrap(kafka_server: KafkaServer) -> str:
    """``bootstrap.servers`` of the (running) session Kafka-protocol broker."""
    return kafka_server.start().bootstrap


@pytest.fixture
def s3_bucket(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """A new, empty bucket on the (running) session S3 endpoint, named after the test."""
    name = make_unique_name("t", request.node.name).replace("_", "-")
    return s3_server.start().create_bucket(name)
