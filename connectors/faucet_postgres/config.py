"""Configs of the PostgreSQL connector. Only pydantic and the protocol are imported at module level
(psycopg is imported when a config is validated or used), so the entry point stays cheap.
"""

import math
from typing import Any, Literal, Self
from urllib.parse import quote

from pydantic import Field, field_validator, model_validator

from faucet_dagster.protocol import (
    Auth,
    ConnectorConfig,
    NoAuth,
    TokenAuth,
    UserPasswordAuth,
    postgres_identifier_problem,
)

SSLMode = Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"]
PostgresWriteMode = Literal["append", "upsert", "replace", "delete", "apply_changes"]
_SECRET_PARAMETERS = ("password", "sslpassword")
"""libpq parameters whose value is a secret (sslpassword: the client key's passphrase)."""
_MAX_TIMEOUT = 2_147_483.0
"""The largest server timeout in seconds (the server keeps milliseconds in an int32)."""


def _milliseconds(seconds: float) -> str:
    """A timeout in whole milliseconds for the server: a positive one never rounds down to 0 (off)."""
    return str(max(1, round(seconds * 1000)) if seconds > 0 else 0)


def refuse_truncated(names: list[str]) -> None:
    """ValueError naming the first of ``names`` PostgreSQL would truncate (more than 63 bytes)."""
    for name in names:
        problem = postgres_identifier_problem(name)
        if problem:
            raise ValueError(problem)


class PostgresConnection(ConnectorConfig):
    """Where the server is and how to log in.

    Either ``url`` (``postgresql://user@host:5432/db?sslmode=require``, without a password) or the
    discrete fields, which override the URL's parts. Credentials go in ``auth``: ``user_password``
    (password as a secret), ``token`` (a secret sent as the password, as cloud IAM tokens are, for
    ``user``) or ``none`` (trust, peer or certificate authentication).
    """

    url: str | None = Field(default=None, description="libpq URL without a password.")
    host: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    database: str | None = None
    user: str | None = None
    auth: Auth = Field(default_factory=NoAuth)
    sslmode: SSLMode | None = None
    connect_timeout: float = Field(
        default=10.0, gt=0, description="Seconds (libpq rounds up to whole seconds)."
    )
    application_name: str = "faucet"

    @field_validator("url")
    @classmethod
    def _url_without_password(cls, url: str | None) -> str | None:
        if url is None:
            return None
        from psycopg import ProgrammingError
        from psycopg.conninfo import conninfo_to_dict

        try:
            parts = conninfo_to_dict(url)
        except ProgrammingError:
            # Never echo the URL: it might hold a secret.
            raise ValueError("not a PostgreSQL connection URL") from None
        secrets = [name for name in _SECRET_PARAMETERS if parts.get(name)]
        if secrets:
            raise ValueError(
                f"the URL holds a secret ({', '.join(secrets)}); put credentials in auth (user_password "
                "or token), whose secrets never reach logs, errors or metadata"
            )
        return url

    @model_validator(mode="after")
    def _supported_auth(self) -> Self:
        if not isinstance(self.auth, NoAuth | UserPasswordAuth | TokenAuth):
            raise ValueError(
                f"auth type {self.auth.type!r} is not supported (use none, user_password or token)"
            )
        return self

    def _params(self) -> dict[str, Any]:
        from psycopg.conninfo import conninfo_to_dict

        params: dict[str, Any] = conninfo_to_dict(self.url) if self.url else {}
        for name in ("host", "port", "user", "sslmode"):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        if self.database is not None:
            params["dbname"] = self.database
        if isinstance(self.auth, UserPasswordAuth):
            params["user"] = self.auth.config.username
        return params

    def conninfo(self) -> str:
        """The libpq connection string, with the secret: pass it to psycopg only, never log it."""
        params = self._params()
        if isinstance(self.auth, UserPasswordAuth):
            params["password"] = self.auth.config.password.get_secret_value()
        elif isinstance(self.auth, TokenAuth):
            params["password"] = self.auth.config.token.get_secret_value()
        params.setdefault("connect_timeout", max(1, math.ceil(self.connect_timeout)))
        params.setdefault("application_name", self.application_name)
        from psycopg.conninfo import make_conninfo

        return make_conninfo("", **params)

    def safe_url(self) -> str:
        """``postgresql://user@host:port/database``: no password, for messages and dataset URIs."""
        params = self._params()
        user = f"{quote(str(params['user']), safe='')}@" if params.get("user") else ""
        host = str(params.get("host") or "localhost")
        port = params.get("port") or 5432
        database = quote(str(params.get("dbname") or params.get("user") or ""), safe="")
        return f"postgresql://{user}{host}:{port}/{database}"


