"""A bounded source reading JSON Lines files in name order, one page at a time.

Bookmark: ``{"file": <name>, "line": <number>}`` of the last line delivered; a resumed read starts
after it. Memory: one page of records (``batch_size`` lines) at a time. Errors: a missing folder is a
ConfigError, an unreadable file a ConnectionFailed, a line that is not a JSON object a DataError naming
the file and line; nothing else escapes.
"""

import asyncio
import json
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

from faucet_dagster.protocol import (
    ConfigError,
    ConnectionFailed,
    ConnectorConfig,
    DataError,
    Emits,
    FetchContext,
    JsonValue,
    Operation,
    Ordering,
    Page,
    Records,
    Replay,
    Source,
    SourceCapabilities,
)


class JsonLinesConfig(ConnectorConfig):
    """``folder`` holds the files; only names ending in ``suffix`` are read."""

    folder: str
    suffix: str = ".jsonl"


class JsonLinesSource(Source):
    connector_name: ClassVar[str] = "jsonl_example"
    config_model: ClassVar[type[ConnectorConfig]] = JsonLinesConfig

    def __init__(self, config: JsonLinesConfig) -> None:
        self.config = config
        self._start: tuple[str, int] | None = None
        self._reached: tuple[str, int] | None = None

    def capabilities(self) -> SourceCapabilities:
        return SourceCapabilities(
            emits=Emits.ROWS,
            operations=frozenset({Operation.INSERT}),
            ordering=Ordering.STRICT_GLOBAL,
            replay=Replay.REPLAYABLE_AT_LEAST_ONCE,
            bounded=True,
            continuous=False,
            deterministic=True,
        )

    def dataset_uri(self) -> str:
        return f"file://{os.path.abspath(self.config.folder)}"

    def state_key(self) -> str | None:
        return self.dataset_uri()

    def bookmark(self) -> JsonValue | None:
        return None if self._reached is None else {"file": self._reached[0], "line": self._reached[1]}

    def apply_start_bookmark(self, bookmark: JsonValue) -> None:
        name = bookmark.get("file") if isinstance(bookmark, dict) else None
        line = bookmark.get("line") if isinstance(bookmark, dict) else None
        if not isinstance(name, str) or not isinstance(line, int):
            raise ConfigError("the bookmark is not one this source emitted", where=self.dataset_uri())
        self._start = self._reached = (name, line)

    async def check(self) -> None:
        await asyncio.to_thread(self._names)

    async def fetch(self, ctx: FetchContext) -> Records:
        return [record for page in [p async for p in self.stream_pages(ctx, 0)] for record in page.records]

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        if batch_size < 0:
            raise ConfigError(f"batch_size must be >= 0, got {batch_size}", where=self.dataset_uri())
        lines = self._lines()
        page: list[dict[str, Any]] = []
        while True:
            found = await asyncio.to_thread(next, lines, None)
            if found is None:
                break
            name, number, record = found
            page.append(record)
            self._reached = (name, number)
            if batch_size and len(page) == batch_size:
                yield Page(page, self.bookmark())
                page = []
        if page or batch_size == 0:
            yield Page(page, self.bookmark())

    def _names(self) -> list[str]:
        try:
            names = os.listdir(self.config.folder)
        except FileNotFoundError:
            raise ConfigError(
                f"folder {self.config.folder} does not exist", where=self.dataset_uri()
            ) from None
        except OSError as exc:
            raise ConnectionFailed(
                f"cannot list the folder: {exc.strerror}", where=self.dataset_uri()
            ) from None
        return sorted(name for name in names if name.endswith(self.config.suffix))

    def _lines(self) -> Iterator[tuple[str, int, dict[str, Any]]]:
        """Every line after the start bookmark as (file, line number, record), read lazily."""
        for name in self._names():
            if self._start is not None and name < self._start[0]:
                continue
            path = os.path.join(self.config.folder, name)
            try:
                handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed below, across yields
            except OSError as exc:
                raise ConnectionFailed(
                    f"cannot open {name}: {exc.strerror}", where=self.dataset_uri()
                ) from None
            with handle:
                for number, text in enumerate(handle, 1):
                    if self._start is not None and (name, number) <= self._start:
                        continue
                    if not text.strip():
                        continue
                    try:
                        record = json.loads(text)
                    except ValueError:
                        record = None
                    if not isinstance(record, dict):
                        raise DataError("the line is not a JSON object", where=f"{path}:{number}")
                    yield name, number, record
