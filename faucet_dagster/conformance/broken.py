"""Deliberately broken connectors: each wraps (or subclasses) a real connector and breaks one rule.

They exist for the battery's self-test (:mod:`.selftest`): every check must catch its broken
connector, with a failure that names the rule. Anything not named in a class's docstring behaves
exactly as the real connector. Only the self-test imports this module (it loads the connectors).
"""

import asyncio
import ctypes
import glob
import os
import time
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

import pyarrow as pa
import pyarrow.compute as pc
from faucet_files.config import FilesSourceConfig
from faucet_files.source import FilesSource

__all__ = ["FilesSource"]
from faucet_sql.sink import SqlSink
from pydantic import model_validator

from faucet_dagster.protocol import (
    AddColumn,
    Authority,
    CancelToken,
    CommitToken,
    ConfigError,
    ConnectionFailed,
    ConnectorRole,
    ConnectorSpec,
    Control,
    Coverage,
    DataError,
    DiscoveredDataset,
    DomainCoverage,
    EpochId,
    FaucetError,
    FetchContext,
    Identities,
    JsonValue,
    Membership,
    OrderingDomain,
    Page,
    Position,
    PositionCodec,
    PositionUnavailable,
    ProgressBoundary,
    ReadLimits,
    Receipt,
    Records,
    RejectedRecord,
    Role,
    SinkBatch,
    SinkCapabilities,
    SinkCommitState,
    SourceCapabilities,
    StreamingSink,
    StreamingSinkSession,
    StreamRecordSink,
    StreamSession,
    StreamSource,
    TransactionBegin,
    TransactionEnd,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
    get_connector,
)


def spec_with(
    name: str, role: Role, build: Callable[[Any], object], config_model: Any = None
) -> ConnectorSpec:
    """Connector ``name`` with its ``role`` built by ``build(config)`` (the real config model)."""
    real = get_connector(name).roles[role]
    return ConnectorSpec(name, {role: ConnectorRole(config_model or real.config_model, build)})


def wrapping(name: str, role: Role, wrap: Callable[[Any], object]) -> ConnectorSpec:
    """Connector ``name`` whose ``role`` is the real connector wrapped by ``wrap``."""
    real = get_connector(name).roles[role]
    return spec_with(name, role, lambda config: wrap(real.factory(config)))


# -- bounded sources (files) --------------------------------------------------------------------------


class InvalidSchemaSource(FilesSource):
    """Check 1: its config schema is not a JSON Schema (an unknown type name)."""

    @classmethod
    def config_schema(cls) -> dict[str, Any]:
        return {"type": "objekt", "properties": {"paths": {"type": "array"}}}


class RenamedFieldSchemaSource(FilesSource):
    """Check 1: a valid JSON Schema that still names a field the config no longer has (``path``,
    renamed ``paths`` in the model), so a config the connector accepts does not validate."""

    @classmethod
    def config_schema(cls) -> dict[str, Any]:
        schema = super().config_schema()
        properties = dict(schema.get("properties", {}))
        properties["path"] = properties.pop("paths", {"type": "array"})
        return {**schema, "properties": properties, "required": ["path"]}


class OversizedPagesSource(FilesSource):
    """Check 2: pages twice as large as ``batch_size``."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        async for page in super().stream_pages(ctx, batch_size * 2):
            yield page


class BufferingSource(FilesSource):
    """Check 2: reads the whole dataset into memory, then hands it out in pages of ``batch_size``."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        whole = [page async for page in super().stream_pages(ctx, 0)]
        for page in whole:
            records = page.records
            assert isinstance(records, pa.RecordBatch)
            step = batch_size or records.num_rows
            for start in range(0, records.num_rows, step):
                yield Page(records.slice(start, step), page.bookmark)


