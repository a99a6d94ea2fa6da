"""Config conventions: one pydantic model per connector, secrets as ``SecretStr``, auth adjacently tagged.

A connector's config is a single typed object (``ConnectorConfig`` subclass): unknown keys are
refused, values are immutable once built, and ``json_schema()`` is the connector's config schema
(FCP check 1). Secrets are ``SecretStr``: they print as ``**********`` and ``redacted()`` is the
only form that may reach logs, Dagster metadata or certificates.

Credentials use the project-wide adjacently tagged shape ``{"type": <method>, "config": {...}}``::

    auth:
      type: user_password
      config: {username: app, password: "..."}
"""

from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from faucet_dagster.protocol.errors import ConfigError

C = TypeVar("C", bound="ConnectorConfig")

REDACTED = "**********"


class ConnectorConfig(BaseModel):
    """Base of every connector config: frozen, strict about unknown keys, secrets hidden."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def parse(cls: type[C], raw: Any, *, where: str | None = None) -> C:
        """Build the config from plain data, turning validation errors into a :class:`ConfigError`.

        The message names every invalid field and never echoes a value (it may be a secret).
        """
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(part) for part in error['loc']) or '<root>'}: {error['msg']}"
                for error in exc.errors(include_input=False)
            )
            raise ConfigError(f"invalid {cls.__name__}: {problems}", where=where or cls.__name__) from None

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The JSON Schema of this config (secrets appear as write-only strings)."""
        return cls.model_json_schema()

    def redacted(self) -> dict[str, Any]:
        """The config as plain data with every secret replaced by ``**********``."""
        redacted: dict[str, Any] = _redact(self)
        return redacted


def _redact(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return REDACTED if value.get_secret_value() else ""
    if isinstance(value, BaseModel):
        return {name: _redact(getattr(value, name)) for name in type(value).model_fields}
    if isinstance(value, dict):
        return {key: _redact(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_redact(item) for item in value]
    return value


class NoAuthConfig(ConnectorConfig):
    """No settings: the server accepts unauthenticated clients."""


class NoAuth(ConnectorConfig):
    type: Literal["none"] = "none"
    config: NoAuthConfig = NoAuthConfig()


class UserPasswordConfig(ConnectorConfig):
    username: str
    password: SecretStr


class UserPasswordAuth(ConnectorConfig):
    type: Literal["user_password"] = "user_password"
    config: UserPasswordConfig


class TokenConfig(ConnectorConfig):
    token: SecretStr


class TokenAuth(ConnectorConfig):
    type: Literal["token"] = "token"
    config: TokenConfig


class CredentialsFileConfig(ConnectorConfig):
    path: str


class CredentialsFileAuth(ConnectorConfig):
    """A credentials file on disk (NATS ``.creds``, a client certificate bundle)."""

    type: Literal["credentials_file"] = "credentials_file"
    config: CredentialsFileConfig


Auth = Annotated[
    NoAuth | UserPasswordAuth | TokenAuth | CredentialsFileAuth,
    Field(discriminator="type"),
]
"""The adjacently tagged auth union every connector uses for credentials."""


def check_write_key(mode: str, key: Sequence[str]) -> None:
    """For a sink config's validator: raise ValueError unless an ``upsert`` mode has a key, and no key
    column name is empty."""
    if mode == "upsert" and not key:
        raise ValueError("mode upsert needs a non-empty key")
    if any(not column for column in key):
        raise ValueError("key columns must not be empty")
