"""A distinct secret in every place a user puts one, connections and runs that fail (and one that
succeeds), then a grep of everything Faucet and Dagster wrote or printed: zero hits.

Places: ``auth`` passwords and tokens through ``dg.EnvVar`` (SQL, PostgreSQL, NATS, Kafka), a Kafka
``secret_properties`` value (``ssl.key.password``) and a secret-bearing Kafka ``client_properties`` value
given as plain text (refused), a password
in a SQLAlchemy URL's query string, a libpq ``sslpassword``, credentials in a NATS server URL, the state
store's URL (it has no auth field: accepted, never shown), a Delta table on S3's secret access key and
session token (a run that writes, one whose endpoint does not answer) and credentials in its endpoint
URL (refused), and a YAML file `faucet plan` cannot parse.
Searched: every file under DAGSTER_HOME (run and event storage, compute logs), the event logs as
serialized, materialization metadata, the state store (PostgreSQL, through `faucet streams status`
with and without --json), every CLI output, the log records, and the text of every error raised.
"""

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from stream_ticks import sensor_context
from test_hostile_nats_auth import NatsServerWithUsers

from faucet_dagster.cli.main import main
from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.protocol import ConfigError, FaucetError
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.runner_cache import close_cached_streams
from faucet_dagster.streams.sensor import faucet_stream_sensor
from faucet_dagster.syncs.assets import faucet_sync_assets
from faucet_dagster.syncs.declaration import FaucetSync
from faucet_dagster.testing import NatsServer, S3Server

SECRETS = {
    "SQL_AUTH": "sql-auth-secret-0001",
    "SQL_QUERY": "sql-query-secret-0002",
    "PG_TOKEN": "pg-token-secret-0003",
    "PG_SSLPASSWORD": "pg-sslpassword-secret-0004",
    "NATS_PASSWORD": "nats-password-secret-0005",
    "NATS_URL": "nats-url-secret-0006",
    "KAFKA_PASSWORD": "kafka-password-secret-0007",
    "STATE_URL": "state-url-secret-0008",
    "YAML": "yaml-secret-0009",
    "PG_QUERY": "pg-query-secret-0010",
    "KAFKA_KEY_PASSWORD": "kafka-key-password-secret-0011",
    "KAFKA_PLAIN": "kafka-plain-secret-0012",
    "S3_SECRET_KEY": "s3-secret-access-key-secret-0013",
    "S3_SESSION": "s3-session-token-secret-0014",
    "S3_URL": "s3-endpoint-url-secret-0015",
}