class NativeBufferingSource(FilesSource):
    """Check 2: copies every matched file into native memory (malloc'd, as a client library's result
    buffer would be: neither the Python heap nor the Arrow pool) before paging through them."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        names = sorted(name for pattern in self.config.paths for name in glob.glob(pattern))
        data = b"".join(open(name, "rb").read() for name in names)  # noqa: SIM115 - a test double
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        buffer = libc.malloc(max(1, len(data)))
        ctypes.memmove(buffer, data, len(data))
        del data
        try:
            async for page in super().stream_pages(ctx, batch_size):
                yield page
        finally:
            libc.free(ctypes.c_void_p(buffer))


_HOLD_FILES = """
import sys
held = [open(name, "rb").read() for name in sys.argv[1:]]
print(sum(map(len, held)), flush=True)
sys.stdin.read()
"""


class ChildBufferingSource(FilesSource):
    """Check 2: its "driver" runs in a helper process that loads every matched file into its own
    memory before the pages are handed out (a client-side cursor in a driver's process): neither
    this process's heaps nor its C allocator see it, the helper's resident memory does."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        import sys

        names = sorted(name for pattern in self.config.paths for name in glob.glob(pattern))
        helper = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _HOLD_FILES, *names,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert helper.stdout is not None
            await helper.stdout.readline()  # the helper holds every file now
            async for page in super().stream_pages(ctx, batch_size):
                yield page
        finally:
            helper.kill()
            await helper.wait()


class ForgetfulSource(FilesSource):
    """Check 3: ignores the bookmark it is handed (a resumed run starts from the beginning)."""

    def apply_start_bookmark(self, bookmark: JsonValue) -> None:
        return None


class LaggingBookmarkSource(FilesSource):
    """Check 3: each page carries the bookmark of the page before it (the bookmark is taken before
    the page is read, not after), so a resumed run reads the last page again."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        previous: JsonValue = None
        async for page in super().stream_pages(ctx, batch_size):
            yield Page(page.records, previous if previous is not None else page.bookmark)
            previous = page.bookmark


class EmptyDiscoverySource(FilesSource):
    """Check 5: claims ``discover`` but finds nothing."""

    async def discover(self) -> Sequence[DiscoveredDataset]:
        return []


class StrictConfig(FilesSourceConfig):
    """Check 6: a config whose validator indexes the raw data, raising KeyError for a missing key."""

    @model_validator(mode="before")
    @classmethod
    def _paths_first(cls, data: Any) -> Any:
        data["paths"] = list(data["paths"])
        return data


class HangingSource(FilesSource):
    """Check 6: when its files cannot be reached it retries forever instead of failing."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        try:
            async for page in super().stream_pages(ctx, batch_size):
                yield page
        except ConfigError:
            await asyncio.Event().wait()


class LeakySource(FilesSource):
    """Check 6: a malformed record escapes as a ValueError instead of a DataError."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        try:
            async for page in super().stream_pages(ctx, batch_size):
                yield page
        except DataError as exc:
            raise ValueError(exc.message) from None


class RawCheckSource(FilesSource):
    """Check 6: its preflight ``check()`` lets the file system's OSError escape."""

    async def check(self) -> None:
        for pattern in self.config.paths:
            folder = os.path.dirname(pattern)
            await asyncio.to_thread(os.listdir, folder)  # FileNotFoundError when it is missing


class RawShardsSource(FilesSource):
    """Check 6: ``enumerate_shards()`` lists the folder itself and leaks its FileNotFoundError."""

    async def enumerate_shards(self) -> Sequence[str]:
        found: list[str] = []
        for pattern in self.config.paths:
            folder = os.path.dirname(pattern)
            names = sorted(await asyncio.to_thread(os.listdir, folder))
            found.extend(os.path.join(folder, name) for name in names if name.endswith(".csv"))
        return found


class RawCaptureSource(FilesSource):
    """Check 6: declares ``capture_resume_position()`` and leaks an OSError from it."""

    async def capture_resume_position(self) -> JsonValue | None:
        newest = 0.0
        for pattern in self.config.paths:
            folder = os.path.dirname(pattern)
            newest = max(newest, await asyncio.to_thread(os.path.getmtime, folder))
        return {"newest": newest}


class EmptyIsAnErrorSource(FilesSource):
    """Check 6: an empty dataset raises instead of giving an empty result."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        rows = 0
        async for page in super().stream_pages(ctx, batch_size):
            rows += page.num_rows
            yield page
        if not rows:
            raise DataError("no rows", where=self.dataset_uri())


# -- bounded sinks (sql) ------------------------------------------------------------------------------


class TokenBlindSink(SqlSink):
    """Check 4: its idempotent write ignores the commit token (a replayed page is written again)."""

    async def write_batch_idempotent(self, records: pa.RecordBatch, token: CommitToken) -> int:
        written = await self.write_batch(records)
        await super().write_batch_idempotent(records.slice(0, 0), token)  # the token still moves
        return written


class TwoTransactionSink(SqlSink):
    """Check 4: honours the token, but commits the records, then the token in a second transaction
    (an interruption between the two leaves records a replay writes again)."""

    async def write_batch_idempotent(self, records: pa.RecordBatch, token: CommitToken) -> int:
        stored = await self.last_committed_token()
        if stored is not None and token.sequence <= stored.sequence:
            return 0
        written = await self.write_batch(records)
        await super().write_batch_idempotent(records.slice(0, 0), token)
        return written


class AppendingUpsertSink(SqlSink):
    """Check 4: configured to upsert by key, it appends (and still says it dedups by key)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.mode = WritePolicy.APPEND

    def dedups_by_key(self) -> bool:
        return bool(self.config.key)


class ModeBlindDedupSink(SqlSink):
    """Check 5: ``dedups_by_key()`` looks at the key only (an append with a key configured claims it)."""

    def dedups_by_key(self) -> bool:
        return bool(self.config.key)


class FirstConfigDedupSink(SqlSink):
    """Check 5: ``dedups_by_key()`` answers what the first sink built said (cached on the class), not
    what this sink's live config says."""

    answer: bool | None = None

    def dedups_by_key(self) -> bool:
        if FirstConfigDedupSink.answer is None:
            FirstConfigDedupSink.answer = super().dedups_by_key()
        return FirstConfigDedupSink.answer


class NoEvolutionSink(SqlSink):
    """Check 5: claims schema evolution but ``evolve_schema`` does nothing."""

    async def evolve_schema(self, changes: Sequence[AddColumn]) -> None:
        return None


# -- stream sources -----------------------------------------------------------------------------------


class WrappedSession(StreamSession):
    """A session forwarding everything to the real one; subclasses break one method. ``worker`` is
    the identity the session was opened with."""

    def __init__(self, inner: StreamSession, opened: int, worker: WorkerIdentity) -> None:
        self.inner = inner
        self.opened = opened
        self.worker = worker

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        return await self.inner.read(sink, limits, cancel)

    async def acknowledge(self, coverage: Coverage, authority: Authority) -> None:
        await self.inner.acknowledge(coverage, authority)

    async def close(self) -> None:
        await self.inner.close()

    @property
    def exhausted(self) -> bool:
        return self.inner.exhausted


class WrappedSource(StreamSource):
    """A stream source whose sessions are wrapped in ``session_type`` (counting opens from 1)."""

    def __init__(self, inner: StreamSource, session_type: type[WrappedSession]) -> None:
        self.inner = inner
        self.session_type = session_type
        self.connector_name = inner.connector_name

    def capabilities(self) -> SourceCapabilities:
        return self.inner.capabilities()

    def codecs(self) -> Sequence[PositionCodec[Any]]:
        return self.inner.codecs()

    async def open(
        self,
        resources: Sequence[str],
        resume_positions: Sequence[Position],
        membership: Membership,
        worker: WorkerIdentity,
    ) -> StreamSession:
        inner = await self.inner.open(resources, resume_positions, membership, worker)
        return self.session_type(inner, _next_open(), worker)


class LatestWhenUnavailableSource(WrappedSource):
    """Unavailable position: when its resume position is gone, starts over from what the provider
    still has (the "latest available" fallback)."""

    async def open(
        self,
        resources: Sequence[str],
        resume_positions: Sequence[Position],
        membership: Membership,
        worker: WorkerIdentity,
    ) -> StreamSession:
        try:
            return await super().open(resources, resume_positions, membership, worker)
        except PositionUnavailable:
            return await super().open(resources, (), membership, worker)


class SlotPositionSource(WrappedSource):
    """Unavailable position (PostgreSQL CDC): when the slot was moved past the certified position,
    resumes where the slot now is (its ``confirmed_flush_lsn``: the "latest available" of a slot)."""

    def __init__(self, inner: StreamSource, url: str, slot: str) -> None:
        super().__init__(inner, WrappedSession)
        self.url = url
        self.slot = slot

    async def open(
        self,
        resources: Sequence[str],
        resume_positions: Sequence[Position],
        membership: Membership,
        worker: WorkerIdentity,
    ) -> StreamSession:
        try:
            return await super().open(resources, resume_positions, membership, worker)
        except PositionUnavailable:
            import psycopg
            from faucet_postgres.cdc_server import CODEC

            async with await psycopg.AsyncConnection.connect(self.url) as conn:
                cursor = await conn.execute(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                    (self.slot,),
                )
                row = await cursor.fetchone()
            assert row is not None
            now = CODEC.canonicalize(CODEC.validate(row[0]) - 1)
            moved = [Position(position.domain, now) for position in resume_positions]
            return await super().open(resources, moved, membership, worker)


def slot_position_source() -> ConnectorSpec:
    real = get_connector("postgres").roles[Role.STREAM_SOURCE]
    return spec_with(
        "postgres",
        Role.STREAM_SOURCE,
        lambda config: SlotPositionSource(cast(StreamSource, real.factory(config)), config.url, config.slot),
    )


_OPENED = [0]


def _next_open() -> int:
    """A number per session opened: what an attempt-based identity would be built from."""
    _OPENED[0] += 1
    return _OPENED[0]


class ForwardingSink(StreamRecordSink):
    """Forwards a read's writes and controls to the pipeline; subclasses change one thing."""

    def __init__(self, inner: StreamRecordSink) -> None:
        self.inner = inner

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        await self.inner.write(domain, rows, identities, resource=resource)

    async def control(self, control: Control) -> None:
        await self.inner.control(control)

    async def reject(self, record: RejectedRecord) -> None:
        await self.inner.reject(record)


class ImpatientSession(WrappedSession):
    """Slow sink: gives up when the pipeline blocks it longer than 0.3 s."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        return await asyncio.wait_for(self.inner.read(sink, limits, cancel), 0.3)


class LoopBlockingSession(WrappedSession):
    """Slow sink: waits out its sink's backpressure with a blocking sleep in line with the read (the
    keep-alive replaced by a sleep), so nothing renews the deliveries meanwhile."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        class Blocking(ForwardingSink):
            async def write(
                self,
                domain: OrderingDomain,
                rows: Records,
                identities: Identities,
                *,
                resource: str | None = None,
            ) -> None:
                time.sleep(2.5)  # the defect under test: the loop stalls
                await self.inner.write(domain, rows, identities, resource=resource)

        return await self.inner.read(Blocking(sink), limits, cancel)


