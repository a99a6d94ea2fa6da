"""The config of the Delta Lake streaming sink. Only pydantic and the protocol are imported here."""

from typing import Self

from pydantic import Field, model_validator

from faucet_dagster.protocol import ConnectorConfig
from faucet_delta.config import DeltaSinkConfig, S3Storage


class DeltaStreamingSinkConfig(ConnectorConfig):
    """Where a continuous stream's epochs land: one Delta table, one Delta commit per epoch.

    Every resource of the stream lands in the table at ``uri`` (one table keeps an epoch one commit).
    The write policy (append or upsert) and the key come from the stream, not from here.
    ``schema_evolution`` merges a column the table lacks into its schema; off, it raises SchemaError.
    ``partition_by`` partitions a table this sink creates. ``app_id`` prefixes the transaction
    identifiers the stream's commits carry (default: ``faucet:<table folder>``): ``<app_id>:epoch:<stream>``
    (the epoch), ``<app_id>:owner:<stream>`` (the owner's fencing token) and one per integer-ordered
    domain, ``<app_id>:watermark:<stream>@<source>/<resource>/<partition>`` (its watermark).
    ``uri`` and ``s3`` locate the table as for the bounded sink (:class:`DeltaSinkConfig`): a local
    folder, or ``s3://bucket/path`` with the store's endpoint and credentials in ``s3``.
    """

    uri: str = Field(
        min_length=1, description="The table's folder: a local path, a file:// URI or s3://bucket/path."
    )
    schema_evolution: bool = True
    partition_by: list[str] = Field(default_factory=list)
    app_id: str | None = Field(default=None, min_length=1)
    s3: S3Storage | None = None

    @model_validator(mode="after")
    def _valid_table(self) -> Self:
        self.table()  # the bounded sink's rules on the table's location and partitions
        return self

    def table(self) -> DeltaSinkConfig:
        """The table as the bounded sink configures it (append mode: the location's rules and
        helpers are the bounded sink's)."""
        return DeltaSinkConfig(
            uri=self.uri,
            schema_evolution=self.schema_evolution,
            partition_by=list(self.partition_by),
            app_id=self.app_id,
            s3=self.s3,
        )


__all__ = ["DeltaStreamingSinkConfig"]
