"""Config of the files source: which files, in which format, with which column types.

Only pydantic and the protocol are imported here, so the connector's entry point stays cheap.
"""

from typing import Literal

import pyarrow as pa
from pydantic import Field, field_validator

from faucet_dagster.protocol import ConnectorConfig, arrow_type_from_name, lattice_type_problem

FileFormat = Literal["csv", "jsonl", "parquet"]


class CsvOptions(ConnectorConfig):
    """How CSV files are parsed (pyarrow.csv).

    Empty unquoted fields and the ``null_values`` strings are NULL; a quoted empty string ``""`` stays
    an empty string.
    """

    delimiter: str = Field(default=",", min_length=1, max_length=1)
    quote_char: str = Field(default='"', min_length=1, max_length=1)
    has_header: bool = True
    column_names: list[str] | None = Field(
        default=None, description="Column names for files without a header row (has_header: false)."
    )
    null_values: list[str] = Field(default_factory=lambda: ["", "NULL", "null"])
    encoding: str = "utf8"


class FilesSourceConfig(ConnectorConfig):
    """A files source: local paths and glob patterns read in sorted path order.

    ``paths`` are file paths or glob patterns (``**`` recurses); each must match at least one file
    when read. ``format`` is taken from the file extension when not set (``.csv``/``.tsv``,
    ``.jsonl``/``.ndjson``/``.json``, ``.parquet``/``.pq``, optionally followed by ``.gz``, ``.bz2``
    or ``.zst``). ``column_types`` fixes the Arrow type of columns by name (pyarrow type aliases such
    as ``int64``, ``string``, ``double``, ``timestamp[us]``, ``date32``); without it CSV and JSON
    types are inferred from the first block of each file. ``columns`` reads only those columns, in
    that order. ``shard_by_file`` makes every file an independent shard (a Dagster partition).
    """

    paths: list[str] = Field(min_length=1)
    format: FileFormat | None = None
    columns: list[str] | None = None
    column_types: dict[str, str] = Field(default_factory=dict)
    csv: CsvOptions = Field(default_factory=CsvOptions)
    shard_by_file: bool = False
    block_size: int = Field(default=1 << 20, ge=4096, description="Bytes parsed per read block (CSV, JSON).")

    @field_validator("column_types")
    @classmethod
    def _known_types(cls, column_types: dict[str, str]) -> dict[str, str]:
        for name, text in column_types.items():
            try:
                arrow_type(text)
            except ValueError as exc:
                raise ValueError(f"column {name!r}: {exc}") from None
        return column_types

    def arrow_types(self) -> dict[str, pa.DataType]:
        """``column_types`` as Arrow types (validated when the config was built)."""
        return {name: arrow_type(text) for name, text in self.column_types.items()}

    @field_validator("paths")
    @classmethod
    def _no_empty_paths(cls, paths: list[str]) -> list[str]:
        if any(not path.strip() for path in paths):
            raise ValueError("a path must not be empty")
        return paths


def arrow_type(text: str) -> pa.DataType:
    """The Arrow type named by ``text`` (:func:`~faucet_dagster.protocol.arrow_type_from_name`: a pyarrow
    alias, ``timestamp[us, tz=UTC]`` or ``decimal128(12, 2)``), one of the type lattice's column types.
    Raises ValueError for anything else."""
    try:
        kind = arrow_type_from_name(text)
    except (ValueError, pa.ArrowInvalid):
        raise ValueError(f"unknown Arrow type {text.strip()!r}") from None
    problem = lattice_type_problem(kind)
    if problem:
        raise ValueError(problem)
    return kind