class DeafSession(WrappedSession):
    """Cancellation: never hears the runner's cancel token."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        return await self.inner.read(sink, limits, CancelToken())


class CancelIsAnErrorSession(WrappedSession):
    """Cancellation: reports a cancelled read as a failure (raises) instead of returning the coverage
    of the boundaries it had reached."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        coverage = await self.inner.read(sink, limits, cancel)
        if cancel.cancelled:
            raise ConnectionFailed("the read was cancelled", where="CancelIsAnErrorSession")
        return coverage


class LimitCutSession(WrappedSession):
    """Partial transaction: treats the record limit as the place to stop, inside a transaction too:
    after ``limits.records`` rows it declares a progress boundary at the last row and stops."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        stop = CancelToken()
        cut: list[DomainCoverage] = []
        budget = limits.records

        class Limiter(ForwardingSink):
            written = 0

            async def write(
                self,
                domain: OrderingDomain,
                rows: Records,
                identities: Identities,
                *,
                resource: str | None = None,
            ) -> None:
                if cut:
                    return
                await self.inner.write(domain, rows, identities, resource=resource)
                self.written += len(identities)
                if budget is not None and self.written >= budget:
                    last = identities.positions[-1]
                    cut.append(DomainCoverage(domain, None, last))
                    stop.cancel()
                    await self.inner.control(ProgressBoundary(domain, last))

            async def control(self, control: Control) -> None:
                if not cut:
                    await self.inner.control(control)

        async def relay() -> None:
            await cancel.wait()
            stop.cancel()

        relaying = asyncio.ensure_future(relay())
        try:
            coverage = await self.inner.read(Limiter(sink), limits, stop)
        finally:
            relaying.cancel()
        return Coverage(tuple(cut)) if cut else coverage


class CutTransactionSession(WrappedSession):
    """Partial transaction: stops inside a source transaction and covers its rows anyway."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        stop = CancelToken()
        cut: list[DomainCoverage] = []

        class Cutter(ForwardingSink):
            inside = False

            async def write(
                self,
                domain: OrderingDomain,
                rows: Records,
                identities: Identities,
                *,
                resource: str | None = None,
            ) -> None:
                await self.inner.write(domain, rows, identities, resource=resource)
                if self.inside and not cut:
                    cut.append(DomainCoverage(domain, None, identities.positions[-1]))
                    stop.cancel()

            async def control(self, control: Control) -> None:
                if not cut:
                    await self.inner.control(control)
                    self.inside = isinstance(control, TransactionBegin) or (
                        self.inside and not isinstance(control, TransactionEnd)
                    )

        coverage = await self.inner.read(Cutter(sink), limits, stop)
        return Coverage(tuple(cut)) if cut else coverage