class PostgresTable(PostgresConnection):
    """A table: ``table`` in ``schema_name`` (the first schema of the search path when unset)."""

    table: str = Field(min_length=1)
    schema_name: str | None = None

    def configured_names(self) -> list[str]:
        """Every identifier this config names (tables, schemas, columns), checked against PostgreSQL's
        63-byte limit at validation: a longer one would silently name another table or column."""
        return [self.table, *([self.schema_name] if self.schema_name else [])]

    @model_validator(mode="after")
    def _names_kept(self) -> Self:
        refuse_truncated(self.configured_names())
        return self

    def table_uri(self) -> str:
        """``postgresql://user@host:port/database/schema.table`` (schema when configured), no secret."""
        schema = f"{self.schema_name}." if self.schema_name else ""
        return f"{self.safe_url()}/{schema}{self.table}"


class PostgresSourceConfig(PostgresTable):
    """An incremental read of one table in ascending ``(cursor, key...)`` order.

    ``cursor`` is the column that grows as rows are added or changed; rows whose cursor is NULL are
    not read. ``key`` breaks ties between rows sharing a cursor value and must be unique with it;
    empty means the table's primary key. Without a cursor the table is read in key order and resumed
    after the last key. ``columns`` reads only those columns (empty: all).
    """

    cursor: str | None = None
    key: list[str] = Field(default_factory=list)
    columns: list[str] | None = None
    fetch_rows: int = Field(
        default=50_000, ge=1, description="Rows fetched from the server-side cursor per round trip."
    )

    def configured_names(self) -> list[str]:
        return [
            *super().configured_names(),
            *([self.cursor] if self.cursor else []),
            *self.key,
            *(self.columns or []),
        ]


class PostgresSinkConfig(PostgresTable):
    """A table written by ``mode``: append (COPY), upsert or delete (by ``key``, through a staging
    table), replace (a new table swapped in at finish), or apply_changes (change rows applied by key
    in row order, see :mod:`faucet_postgres.changes`; ``key`` defaults to the rows' ``faucet.key``
    columns).

    The table is created from the first batch's Arrow schema when missing (``key`` as its primary key
    in upsert mode). ``schema_evolution`` adds a column the table lacks (ADD COLUMN IF NOT EXISTS); off,
    such a column raises SchemaError. The commit-token watermark lives in ``watermark_table`` (in the
    table's schema), one row per ``sync_id`` (default: the qualified table name). ``copy_format``
    ``auto`` uses binary COPY when every column has a binary encoder for its destination type, else
    CSV; ``csv`` always uses CSV.
    """

    mode: PostgresWriteMode = "append"
    key: list[str] = Field(default_factory=list)
    schema_evolution: bool = True
    sync_id: str | None = Field(default=None, min_length=1)
    watermark_table: str = Field(default="_faucet_watermarks", min_length=1)
    copy_format: Literal["auto", "csv"] = "auto"

    def configured_names(self) -> list[str]:
        return [*super().configured_names(), *self.key, self.watermark_table]

    @model_validator(mode="after")
    def _key_for_keyed_modes(self) -> Self:
        if self.mode in ("upsert", "delete") and not self.key:
            raise ValueError(f"mode {self.mode} needs a non-empty key")
        if any(not column for column in self.key):
            raise ValueError("key columns must not be empty")
        return self