@pytest.fixture(scope="module")
def nats_users(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with NatsServerWithUsers(base_dir=tmp_path_factory.mktemp("nats_users")).start() as started:
        yield started


def endpoint(connector: str, config: dict[str, Any]) -> FaucetEndpoint:
    return FaucetConnection(connector=connector).using(**config)


def delta_on_s3(endpoint_url: str, uri: str) -> FaucetEndpoint:
    s3 = {
        "endpoint_url": endpoint_url,
        "allow_http": True,
        "access_key_id": "faucet-test-key",
        "secret_access_key": dg.EnvVar("FAUCET_TEST_S3_SECRET_KEY"),
        "session_token": dg.EnvVar("FAUCET_TEST_S3_SESSION"),
    }
    return FaucetConnection(connector="delta", config={"uri": uri, "s3": s3}).using()


def write_csv(path: Path) -> None:
    path.write_text("id,name\n" + "".join(f"{i},n{i}\n" for i in range(1, 6)))


def test_no_secret_reaches_storage_logs_metadata_state_or_output(
    tmp_path: Path,
    postgres_url: str,
    nats_users: NatsServer,
    kafka_bootstrap: str,
    s3_server: S3Server,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    for name, secret in SECRETS.items():
        monkeypatch.setenv(f"FAUCET_TEST_{name}", secret)
    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    data = tmp_path / "data"
    data.mkdir()
    write_csv(data / "a.csv")
    texts: list[str] = []  # every error's text, and what the CLI printed

    files = FaucetConnection(connector="files").using(paths=[str(data / "*.csv")])
    host = postgres_url.split("@", 1)[1].split("/", 1)[0]
    syncs = {
        # Refused at the server's door: nothing listens on port 1.
        "refused": FaucetConnection(
            connector="sql",
            config={
                "url": "postgresql://app@127.0.0.1:1/shop?connect_timeout=2",
                "auth": {
                    "type": "user_password",
                    "config": {"username": "app", "password": dg.EnvVar("FAUCET_TEST_SQL_AUTH")},
                },
            },
        ).using(table="orders"),
        # A password in the URL's query string: refused when the run builds the connector.
        "query": endpoint("sql", {"url": f"{postgres_url}?password={SECRETS['SQL_QUERY']}", "table": "o"}),
        "pg_query": endpoint(
            "postgres",
            {"url": f"{postgres_url}?password={SECRETS['PG_QUERY']}", "table": "o"},
        ),
        "sslpassword": endpoint(
            "postgres",
            {"url": f"{postgres_url}?sslpassword={SECRETS['PG_SSLPASSWORD']}", "table": "o"},
        ),
        # Succeeds: the server trusts the test's connections, the token travels anyway.
        "token": FaucetConnection(
            connector="postgres",
            config={
                "url": postgres_url,
                "auth": {"type": "token", "config": {"token": dg.EnvVar("FAUCET_TEST_PG_TOKEN")}},
            },
        ).using(table="orders_token"),
        # Succeeds (moto takes any credentials), and one whose endpoint does not answer.
        "delta_s3": delta_on_s3(s3_server.endpoint_url, f"s3://{s3_bucket}/lake/orders"),
        "delta_s3_refused": delta_on_s3("http://127.0.0.1:1", f"s3://{s3_bucket}/lake/orders"),
        "delta_s3_url": endpoint(
            "delta",
            {
                "uri": f"s3://{s3_bucket}/lake/url",
                "s3": {"endpoint_url": f"http://key:{SECRETS['S3_URL']}@127.0.0.1:1", "allow_http": True},
            },
        ),
    }
    instance = dg.DagsterInstance.get()
    try:
        for name, sink in syncs.items():
            try:
                # One refused connection is retried as the default policy says; the others fail once.
                retry = {"retry_policy": None} if name == "delta_s3_refused" else {}
                assets = faucet_sync_assets([FaucetSync(name, source=files, sink=sink, **retry)])
            except ConfigError as exc:  # refused when the definitions load (a URL credential)
                assert name in ("query", "pg_query", "sslpassword", "delta_s3_url"), name
                texts.append(f"{exc} {exc.where}")
                continue
            result = dg.materialize(assets, instance=instance, raise_on_error=False)
            assert result.success is (name in ("token", "delta_s3")), name
            for event in result.all_events:
                texts.append(str(event.event_specific_data))
                texts.append(str(event.message))

        state_url = f"postgresql://postgres:{SECRETS['STATE_URL']}@{host}/postgres"
        streams = [
            FaucetStream(
                name="nats_wrong_password",
                source=FaucetConnection(
                    connector="nats",
                    config={
                        "servers": [nats_users.url],
                        "auth": {
                            "type": "user_password",
                            "config": {"username": "app", "password": dg.EnvVar("FAUCET_TEST_NATS_PASSWORD")},
                        },
                    },
                ).using(stream="EVENTS"),
                sink=endpoint("postgres", {"url": postgres_url}),
                resources=("EVENTS",),
                state_url=state_url,
            ),
            FaucetStream(
                name="nats_url_credentials",
                source=endpoint(
                    "nats",
                    {
                        "servers": [f"nats://app:{SECRETS['NATS_URL']}@127.0.0.1:4222"],
                        "stream": "EVENTS",
                    },
                ),
                sink=endpoint("postgres", {"url": postgres_url}),
                resources=("EVENTS",),
                state_url=state_url,
            ),
            FaucetStream(
                name="kafka_sasl",
                source=FaucetConnection(
                    connector="kafka",
                    config={
                        "bootstrap_servers": kafka_bootstrap,
                        "group_id": "g",
                        "request_timeout": 2.0,
                        "security_protocol": "SASL_PLAINTEXT",
                        "auth": {
                            "type": "user_password",
                            "config": {
                                "username": "app",
                                "password": dg.EnvVar("FAUCET_TEST_KAFKA_PASSWORD"),
                            },
                        },
                        "secret_properties": {
                            "ssl.key.password": dg.EnvVar("FAUCET_TEST_KAFKA_KEY_PASSWORD")
                        },
                    },
                ).using(topics=["events"]),
                sink=endpoint("postgres", {"url": postgres_url}),
                resources=("events",),
                state_url=state_url,
            ),
            # A secret-bearing librdkafka property as plain text: refused, its value never echoed.
            FaucetStream(
                name="kafka_plain_secret",
                source=endpoint(
                    "kafka",
                    {
                        "bootstrap_servers": kafka_bootstrap,
                        "group_id": "g",
                        "topics": ["events"],
                        "client_properties": {"sasl.oauthbearer.client.secret": SECRETS["KAFKA_PLAIN"]},
                    },
                ),
                sink=endpoint("postgres", {"url": postgres_url}),
                resources=("events",),
                state_url=state_url,
            ),
        ]
        for stream in streams:
            try:
                # A config refused without I/O fails the definition (as `dg check defs` would); its
                # error is searched like the others.
                sensor = faucet_stream_sensor(stream, budget_seconds=5)
                # The stream's reader opens its sessions in the background: a failure to open them is
                # raised by the tick during which it happens, or by the next one.
                for _ in range(6):
                    outcome = sensor.evaluate_tick(sensor_context(sensor, instance))
                    texts.append(str(outcome.skip_message))
                    time.sleep(1)
            except (FaucetError, dg.DagsterError) as exc:  # the tick fails: its error is searched too
                texts.append(f"{type(exc).__name__}: {exc} {getattr(exc, 'where', '')}")
                texts.append(repr(exc.__cause__))
            finally:
                close_cached_streams()

        broken = tmp_path / "pair.yaml"
        broken.write_text(f"source:\n  config: {{password: {SECRETS['YAML']}\nsink: [\n")
        main(["plan", "-f", str(broken)])
        plan = tmp_path / "plan.yaml"
        plan.write_text(
            "mode: bounded\npolicy: append\n"
            f"source: {{connector: files, config: {{paths: [{data}/a.csv]}}}}\n"
            "sink: {connector: sql, config: "
            f"{{url: 'sqlite:///x.db?password={SECRETS['SQL_QUERY']}', table: t}}}}\n"
        )
        main(["plan", "-f", str(plan)])
        main(["streams", "status", "--state-url", state_url])
        main(["streams", "status", "--state-url", state_url, "--json"])
        main(["streams", "status", "--state-url", state_url.replace("/postgres", ":1/x")])
        captured = capsys.readouterr()
        texts.extend([captured.out, captured.err, caplog.text])
        assert "nats_wrong_password" in captured.out  # the status command did run

        logged = [
            dg.serialize_value(record)
            for run in instance.get_runs()
            for record in instance.all_logs(run.run_id)
        ]
        materialized = [
            str(latest.asset_materialization.metadata)
            for key in instance.get_asset_keys()
            if (latest := instance.get_latest_materialization_event(key)) is not None
            and latest.asset_materialization
        ]
        assert materialized  # the token run materialized
    finally:
        instance.dispose()

    stored = [path.read_bytes() for path in home.rglob("*") if path.is_file()]
    assert len(stored) > 3  # run storage, event logs, compute logs
    everything = [text.encode() for text in [*texts, *logged, *materialized]] + stored
    leaks = {name for name, secret in SECRETS.items() if any(secret.encode() in blob for blob in everything)}
    assert not leaks, f"secrets found: {sorted(leaks)}"
    # The errors say what was wrong (not only that something was).
    joined = "\n".join(texts)
    assert "AuthError" in joined and "refused the credentials" in joined
    assert "carries credentials" in joined or "holds a secret" in joined
    assert "must not carry credentials" in joined
    assert "ConnectionFailed" in joined and "the S3 endpoint does not answer" in joined
    assert "sasl.oauthbearer.client.secret carry a secret" in joined and "secret_properties" in joined