class UnaskingSession(WrappedSession):
    """Ownership: acknowledges without asking the authority."""

    async def acknowledge(self, coverage: Coverage, authority: Authority) -> None:
        async def always() -> None:
            return None

        await self.inner.acknowledge(coverage, always)


class AskOnceSession(WrappedSession):
    """Ownership: asks the authority on the session's first successful acknowledgement only, and
    trusts that answer afterwards."""

    trusted = False

    async def acknowledge(self, coverage: Coverage, authority: Authority) -> None:
        if not self.trusted:
            await authority()
            self.trusted = True

        async def remembered() -> None:
            return None

        await self.inner.acknowledge(coverage, remembered)


class SpeculativeSession(WrappedSession):
    """Speculative acknowledgement: acknowledges what a read covered before returning it."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        coverage = await self.inner.read(sink, limits, cancel)
        if not coverage.empty:
            await self.inner.acknowledge(coverage, _no_authority)
        return coverage


class AckOnCloseSession(WrappedSession):
    """Speculative acknowledgement: acknowledges everything it read when the session closes (a
    "commit on close" consumer), certified or not."""

    read_so_far: list[Coverage]

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        coverage = await self.inner.read(sink, limits, cancel)
        if not coverage.empty:
            self.__dict__.setdefault("read_so_far", []).append(coverage)
        return coverage

    async def close(self) -> None:
        for coverage in self.__dict__.get("read_so_far", []):
            await self.inner.acknowledge(coverage, _no_authority)
        await self.inner.close()


async def _no_authority() -> None:
    """What a careless session passes on instead of the runner's authority: asks nobody."""