class PostgresStreamingSinkConfig(PostgresConnection):
    """Where a continuous stream's epochs land: one table per resource, one transaction per epoch.

    A resource goes to ``tables[resource]``, else ``table``, else a table named like the resource,
    in ``schema_name`` (the first schema of the search path when unset); a missing table is created
    from the first batch's Arrow schema when ``create_tables`` (the key as its primary key for the
    keyed policies). ``schema_evolution`` adds columns the table lacks; off, they raise SchemaError.
    ``version_column`` names the column VERSIONED_UPSERT compares (a row is applied only when its
    version is newer than the stored one). The stream's last committed epoch with its owner fence
    (``epochs_table``, one row per stream) and its per-domain watermarks (``watermarks_table``) live
    in ``state_schema_name`` (default: ``schema_name``). ``epoch_column`` (off by default) adds a
    ``bigint`` column of that name to every table the stream writes, holding the epoch that last wrote
    the row (the stream's id above the epoch's sequence: ``faucet_postgres.stream_tables.epoch_stamp``):
    what lets ``faucet verify`` tell an epoch's rows apart (APPEND: each event once; UPSERT and
    VERSIONED_UPSERT: a row a later epoch changed); APPLY_CHANGES tables are not stamped (in a table
    without a key every column of a change is the row's identity). See docs/verification.md for its cost.

    Two server timeouts bound what an epoch's open transaction can do to another worker's (see the
    streaming sink's module docstring, "Zombies and locks"): ``lock_timeout`` is how long a statement
    of this sink waits for a lock another transaction holds before the epoch fails with a retryable
    error; ``idle_in_transaction_session_timeout`` is how long the server lets this sink's epoch
    transaction sit idle before it ends the connection (rolling the epoch back). Keep the latter at or
    below the stream's ``lease_seconds``, so the transaction of a frozen previous owner (a stopped VM,
    a long pause) ends about when its lease expires, and above the longest pause between the sink's
    statements inside an epoch, which the read limits (``idle``, ``age``) bound. Seconds; 0: no limit
    (whatever the server's or the role's default).
    """

    table: str | None = Field(default=None, min_length=1)
    tables: dict[str, str] = Field(default_factory=dict)
    schema_name: str | None = None
    create_tables: bool = True
    schema_evolution: bool = False
    version_column: str | None = Field(default=None, min_length=1)
    epoch_column: str | None = Field(default=None, min_length=1)
    state_schema_name: str | None = None
    epochs_table: str = Field(default="_faucet_stream_epochs", min_length=1)
    watermarks_table: str = Field(default="_faucet_stream_watermarks", min_length=1)
    lock_timeout: float = Field(
        default=10.0,
        ge=0,
        le=_MAX_TIMEOUT,
        description="Seconds a statement waits for a lock held by another transaction (0: no limit).",
    )
    idle_in_transaction_session_timeout: float = Field(
        default=120.0,
        ge=0,
        le=_MAX_TIMEOUT,
        description=(
            "Seconds the server lets an epoch's transaction sit idle before it ends the connection "
            "(0: no limit). At most the stream's lease_seconds; above the longest pause between the "
            "sink's statements inside an epoch."
        ),
    )

    @model_validator(mode="after")
    def _names_kept(self) -> Self:
        refuse_truncated(
            [
                *([self.table] if self.table else []),
                *self.tables.values(),
                *(
                    name
                    for name in (
                        self.schema_name,
                        self.state_schema_name,
                        self.version_column,
                        self.epoch_column,
                    )
                    if name
                ),
                self.epochs_table,
                self.watermarks_table,
            ]
        )
        return self

    def timeout_settings(self) -> dict[str, str]:
        """The session settings of the two timeouts, in milliseconds (``"0"``: off)."""
        return {
            "lock_timeout": _milliseconds(self.lock_timeout),
            "idle_in_transaction_session_timeout": _milliseconds(self.idle_in_transaction_session_timeout),
        }

    def table_for(self, resource: str) -> str:
        return self.tables.get(resource) or self.table or resource
