"""Hostile and careless configuration: secrets in URLs and YAML, names PostgreSQL would truncate.

Every refusal is a ConfigError raised before any connection, naming the problem and never echoing
the secret; a secret the store must accept in its URL (it has no auth field) is never printed.
"""

from pathlib import Path
from typing import Any

import pytest

from faucet_dagster.cli.main import EXIT_BAD_INPUT, main
from faucet_dagster.protocol import ConfigError, ConnectionFailed, get_connector
from faucet_dagster.state import StateStore

SECRET = "S3cr3t-in-the-url"


def refused(connector: str, role: str, config: dict[str, Any]) -> ConfigError:
    """The ConfigError building the connector's ``role`` from ``config`` raises."""
    spec = get_connector(connector)
    build = spec.source if role == "source" else spec.sink
    with pytest.raises(ConfigError) as caught:
        build(config)
    return caught.value


@pytest.mark.parametrize(
    ("connector", "role", "config"),
    [
        (
            "sql",
            "source",
            {"url": f"postgresql+psycopg://app@db.example/shop?password={SECRET}", "table": "t"},
        ),
        ("sql", "sink", {"url": f"postgresql://app@db.example/shop?sslpassword={SECRET}", "table": "t"}),
        ("sql", "sink", {"url": f"mysql://app@db.example/shop?passwd={SECRET}", "table": "t"}),
        ("sql", "sink", {"url": f"postgresql://app:{SECRET}@db.example/shop", "table": "t"}),
        ("postgres", "source", {"url": f"postgresql://app@db.example/shop?password={SECRET}", "table": "t"}),
        ("postgres", "sink", {"url": f"postgresql://app@db.example/shop?sslpassword={SECRET}", "table": "t"}),
        ("postgres", "sink", {"url": f"host=db.example dbname=shop sslpassword={SECRET}", "table": "t"}),
        (
            "nats",
            "source",
            {"servers": [f"nats://app:{SECRET}@127.0.0.1:4222"], "stream": "S"},
        ),
        (
            "kafka",
            "source",
            {"bootstrap_servers": f"app:{SECRET}@127.0.0.1:9092", "topics": ["t"], "group_id": "g"},
        ),
    ],
)
def test_a_credential_in_a_url_is_refused_without_echoing_it(
    connector: str, role: str, config: dict[str, Any]
) -> None:
    error = refused(connector, role, config)
    text = f"{error} {error.where}"
    assert SECRET not in text
    assert "auth" in text


KAFKA = {"bootstrap_servers": "127.0.0.1:9092", "topics": ["t"], "group_id": "g"}


@pytest.mark.parametrize(
    "name",
    [
        "sasl.password",
        "ssl.key.password",
        "ssl.keystore.password",
        "sasl.oauthbearer.client.secret",
        "ssl.key.pem",
        "sasl.oauthbearer.config",
        "my.custom.Password",
    ],
)
def test_a_secret_bearing_kafka_client_property_in_plain_text_is_refused_pointing_to_the_secret_form(
    name: str,
) -> None:
    error = refused("kafka", "source", {**KAFKA, "client_properties": {name: SECRET}})
    text = f"{error} {error.where}"
    assert SECRET not in text
    assert name in text
    assert "auth" in text if name == "sasl.password" else "secret_properties as {env: NAME}" in text


def test_kafka_secret_properties_reach_the_client_only() -> None:
    from faucet_kafka import KafkaSourceConfig
    from faucet_kafka.client import client_settings

    config = KafkaSourceConfig.parse(
        {**KAFKA, "secret_properties": {"ssl.key.password": SECRET}, "client_properties": {"linger.ms": "5"}}
    )
    assert client_settings(config)["ssl.key.password"] == SECRET
    assert SECRET not in f"{config!r} {config} {config.redacted()} {config.model_dump_json()}"
    assert config.redacted()["secret_properties"] == {"ssl.key.password": "**********"}
    error = refused("kafka", "source", {**KAFKA, "secret_properties": {"sasl.password": SECRET}})
    assert SECRET not in f"{error} {error.where}" and "auth" in error.message


