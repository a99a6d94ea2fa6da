"""Configuration of the NATS JetStream connector (no client import: capabilities are read offline).

:class:`NatsConnectionConfig` says how to reach the servers; the source config adds what is read and
how. A later NATS streaming sink subclasses the connection config the same way.
"""

import re
from typing import Literal

import pyarrow as pa
from pydantic import Field, field_validator, model_validator

from faucet_dagster.protocol import Auth, ConnectorConfig, NoAuth, schema_from_columns

# JetStream names: no whitespace, '.', '*', '>', path separators (ADR-6 "name" rules).
_NAME = re.compile(r"[^\s.*>/\\]+")
_SUBJECT = re.compile(r"[^\s]+")


class NatsConnectionConfig(ConnectorConfig):
    """How to reach a NATS server (cluster) with JetStream.

    ``servers``: one or more ``nats://host:port`` URLs (no credentials in them: use ``auth``, whose
    secrets never reach logs or errors). ``auth``: ``none``, ``user_password``, ``token`` or
    ``credentials_file`` (a ``.creds`` file). ``api_prefix`` is ``$JS.API`` unless the account
    reaches JetStream through another domain (``$JS.<domain>.API``).
    """

    servers: tuple[str, ...] = Field(default=("nats://127.0.0.1:4222",), min_length=1)
    auth: Auth = NoAuth()
    client_name: str = "faucet"
    api_prefix: str = "$JS.API"
    connect_timeout: float = Field(default=5.0, gt=0)
    request_timeout: float = Field(default=5.0, gt=0)
    """Seconds a JetStream API request or a confirmed acknowledgement may take (ConnectionFailed)."""

    @field_validator("servers")
    @classmethod
    def _plain_urls(cls, servers: tuple[str, ...]) -> tuple[str, ...]:
        for server in servers:
            if "@" in server:
                raise ValueError("server URLs must not carry credentials: put them in auth")
            if not server.strip():
                raise ValueError("server URLs must not be empty")
        return servers


class NatsSourceConfig(NatsConnectionConfig):
    """A JetStream stream read through a push consumer with explicit, cumulative acknowledgements.

    ``stream`` is the resource; ``subject`` (optional) filters it, and is then the ordering domain's
    partition. ``durable`` names the consumer a continuous session (re)creates at the certified
    position on every open: faucet owns it; do not share it.

    ``format``: ``json`` turns each payload, a JSON object, into a row. With ``columns`` declared
    (``{"id": "int64 not null", "name": "string"}``, Arrow type names) whole batches are parsed by
    Arrow at once; a payload that is a JSON object but does not fit them is malformed (below), as
    one that is not JSON. Without ``columns`` each payload is decoded on its own and the pipeline
    infers or applies the schema. ``bytes`` hands the columns of :data:`RAW_SCHEMA` (subject, data,
    headers, timestamp, stream, sequence). ``on_malformed`` decides what happens to a payload that
    cannot become a row (not JSON, not an object, not fitting the declared columns): ``halt`` raises
    a DataError naming stream and sequence; ``dead_letter`` hands the raw payload to the pipeline's
    dead-letter route and reads on.

    ``ack_wait`` is the consumer's redelivery timeout; the session keeps every delivered message it
    has not acknowledged alive with ``+WPI`` well within it, so a sink that blocks for longer causes
    no redelivery. ``max_ack_pending`` bounds the messages delivered and not yet acknowledged: it
    must exceed an epoch's record limit (twice it lets the next epoch's messages arrive while one
    commits). ``bounded`` makes a session stop at the stream's last sequence at open.
    """

    stream: str
    subject: str | None = None
    durable: str | None = None
    """The consumer name; default ``faucet_<stream>``."""
    source_name: str = Field(default="nats", min_length=1)
    format: Literal["json", "bytes"] = "json"
    columns: dict[str, str] | None = None
    on_malformed: Literal["halt", "dead_letter"] = "halt"
    ack_wait: float = Field(default=30.0, gt=0)
    max_ack_pending: int = Field(default=100_000, ge=1)
    idle_heartbeat: float = Field(default=2.0, gt=0)
    chunk_messages: int = Field(default=8_192, ge=1)
    """Messages decoded and written to the pipeline per call: large runs keep per-message cost low."""
    bounded: bool = False

    @field_validator("stream", "durable")
    @classmethod
    def _jetstream_name(cls, name: str | None) -> str | None:
        if name is not None and not _NAME.fullmatch(name):
            raise ValueError(
                "a stream or consumer name is non-empty, without spaces, '.', '*', '>' or slashes"
            )
        return name

    @field_validator("subject")
    @classmethod
    def _subject(cls, subject: str | None) -> str | None:
        if subject is not None and not _SUBJECT.fullmatch(subject):
            raise ValueError("a subject filter is non-empty and has no whitespace")
        return subject

    @model_validator(mode="after")
    def _columns_fit_format(self) -> "NatsSourceConfig":
        if self.columns is not None:
            if self.format != "json":
                raise ValueError("columns declare the fields of JSON payloads: use them with format json")
            schema_from_columns(self.columns, where=f"nats stream {self.stream}")
        return self

    @property
    def consumer_name(self) -> str:
        return self.durable or f"faucet_{self.stream}"

    @property
    def partition(self) -> str:
        """The ordering domain's partition: the subject filter, or '' for the whole stream."""
        return self.subject or ""

    def declared_schema(self) -> pa.Schema | None:
        """The Arrow schema of the rows this config produces, when it is known before reading."""
        if self.format == "bytes":
            return RAW_SCHEMA
        if self.columns is None:
            return None
        return schema_from_columns(self.columns, where=f"nats stream {self.stream}")


HEADER_TYPE = pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.string())]))

RAW_SCHEMA = pa.schema(
    [
        pa.field("subject", pa.string(), nullable=False),
        pa.field("data", pa.binary(), nullable=False),
        pa.field("headers", HEADER_TYPE),
        pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("stream", pa.string(), nullable=False),
        pa.field("sequence", pa.int64(), nullable=False),
    ]
)
"""The columns of the ``bytes`` format: one row per message, its payload as bytes."""
