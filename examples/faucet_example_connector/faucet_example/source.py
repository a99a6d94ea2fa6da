"""A bounded source reading JSON Lines files in name order, one page at a time.

Bookmark: ``{"done": [<names of the files read to their end>], "file": <name>, "line": <number>}``:
the files completed, and the last line delivered of the file being read. A resumed read skips the
completed files and the delivered lines, and reads every other file, whatever its name: a file that
appears later with a name sorting before the ones read is read too (a bookmark that kept only the
last name would skip it). Memory: one page of records (``batch_size`` lines) at a time. Errors: a
missing folder is a ConfigError, an unreadable file a ConnectionFailed, a line that is not a JSON
object a DataError naming the file and line; nothing else escapes.
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
        self._done: frozenset[str] = frozenset()
        self._start: tuple[str, int] | None = None
        self._reached: tuple[str, int] | None = None
        self._completed: set[str] = set()

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
        if self._reached is None and not self._completed:
            return None
        file, line = self._reached if self._reached is not None else (None, 0)
        return {"done": sorted(self._completed), "file": file, "line": line}

    def apply_start_bookmark(self, bookmark: JsonValue) -> None:
        raw = bookmark if isinstance(bookmark, dict) else {}
        done, name, line = raw.get("done"), raw.get("file"), raw.get("line")
        if (
            not isinstance(done, list)
            or not all(isinstance(item, str) for item in done)
            or not (name is None or isinstance(name, str))
            or not isinstance(line, int)
        ):
            raise ConfigError("the bookmark is not one this source emitted", where=self.dataset_uri())
        self._done = frozenset(str(item) for item in done)
        self._completed = set(self._done)
        self._start = self._reached = None if name is None else (name, line)

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
            if record is None:  # the end of a file: it is read to its end
                self._completed.add(name)
                self._reached = None
                continue
            page.append(record)
            self._reached = (name, number)
            if batch_size and len(page) == batch_size:
                yield Page(page, self.bookmark())
                page = []
        if page or batch_size == 0 or self._completed != set(self._done):
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

    def _lines(self) -> Iterator[tuple[str, int, dict[str, Any] | None]]:
        """Every line after the start bookmark as (file, line number, record), read lazily; each
        file ends with (file, 0, None)."""
        for name in self._names():
            if name in self._done:
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
                    if self._start is not None and name == self._start[0] and number <= self._start[1]:
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
            yield name, 0, None