def test_the_state_store_never_prints_a_password_or_a_query_of_its_url(tmp_path: Path) -> None:
    # A URL SQLAlchemy cannot parse: its own message would quote it.
    with pytest.raises(ConfigError) as caught:
        StateStore(f"postgresql://app:{SECRET}@host:notaport/db")
    assert SECRET not in str(caught.value)
    # The store has no auth field: a URL password is accepted, and never shown (nor the query).
    with pytest.raises(ConnectionFailed) as refused:
        StateStore(f"postgresql://app:{SECRET}@127.0.0.1:1/db?sslpassword={SECRET}&connect_timeout=2")
    assert SECRET not in f"{refused.value} {refused.value.where}"
    assert "127.0.0.1:1/db" in str(refused.value)


def test_faucet_plan_never_echoes_yaml_it_cannot_parse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "pair.yaml"
    for text in (
        f"source:\n  config: {{url: 'postgresql://app@h/db', password: {SECRET}\nsink: [\n",
        f'password: "{SECRET}\n',
        f"a: b: {SECRET}\n",
        f"a: *{SECRET}\n",
        f"a: !{SECRET} x\n",
    ):
        broken.write_text(text)
        assert main(["plan", "-f", str(broken)]) == EXIT_BAD_INPUT
        captured = capsys.readouterr()
        output = captured.out + captured.err
        assert SECRET not in output
        assert str(broken) in output and "line" in output and "column" in output


def test_a_set_flag_that_is_not_yaml_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--set-source", f"emits=[{SECRET}", "--set-sink", "x=1"]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err
    assert "line 1" in captured.err


LONG = "t" * 60 + "é" * 2  # 62 characters, 64 bytes: PostgreSQL would cut it to 63 bytes


@pytest.mark.parametrize(
    ("connector", "role", "config"),
    [
        ("postgres", "sink", {"url": "postgresql://app@h/db", "table": LONG}),
        ("postgres", "sink", {"url": "postgresql://app@h/db", "table": "t", "schema_name": LONG}),
        ("postgres", "sink", {"url": "postgresql://app@h/db", "table": "t", "mode": "upsert", "key": [LONG]}),
        ("postgres", "source", {"url": "postgresql://app@h/db", "table": "t", "cursor": LONG}),
        ("postgres", "source", {"url": "postgresql://app@h/db", "table": "t", "columns": ["a", LONG]}),
        ("sql", "sink", {"url": "postgresql://app@h/db", "table": LONG}),
        ("sql", "source", {"url": "postgresql://app@h/db", "table": "t", "key": [LONG]}),
        ("sql", "sink", {"url": "mysql://app@h/db", "table": "m" * 65}),
    ],
)
def test_a_name_the_database_would_truncate_is_refused_naming_it(
    connector: str, role: str, config: dict[str, Any]
) -> None:
    message = str(refused(connector, role, config))
    assert "bytes long" in message or "characters long" in message
    assert ("'" + (LONG if "m" * 65 not in str(config) else "m" * 65) + "'") in message


def test_streaming_sink_names_are_checked_and_63_bytes_still_fit() -> None:
    spec = get_connector("postgres")
    with pytest.raises(ConfigError, match="64 bytes long"):
        spec.streaming_sink({"url": "postgresql://app@h/db", "tables": {"events": LONG}})
    with pytest.raises(ConfigError, match="64 bytes long"):
        spec.streaming_sink({"url": "postgresql://app@h/db", "state_schema_name": LONG})
    spec.streaming_sink({"url": "postgresql://app@h/db", "table": LONG[:-1]})  # 63 bytes: kept
    get_connector("sql").sink({"url": "sqlite:///w.db", "table": "s" * 200})  # SQLite has no limit


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_a_corrupt_sqlite_state_store_is_a_config_error_naming_the_file(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "faucet_state.db"
    with StateStore(f"sqlite:///{path}") as store:
        for index in range(200):  # enough rows for several pages, so a truncated file misses some
            store.acquire_lease(f"stream-{index:04d}-" + "x" * 200, "w1", 30)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a database at all " * 500)
    with pytest.raises(ConfigError) as caught, StateStore(f"sqlite:///{path}") as store:
        store.status()
    assert not caught.value.retryable
    assert str(path) in caught.value.message and "corrupt" in caught.value.message
    assert "backup" in caught.value.message
