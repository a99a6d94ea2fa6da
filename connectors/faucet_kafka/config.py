"""Configuration of the Kafka source (no client import: capabilities and schemas are read offline)."""

from collections.abc import Mapping
from typing import Literal

import pyarrow as pa
from pydantic import Field, SecretStr, field_validator, model_validator

from faucet_dagster.protocol import Auth, ConnectorConfig, NoAuth, schema_from_columns

ENFORCED_PROPERTIES = frozenset(
    {
        "bootstrap.servers",
        "group.id",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "isolation.level",
        "auto.offset.reset",
        "enable.partition.eof",
        "security.protocol",
        "sasl.mechanism",
        "sasl.mechanisms",
        "sasl.username",
        "sasl.password",
    }
)
"""librdkafka properties the source sets itself: its guarantees depend on them."""

SECRET_WORDS = ("password", "secret", "token")
"""A librdkafka property whose name holds one of these carries a secret (``ssl.key.password``,
``sasl.oauthbearer.client.secret``...)."""
SECRET_PROPERTIES = frozenset({"ssl.key.pem", "ssl_key", "sasl.oauthbearer.config"})
"""Secret-bearing librdkafka properties whose names do not say so: a private key, a config string
that may hold the client secret."""


def is_secret_property(name: str) -> bool:
    """True for a librdkafka property that carries a secret (see SECRET_WORDS, SECRET_PROPERTIES)."""
    lowered = name.lower()
    return lowered in SECRET_PROPERTIES or any(word in lowered for word in SECRET_WORDS)


class KafkaSourceConfig(ConnectorConfig):
    """How to reach a Kafka-protocol cluster and read its topics.

    ``topics`` are the resources a stream may select; the continuous session reads the ones the
    runner selects, the bounded source reads all of them. ``group_id`` names the consumer group that
    acknowledgements commit to (offset = last certified offset + 1); the source never joins the
    group: it assigns the partitions its membership owns and never rebalances.

    ``format``: ``json`` hands each record's value, a JSON object, to the pipeline as a row (its
    schema and the bad-row policy for wrong types are the pipeline's); ``bytes`` and ``text`` hand the
    columns ``key``, ``value``, ``headers``, ``timestamp``, ``topic``, ``partition``, ``offset`` (key
    and value as binary, or as UTF-8 strings). With ``columns`` declared (``{"id": "int64 not null",
    "name": "string"}``, Arrow type names), ``json`` values are parsed by Arrow a whole batch at once
    into exactly those columns, and a value that is a JSON object but does not fit them is malformed
    too (``on_malformed`` decides, not the pipeline). ``on_malformed`` decides what happens to a payload that
    cannot become a row (not JSON, not an object, not UTF-8): ``halt`` raises a DataError naming
    topic, partition and offset; ``dead_letter`` hands the raw payload to the pipeline's dead-letter
    route (``StreamRecordSink.reject``) and reads on.
    """

    bootstrap_servers: str = Field(min_length=1)
    topics: tuple[str, ...] = Field(min_length=1)
    group_id: str = Field(min_length=1)
    source_name: str = Field(default="kafka", min_length=1)
    format: Literal["json", "bytes", "text"] = "json"
    columns: dict[str, str] | None = None
    on_malformed: Literal["halt", "dead_letter"] = "halt"
    auth: Auth = NoAuth()
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    batch_size: int = Field(default=10_000, ge=1)
    """Messages taken from the client per call: large batches keep the per-message cost low."""
    poll_timeout: float = Field(default=0.5, gt=0)
    """Seconds one client call waits for messages (cancellation is noticed between calls)."""
    request_timeout: float = Field(default=10.0, gt=0)
    """Seconds a metadata, watermark or commit request may take before ConnectionFailed."""
    verify_offset_gaps: bool = True
    """Re-read the offsets a read skipped to prove the broker, not the client, left them out."""
    client_properties: dict[str, str] = Field(default_factory=dict)
    """Extra librdkafka properties (``fetch.max.bytes``...); the enforced ones cannot be overridden,
    and a secret-bearing one is refused here: it goes in ``secret_properties``."""
    secret_properties: dict[str, SecretStr] = Field(default_factory=dict)
    """Extra librdkafka properties that carry a secret (``ssl.key.password``,
    ``sasl.oauthbearer.client.secret``), written as ``{env: NAME}`` / ``dg.EnvVar``: handed to the
    client only, never printed (``**********`` in ``redacted()``)."""

    @field_validator("bootstrap_servers")
    @classmethod
    def _no_credentials(cls, servers: str) -> str:
        # host:port pairs never carry credentials; a user:password@ would be printed in every `where`.
        if "@" in servers:
            raise ValueError("bootstrap servers must not carry credentials: put them in auth")
        return servers

    @model_validator(mode="after")
    def _columns_fit_format(self) -> "KafkaSourceConfig":
        if self.columns is not None:
            if self.format != "json":
                raise ValueError("columns declare the fields of JSON values: use them with format json")
            self.declared_schema()
        return self

    def declared_schema(self) -> pa.Schema | None:
        """The Arrow schema of the declared ``columns`` (format ``json``), or None."""
        if self.columns is None:
            return None
        return schema_from_columns(self.columns, where=f"kafka topics {', '.join(self.topics)}")

    @field_validator("topics")
    @classmethod
    def _distinct_topics(cls, topics: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(topics)) != len(topics) or any(not topic for topic in topics):
            raise ValueError("topics must be distinct, non-empty names")
        return topics

    @field_validator("client_properties")
    @classmethod
    def _not_enforced(cls, properties: dict[str, str]) -> dict[str, str]:
        _refuse_enforced(properties, "client_properties")
        # Never echo the value: it is the secret. Consistent with a password in a PostgreSQL URL.
        secrets = sorted(name for name in properties if is_secret_property(name))
        if secrets:
            raise ValueError(
                f"client_properties {', '.join(secrets)} carry a secret, given here as plain text: move "
                "them to secret_properties as {env: NAME} (dg.EnvVar), whose values never reach logs, "
                "errors or metadata"
            )
        return properties

    @field_validator("secret_properties")
    @classmethod
    def _secret_not_enforced(cls, properties: dict[str, SecretStr]) -> dict[str, SecretStr]:
        _refuse_enforced(properties, "secret_properties")
        return properties


def _refuse_enforced(properties: Mapping[str, object], field: str) -> None:
    overridden = sorted(set(properties) & ENFORCED_PROPERTIES)
    if overridden:
        raise ValueError(
            f"the source sets {', '.join(overridden)} itself (SASL credentials: from auth); remove them "
            f"from {field}"
        )
