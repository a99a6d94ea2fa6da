"""The files source's bookmark: the identity of a matched file and the parsed bookmark JSON.

The JSON shape and what resuming from it does are described in :mod:`faucet_files.source`.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from faucet_dagster.protocol import ConfigError, JsonValue
from faucet_files.config import FileFormat

BOOKMARK_VERSION = 1


@dataclass(frozen=True)
class FileEntry:
    """One matched file, with the size and modification time that identify its content."""

    path: str
    size: int
    mtime_ns: int
    format: FileFormat

    def same_content(self, identity: Sequence[int]) -> bool:
        return [self.size, self.mtime_ns] == list(identity)


@dataclass(frozen=True)
class FilesBookmark:
    """The parsed bookmark (see :mod:`faucet_files.source` for its JSON shape)."""

    completed: Mapping[str, tuple[int, int]]
    current: tuple[str, int, int, int] | None = None
    """``(path, size, mtime_ns, row)`` of the file being read, or None between files."""

    def to_json(self) -> JsonValue:
        current: JsonValue = None
        if self.current is not None:
            path, size, mtime_ns, row = self.current
            current = {"path": path, "size": size, "mtime_ns": mtime_ns, "row": row}
        return {
            "version": BOOKMARK_VERSION,
            "completed": {path: [size, mtime] for path, (size, mtime) in sorted(self.completed.items())},
            "current": current,
        }

    @classmethod
    def from_json(cls, raw: JsonValue, where: str) -> "FilesBookmark":
        """Parse a bookmark this source emitted; anything else raises ConfigError."""
        try:
            if not isinstance(raw, dict) or raw.get("version") != BOOKMARK_VERSION:
                raise ValueError(f"expected a version {BOOKMARK_VERSION} files bookmark")
            completed_raw = raw["completed"]
            if not isinstance(completed_raw, dict):
                raise ValueError("'completed' must be an object")
            completed = {path: _identity(value) for path, value in completed_raw.items()}
            current_raw = raw.get("current")
            current = None
            if current_raw is not None:
                if not isinstance(current_raw, dict):
                    raise ValueError("'current' must be an object")
                path = current_raw["path"]
                if not isinstance(path, str):
                    raise ValueError("'current.path' must be a string")
                size, mtime = _identity([current_raw["size"], current_raw["mtime_ns"]])
                row = current_raw["row"]
                if not isinstance(row, int) or isinstance(row, bool) or row < 0:
                    raise ValueError("'current.row' must be a non-negative integer")
                current = (path, size, mtime, row)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a bookmark of the files source: {exc}", where=where) from None
        return cls(completed, current)


def _identity(value: JsonValue) -> tuple[int, int]:
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(item, int) and not isinstance(item, bool) for item in value)
    ):
        size, mtime = value
        assert isinstance(size, int) and isinstance(mtime, int)
        return size, mtime
    raise ValueError(f"a file identity is [size, mtime_ns], got {value!r}")