class DroppingSession(WrappedSession):
    """Unwritten position: drops the row with id 5 on its way to the pipeline, and covers it anyway."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        class Dropper(ForwardingSink):
            async def write(
                self,
                domain: OrderingDomain,
                rows: Records,
                identities: Identities,
                *,
                resource: str | None = None,
            ) -> None:
                assert isinstance(rows, pa.RecordBatch)
                keep = pc.not_equal(rows.column("id"), 5)
                kept = [p for p, k in zip(identities.positions, keep.to_pylist(), strict=True) if k]
                await self.inner.write(domain, rows.filter(keep), Identities(kept), resource=resource)

        return await self.inner.read(Dropper(sink), limits, cancel)


class LateRowSession(WrappedSession):
    """Unwritten position (an ordering bug): the last row written before a progress boundary
    reaches the sink only after that boundary, which already vouched for its position."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        held: list[tuple[OrderingDomain, pa.RecordBatch, Identities, str | None]] = []

        class Reorder(ForwardingSink):
            async def release(self) -> None:
                while held:
                    domain, rows, identities, resource = held.pop()
                    await self.inner.write(domain, rows, identities, resource=resource)

            async def write(
                self,
                domain: OrderingDomain,
                rows: Records,
                identities: Identities,
                *,
                resource: str | None = None,
            ) -> None:
                assert isinstance(rows, pa.RecordBatch)
                await self.release()
                last = rows.num_rows - 1
                positions, ordinals = list(identities.positions), identities.ordinals
                head = Identities(positions[:last], None if ordinals is None else list(ordinals[:last]))
                tail = Identities(positions[last:], None if ordinals is None else list(ordinals[last:]))
                if last > 0:
                    await self.inner.write(domain, rows.slice(0, last), head, resource=resource)
                held.append((domain, rows.slice(last), tail, resource))

            async def control(self, control: Control) -> None:
                await self.inner.control(control)
                await self.release()

        return await self.inner.read(Reorder(sink), limits, cancel)


