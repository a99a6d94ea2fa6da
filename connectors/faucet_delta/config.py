"""The config of the Delta Lake sink. Only pydantic and the protocol are imported here.

A Delta table is a folder (``uri``): Parquet files and the ``_delta_log`` of its commits. This sink
writes local tables (a path, or a ``file://`` URI); object stores (``s3://``, ``az://``, ``gs://``) are
refused at config time until their credentials go through ``auth`` as elsewhere.
"""

from pathlib import Path
from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from faucet_dagster.protocol import ConnectorConfig, check_write_key

DeltaWriteMode = Literal["append", "upsert", "replace"]


class DeltaSinkConfig(ConnectorConfig):
    """A Delta table written by ``mode``: append (with the commit token as the table's transaction
    identifier), upsert (MERGE by ``key``) or replace (one overwrite commit at the end of the run).

    ``schema_evolution`` merges a column the table lacks into its schema (Delta's schema merge; for
    replace, the new snapshot's schema replaces the table's); off, such a column raises SchemaError.
    ``partition_by`` partitions a table this sink creates. ``app_id`` names this sync's transaction
    identifier in the table's log (default: ``faucet:<table folder>``).
    """

    uri: str = Field(min_length=1, description="The table's folder: a local path or a file:// URI.")
    mode: DeltaWriteMode = "append"
    key: list[str] = Field(default_factory=list)
    schema_evolution: bool = True
    partition_by: list[str] = Field(default_factory=list)
    app_id: str | None = Field(default=None, min_length=1)

    @field_validator("uri")
    @classmethod
    def _local(cls, uri: str) -> str:
        parts = urlsplit(uri)
        if parts.scheme and parts.scheme != "file" and len(parts.scheme) > 1:  # "C:" is a drive
            raise ValueError(
                f"{parts.scheme}:// tables are not supported yet: use a local path (object stores "
                "need their credentials in auth, which this sink does not take yet)"
            )
        return uri

    @model_validator(mode="after")
    def _key_for_upsert(self) -> Self:
        check_write_key(self.mode, self.key)
        if any(not column for column in self.partition_by):
            raise ValueError("partition columns must not be empty")
        return self

    def path(self) -> Path:
        """The table's folder, absolute."""
        parts = urlsplit(self.uri)
        return Path(parts.path if parts.scheme == "file" else self.uri).expanduser().absolute()

    def transaction_app_id(self) -> str:
        return self.app_id if self.app_id is not None else f"faucet:{self.path().name}"


__all__ = ["DeltaSinkConfig", "DeltaWriteMode"]
