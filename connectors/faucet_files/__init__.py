"""faucet_files: a bounded source over local CSV, JSON Lines and Parquet files (pyarrow).

Registered as the ``files`` connector (``faucet.connectors`` entry point). Building it does no I/O;
see :mod:`faucet_files.source` for order, bookmarks, memory and errors.
"""

from typing import TYPE_CHECKING

from faucet_dagster.protocol import ConnectorRole, ConnectorSpec, Role
from faucet_files.config import CsvOptions, FilesSourceConfig

if TYPE_CHECKING:
    from faucet_files.source import FilesSource


def _source(config: FilesSourceConfig) -> "FilesSource":
    # pyarrow's csv/json/parquet modules load only when a source is built.
    from faucet_files.source import FilesSource

    return FilesSource(config)


CONNECTOR = ConnectorSpec(
    name="files",
    roles={Role.SOURCE: ConnectorRole(FilesSourceConfig, _source)},
    description="Local CSV, JSON Lines and Parquet files and globs, streamed through pyarrow.",
    docs={"readme": "connectors/faucet_files/README.md"},
)

__all__ = ["CONNECTOR", "CsvOptions", "FilesSourceConfig"]