class OverreachingSession(WrappedSession):
    """Unwritten position: covers one stream sequence past the last row it delivered (the stream's
    "last sequence" taken as the read's end), a position whose row never reached the sink."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        coverage = await self.inner.read(sink, limits, cancel)
        return Coverage(
            tuple(
                DomainCoverage(item.domain, item.start, str(int(item.end) + 1)) for item in coverage.domains
            )
        )


class RenumberingSession(WrappedSession):
    """Replay: gives each event the ordinals :meth:`ordinals` makes (subclasses build them from what
    a careless author would: the attempt, the worker, the lease), not from the source alone."""

    def ordinals(self, identities: Identities) -> list[int]:
        raise NotImplementedError

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        session = self

        class Renumber(ForwardingSink):
            async def write(
                self,
                domain: OrderingDomain,
                rows: Records,
                identities: Identities,
                *,
                resource: str | None = None,
            ) -> None:
                renumbered = Identities(identities.positions, session.ordinals(identities))
                await self.inner.write(domain, rows, renumbered, resource=resource)

        return await self.inner.read(Renumber(sink), limits, cancel)


class ReidentifyingSession(RenumberingSession):
    """Replay: numbers its events by the session (an attempt), not by the source position alone."""

    def ordinals(self, identities: Identities) -> list[int]:
        return [self.opened] * len(identities)


class WorkerIdentitySession(RenumberingSession):
    """Replay: gives each event an ordinal made from the worker id (a replay by another worker looks
    like new events)."""

    def ordinals(self, identities: Identities) -> list[int]:
        return [zlib.crc32(self.worker.worker_id.encode()) % 1_000] * len(identities)


class LeaseIdentitySession(RenumberingSession):
    """Replay: numbers the events of a position from the fencing token of the lease it holds."""

    def ordinals(self, identities: Identities) -> list[int]:
        base = [0] * len(identities) if identities.ordinals is None else list(identities.ordinals)
        return [self.worker.fencing_token * 1_000 + ordinal for ordinal in base]


def stream_source(name: str, session_type: type[WrappedSession]) -> ConnectorSpec:
    return wrapping(name, Role.STREAM_SOURCE, lambda inner: WrappedSource(inner, session_type))


# -- streaming sinks ----------------------------------------------------------------------------------


class WrappedSinkSession(StreamingSinkSession):
    """A sink session forwarding everything to the real one; subclasses break one method."""

    def __init__(self, inner: StreamingSinkSession, opened: int, worker: WorkerIdentity) -> None:
        self.inner = inner
        self.opened = opened
        self.worker = worker
        self.active: EpochId | None = None
        self.background: list[asyncio.Task[Any]] = []

    async def last_committed(self) -> SinkCommitState | None:
        return await self.inner.last_committed()

    async def begin_epoch(self, epoch: EpochId) -> None:
        await self.inner.begin_epoch(epoch)
        self.active = epoch

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        await self.inner.apply(epoch, batch)

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        receipts = await self.inner.commit_epoch(epoch, coverage)
        self.active = None
        return receipts

    async def abort_epoch(self, epoch: EpochId) -> None:
        await self.inner.abort_epoch(epoch)
        self.active = None

    async def close_session(self) -> None:
        await self.inner.close_session()


class WrappedStreamingSink(StreamingSink):
    """A streaming sink whose sessions are wrapped in ``session_type``; ``claims`` overrides
    capability fields."""

    def __init__(
        self,
        inner: StreamingSink,
        session_type: type[WrappedSinkSession],
        claims: dict[str, Any] | None = None,
    ) -> None:
        self.inner = inner
        self.session_type = session_type
        self.claims = claims or {}
        self.connector_name = inner.connector_name

    def capabilities(self) -> SinkCapabilities:
        from dataclasses import replace

        return replace(self.inner.capabilities(), **self.claims)

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> StreamingSinkSession:
        return self.session_type(await self.inner.open(stream, policy, key, worker), _next_open(), worker)


class SwallowingSession(WrappedSinkSession):
    """Failed writes: a commit whose writes were refused reports success with no receipts."""

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        try:
            return await super().commit_epoch(epoch, coverage)
        except FaucetError:
            return ()


class DroppingRefusedSession(WrappedSinkSession):
    """Failed writes: drops the rows the destination would refuse (a name over 1 KiB) before
    applying the batch, and commits the epoch as if they were written."""

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        records = batch.records
        assert isinstance(records, pa.RecordBatch)
        keep = pc.less_equal(pc.utf8_length(records.column("name")), 512)
        kept = [p for p, k in zip(batch.identities.positions, keep.to_pylist(), strict=True) if k]
        ordinals = batch.identities.ordinals
        kept_ordinals = (
            None if ordinals is None else [o for o, k in zip(ordinals, keep.to_pylist(), strict=True) if k]
        )
        await self.inner.apply(
            epoch,
            SinkBatch(
                batch.epoch,
                batch.resource,
                batch.domain,
                records.filter(keep),
                Identities(kept, kept_ordinals),
            ),
        )


class StaleWatermarkSession(WrappedSinkSession):
    """Uncertain commit: ``last_committed()`` answers from a cache the first answer filled (a lagging
    replica), so after a commit whose answer was lost it reports what was committed before."""

    cached: list[SinkCommitState | None] = []

    async def last_committed(self) -> SinkCommitState | None:
        if not StaleWatermarkSession.cached:
            StaleWatermarkSession.cached.append(await self.inner.last_committed())
        return StaleWatermarkSession.cached[0]


class RebeginSession(WrappedSinkSession):
    """Lifecycle: ``begin_epoch`` while an epoch is active aborts that one and begins the new one."""

    async def begin_epoch(self, epoch: EpochId) -> None:
        if self.active is not None:
            await self.inner.abort_epoch(self.active)
        await super().begin_epoch(epoch)


class LateCommitSession(WrappedSinkSession):
    """Uncertain commit: a commit the caller gives up on goes on in the background, and
    ``close_session`` returns at once, leaving it (and the real close) to finish later."""

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        async def later() -> tuple[Receipt, ...]:
            await asyncio.sleep(0.05)
            return await self.inner.commit_epoch(epoch, coverage)

        task = asyncio.ensure_future(later())
        self.background.append(task)
        return await asyncio.shield(task)

    async def close_session(self) -> None:
        pending = list(self.background)

        async def close_later() -> None:
            await asyncio.gather(*pending, return_exceptions=True)
            await self.inner.close_session()

        self.background.append(asyncio.ensure_future(close_later()))
        _KEEP.extend(self.background)


class LenientSession(WrappedSinkSession):
    """Lifecycle: an apply outside an epoch is accepted, in an epoch of its own that it commits."""

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        if self.active is None:
            await self.inner.begin_epoch(epoch)
            await self.inner.apply(epoch, batch)
            await self.inner.commit_epoch(epoch, Coverage())
            return
        await self.inner.apply(epoch, batch)


class EagerCloseSession(WrappedSinkSession):
    """Shutdown: ``close_session`` returns at once and commits the outstanding epoch afterwards."""

    async def close_session(self) -> None:
        active = self.active

        async def finish() -> None:
            await asyncio.sleep(0.05)
            if active is not None:
                await self.inner.commit_epoch(active, Coverage())
            await self.inner.close_session()

        _KEEP.append(asyncio.ensure_future(finish()))


class ConfidentCloseSession(WrappedSinkSession):
    """Shutdown: reports a successful close when the real session says the shutdown is uncertain
    (it "only" released its client, with requests still unanswered)."""

    async def close_session(self) -> None:
        try:
            await self.inner.close_session()
        except UncertainOutcome:
            return


class FinishTheBatchSession(WrappedSinkSession):
    """Shutdown: a cancelled apply finishes its batch anyway (shielded from the cancellation) and
    returns as if nothing happened, the way a client library that swallows cancellations does."""

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        sending = asyncio.ensure_future(self.inner.apply(epoch, batch))
        try:
            await asyncio.shield(sending)
        except asyncio.CancelledError:
            await sending


class AttemptIdentitySession(WrappedSinkSession):
    """Replay: gives each row an identity made from the session (the attempt), not the source."""

    def ordinal(self) -> int:
        return self.opened

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        renumbered = Identities(batch.identities.positions, [self.ordinal()] * len(batch.identities))
        await self.inner.apply(
            epoch, SinkBatch(batch.epoch, batch.resource, batch.domain, batch.records, renumbered)
        )


class TokenIdentitySession(AttemptIdentitySession):
    """Replay: gives each row an identity made from the fencing token of the worker's lease."""

    def ordinal(self) -> int:
        return self.worker.fencing_token


def reset() -> None:
    """Forget what broken connectors remembered across instances (before each self-test case)."""
    FirstConfigDedupSink.answer = None
    StaleWatermarkSession.cached.clear()


_KEEP: list[asyncio.Task[Any]] = []
"""Background tasks of the broken sessions, kept referenced until their loop ends."""


def streaming_sink(
    name: str, session_type: type[WrappedSinkSession], claims: dict[str, Any] | None = None
) -> ConnectorSpec:
    return wrapping(
        name, Role.STREAMING_SINK, lambda inner: WrappedStreamingSink(inner, session_type, claims)
    )
