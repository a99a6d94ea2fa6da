"""The config of the Delta Lake sink. Only pydantic and the protocol are imported here.

A Delta table is a folder (``uri``): Parquet files and the ``_delta_log`` of its commits. This sink
writes local tables (a path, or a ``file://`` URI) and tables on S3 or an S3-compatible store
(``s3://bucket/path``), whose endpoint and credentials go in ``s3`` with the secret as a ``SecretStr``.
Other object stores (``az://``, ``gs://``) are refused at config time.

Commits on S3. Delta's optimistic commit needs the store to refuse a second writer of the same log
entry. This sink always asks delta-rs for conditional puts (``If-None-Match: *`` on the log entry,
object_store's ``aws_conditional_put=etag``): AWS S3, MinIO and Cloudflare R2 support them. It never
sets ``AWS_S3_ALLOW_UNSAFE_RENAME`` and takes no DynamoDB locking provider.
"""

import ipaddress
from pathlib import Path
from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from faucet_dagster.protocol import ConnectorConfig, check_write_key, refuse_url_credentials

DeltaWriteMode = Literal["append", "upsert", "replace"]

_LOOPBACK_NAMES = ("localhost",)


class S3Storage(ConnectorConfig):
    """Where and how to reach an S3 bucket. Without ``access_key_id``, delta-rs takes credentials from
    the environment (``AWS_ACCESS_KEY_ID``..., an instance or pod role).

    ``endpoint_url`` points at an S3-compatible store (MinIO, moto); it must not carry credentials.
    ``allow_http`` lets requests go unencrypted, and only to a loopback endpoint (a local test store):
    a signed request does not reveal the secret, but the data would cross the network in the clear.
    """

    endpoint_url: str | None = Field(default=None, min_length=1)
    region: str = Field(default="us-east-1", min_length=1)
    access_key_id: str | None = Field(default=None, min_length=1)
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None
    allow_http: bool = False

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(refuse_url_credentials(url, auth_hint="s3.access_key_id and s3.secret_access_key"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("the endpoint must be an http:// or https:// URL with a host")
        return url

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("access_key_id and secret_access_key go together")
        if self.session_token is not None and self.access_key_id is None:
            raise ValueError("session_token needs access_key_id and secret_access_key")
        scheme = None if self.endpoint_url is None else urlsplit(self.endpoint_url).scheme
        if scheme == "http" and not self.allow_http:
            raise ValueError(
                "the endpoint is http://: set allow_http (loopback endpoints only) or use https://"
            )
        if self.allow_http and not _loopback(self.endpoint_url):
            raise ValueError("allow_http is only for a loopback endpoint_url (127.0.0.1, ::1, localhost)")
        return self

    def storage_options(self) -> dict[str, str]:
        """delta-rs's ``storage_options``, secrets included: handed to delta-rs, never printed."""
        options = {"AWS_REGION": self.region, "aws_conditional_put": "etag"}
        if self.endpoint_url is not None:
            options["AWS_ENDPOINT_URL"] = self.endpoint_url
        if self.allow_http:
            options["AWS_ALLOW_HTTP"] = "true"
        if self.access_key_id is not None and self.secret_access_key is not None:
            options["AWS_ACCESS_KEY_ID"] = self.access_key_id
            options["AWS_SECRET_ACCESS_KEY"] = self.secret_access_key.get_secret_value()
        if self.session_token is not None:
            options["AWS_SESSION_TOKEN"] = self.session_token.get_secret_value()
        return options

    def secrets(self) -> list[str]:
        """The secret values, for scrubbing a third-party error message before it is raised."""
        return [s.get_secret_value() for s in (self.secret_access_key, self.session_token) if s is not None]


def _loopback(url: str | None) -> bool:
    host = None if url is None else urlsplit(url).hostname
    if host is None:
        return False
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class DeltaSinkConfig(ConnectorConfig):
    """A Delta table written by ``mode``: append (with the commit token as the table's transaction
    identifier), upsert (MERGE by ``key``) or replace (one overwrite commit at the end of the run).

    ``schema_evolution`` merges a column the table lacks into its schema (Delta's schema merge; for
    replace, the new snapshot's schema replaces the table's); off, such a column raises SchemaError.
    ``partition_by`` partitions a table this sink creates. ``app_id`` names this sync's transaction
    identifier in the table's log (default: ``faucet:<table folder>``). ``s3`` reaches an ``s3://``
    table's store (see :class:`S3Storage`).
    """

    uri: str = Field(
        min_length=1, description="The table's folder: a local path, a file:// URI or s3://bucket/path."
    )
    mode: DeltaWriteMode = "append"
    key: list[str] = Field(default_factory=list)
    schema_evolution: bool = True
    partition_by: list[str] = Field(default_factory=list)
    app_id: str | None = Field(default=None, min_length=1)
    s3: S3Storage | None = None

    @field_validator("uri")
    @classmethod
    def _supported_store(cls, uri: str) -> str:
        parts = urlsplit(uri)
        if parts.scheme == "s3":
            refuse_url_credentials(uri, auth_hint="s3")
            if not parts.netloc or parts.path.strip("/") == "":
                raise ValueError("an s3:// table needs a bucket and a folder: s3://bucket/path")
        elif parts.scheme and parts.scheme != "file" and len(parts.scheme) > 1:  # "C:" is a drive
            raise ValueError(
                f"{parts.scheme}:// tables are not supported: use a local path or s3://bucket/path"
            )
        return uri

    @model_validator(mode="after")
    def _key_for_upsert(self) -> Self:
        check_write_key(self.mode, self.key)
        if any(not column for column in self.partition_by):
            raise ValueError("partition columns must not be empty")
        if self.s3 is not None and not self.on_s3():
            raise ValueError("s3 is set but the uri is not an s3:// table")
        return self

    def on_s3(self) -> bool:
        return urlsplit(self.uri).scheme == "s3"

    def table_uri(self) -> str:
        """What delta-rs opens: ``s3://bucket/path`` (no trailing slash), or the local folder, absolute."""
        if self.on_s3():
            return self.uri.rstrip("/")
        return str(self.path())

    def path(self) -> Path:
        """The local table's folder, absolute (only for a local table)."""
        parts = urlsplit(self.uri)
        return Path(parts.path if parts.scheme == "file" else self.uri).expanduser().absolute()

    def storage_options(self) -> dict[str, str] | None:
        """delta-rs's ``storage_options`` for an ``s3://`` table (secrets included), None for a local one."""
        if not self.on_s3():
            return None
        return (self.s3 or S3Storage()).storage_options()

    def secrets(self) -> list[str]:
        return [] if self.s3 is None else self.s3.secrets()

    def transaction_app_id(self) -> str:
        name = self.table_uri().rstrip("/").rsplit("/", 1)[-1] if self.on_s3() else self.path().name
        return self.app_id if self.app_id is not None else f"faucet:{name}"


__all__ = ["DeltaSinkConfig", "DeltaWriteMode", "S3Storage"]
