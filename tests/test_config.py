"""Config conventions: typed models, secrets hidden, adjacently tagged auth, clear errors."""

import pytest
from pydantic import SecretStr, TypeAdapter

from faucet_dagster.protocol import REDACTED, Auth, ConfigError, ConnectorConfig, UserPasswordAuth


class ExampleConfig(ConnectorConfig):
    host: str
    port: int = 5432
    auth: Auth = {"type": "none", "config": {}}  # type: ignore[assignment]


def test_auth_is_adjacently_tagged_and_secrets_are_redacted() -> None:
    config = ExampleConfig.parse(
        {"host": "db", "auth": {"type": "user_password", "config": {"username": "app", "password": "s3cret"}}}
    )
    assert isinstance(config.auth, UserPasswordAuth)
    assert isinstance(config.auth.config.password, SecretStr)
    assert config.auth.config.password.get_secret_value() == "s3cret"
    redacted = config.redacted()
    assert redacted["auth"] == {"type": "user_password", "config": {"username": "app", "password": REDACTED}}
    assert "s3cret" not in repr(config) and "s3cret" not in str(redacted)


def test_invalid_config_names_every_field_without_echoing_values() -> None:
    with pytest.raises(ConfigError) as caught:
        ExampleConfig.parse(
            {"port": "not-a-port", "extra": 1, "auth": {"type": "token", "config": {"token": 5, "x": "leak"}}}
        )
    message = str(caught.value)
    for field in ("host", "port", "extra", "auth.token.config"):
        assert field in message
    assert "leak" not in message and "not-a-port" not in message


def test_config_schema_is_json_schema_with_the_auth_union() -> None:
    schema = ExampleConfig.json_schema()
    assert schema["type"] == "object" and "host" in schema["required"]
    auth_types = TypeAdapter(Auth).json_schema()
    assert {"none", "user_password", "token", "credentials_file"} <= set(
        auth_types["discriminator"]["mapping"]
    )
