"""The fault worker: one real pipeline in a process the controller can kill, stop or signal.

``python -m faucet_dagster.testing.faults.worker`` reads a :class:`~.spec.WorkerSpec` (JSON) on stdin
(or from the file named by its only argument), writes :class:`~.spec.Event` lines on stdout, and
exits with one of the codes of :mod:`.spec`.

Continuous specs drive :class:`~faucet_dagster.runner.continuous.StreamRunner`, the runner the
sensor uses, epoch after epoch (pipelined: the next epoch read while the last commits), with the state
store of ``state_url``: what the sensor's reader does, minus Dagster. Bounded specs run
:func:`~faucet_dagster.runner.bounded.run_bounded_sync` once from the bookmark and commit token in
``bookmark_file`` and persist the new ones there after the connectors closed, as the bounded assets
do with Dagster's run storage.

The connectors are the registered ones, built from the spec's configs. Two thin wrappers add fault
points without changing behaviour: every streaming sink session marks ``after_apply``,
``during_sink_commit`` and ``during_sink_close``, and PostgreSQL sinks open their connections through
:func:`pointed_connect`, whose cursors mark ``during_copy`` and ``after_copy``. A fault is armed only
through the environment (:mod:`.points`): the controller sets it for the process it means to break.
"""

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from faucet_postgres.common import connect
from faucet_postgres.config import PostgresConnection, PostgresSinkConfig, PostgresStreamingSinkConfig
from faucet_postgres.sink import PostgresSink
from faucet_postgres.stream_sink import PostgresStreamingSink
from psycopg import AsyncCopy
from psycopg.abc import Params, Query
from psycopg.copy import AsyncWriter

from faucet_dagster.pipeline import PipelineOptions
from faucet_dagster.protocol import (
    CommitToken,
    ConnectionFailed,
    Coverage,
    EpochCertificate,
    EpochId,
    ErrorKind,
    FaucetError,
    JsonValue,
    Position,
    ReadLimits,
    Receipt,
    Sink,
    SinkBatch,
    SinkCapabilities,
    SinkCommitState,
    StreamingSink,
    StreamingSinkSession,
    WorkerIdentity,
    WritePolicy,
    default_codec_registry,
    get_connector,
)
from faucet_dagster.runner.bounded import run_bounded_sync
from faucet_dagster.runner.bounded_values import PageReport, SyncSettings
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.runner.faults import InjectedFailure, Point, fault_point
from faucet_dagster.runner.members import MemberWorker
from faucet_dagster.state import StateStore
from faucet_dagster.testing.faults.spec import (
    EXIT_DEADLINE,
    EXIT_DONE,
    EXIT_HALTED,
    Event,
    EventName,
    Target,
    WorkerSpec,
)

STEP_SECONDS = 2.0
"""The budget of one ``run_epochs`` call of a continuous worker (the events follow each call)."""

# -- fault points in the sinks -------------------------------------------------------------------


class PointedCursor(psycopg.AsyncCursor[Any]):
    """A psycopg cursor whose COPY marks ``during_copy`` once the server is in COPY and ``after_copy``
    once it finished (its transaction still open)."""

    @asynccontextmanager
    async def copy(
        self, statement: Query, params: Params | None = None, *, writer: AsyncWriter | None = None
    ) -> AsyncIterator[AsyncCopy]:
        async with super().copy(statement, params, writer=writer) as copy:
            fault_point(Point.DURING_COPY)
            yield copy
        fault_point(Point.AFTER_COPY)


async def pointed_connect(
    config: PostgresConnection, *, autocommit: bool = False, settings: Mapping[str, str] | None = None
) -> psycopg.AsyncConnection[Any]:
    """:func:`faucet_postgres.common.connect`, with :class:`PointedCursor` as the cursor class."""
    conn = await connect(config, autocommit=autocommit, settings=settings)
    conn.cursor_factory = PointedCursor
    return conn


class PointedSinkSession(StreamingSinkSession):
    """A streaming sink session passed through, marking ``after_apply`` and ``during_sink_close``."""

    def __init__(self, inner: StreamingSinkSession) -> None:
        self._inner = inner

    async def last_committed(self) -> SinkCommitState | None:
        return await self._inner.last_committed()

    async def begin_epoch(self, epoch: EpochId) -> None:
        await self._inner.begin_epoch(epoch)

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        await self._inner.apply(epoch, batch)
        fault_point(Point.AFTER_APPLY)

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        try:
            fault_point(Point.DURING_SINK_COMMIT)
        except InjectedFailure as exc:
            raise ConnectionFailed(f"the destination refused the commit of {epoch}", where="fault") from exc
        return await self._inner.commit_epoch(epoch, coverage)

    async def abort_epoch(self, epoch: EpochId) -> None:
        await self._inner.abort_epoch(epoch)

    async def close_session(self) -> None:
        closing = asyncio.ensure_future(self._inner.close_session())
        await asyncio.sleep(0)  # the close runs up to its first wait on the destination
        fault_point(Point.DURING_SINK_CLOSE)
        await closing


class PointedSink(StreamingSink):
    """A streaming sink whose sessions are :class:`PointedSinkSession`."""

    def __init__(self, inner: StreamingSink) -> None:
        self._inner = inner
        self.connector_name = inner.connector_name

    def capabilities(self) -> SinkCapabilities:
        return self._inner.capabilities()

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> StreamingSinkSession:
        return PointedSinkSession(await self._inner.open(stream, policy, key, worker))


def streaming_sink(spec: WorkerSpec) -> StreamingSink:
    """The spec's streaming sink, with fault points (PostgreSQL through :func:`pointed_connect`)."""
    if spec.sink.connector == "postgres":
        config = PostgresStreamingSinkConfig.parse(spec.sink.config)
        return PointedSink(PostgresStreamingSink(config, connect=pointed_connect))
    return PointedSink(get_connector(spec.sink.connector).streaming_sink(spec.sink.config))


def bounded_sink(spec: WorkerSpec) -> Sink:
    """The spec's bounded sink (PostgreSQL through :func:`pointed_connect`)."""
    if spec.sink.connector == "postgres":
        return PostgresSink(PostgresSinkConfig.parse(spec.sink.config), connect=pointed_connect)
    return get_connector(spec.sink.connector).sink(spec.sink.config)


# -- the worker ------------------------------------------------------------------------------------


class Events:
    """Writes events as JSON lines on stdout, each flushed at once (a kill loses none written)."""

    def emit(self, name: EventName, **data: Any) -> None:
        sys.stdout.write(Event(name, data).to_line() + "\n")
        sys.stdout.flush()


class StopRequest:
    """A clean stop, asked for by SIGTERM or by the spec: set once, then every callback runs."""

    def __init__(self, events: Events) -> None:
        self._events = events
        self.requested = False
        self._callbacks: list[Callable[[], None]] = []

    def on_request(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def request(self) -> None:
        if self.requested:
            return
        self._events.emit("stopping")
        self.requested = True
        for callback in self._callbacks:
            callback()


def describe(exc: FaucetError) -> dict[str, Any]:
    return {"kind": exc.kind.value, "type": type(exc).__name__, "message": str(exc)}


async def retried(exc: FaucetError, spec: WorkerSpec, events: Events) -> bool:
    """True, after a pause, when ``exc`` is what a sensor's next tick would try again (a retryable
    error; a lease held by another worker, or lost, while the spec retries ownership); False, the
    error reported, when it halts the stream."""
    if exc.retryable or (exc.kind is ErrorKind.OWNERSHIP_LOST and spec.retry_ownership):
        events.emit("retry", **describe(exc))
        await asyncio.sleep(spec.retry_pause)
        return True
    events.emit("error", **describe(exc))
    return False


def reached(positions: Sequence[Position], targets: Sequence[Target]) -> bool:
    """True when the certified ``positions`` are at or past every target (never for no targets)."""
    if not targets:
        return False
    codecs = default_codec_registry()
    for target in targets:
        found = [
            p
            for p in positions
            if (p.domain.resource, p.domain.partition) == (target.resource, target.partition)
        ]
        if not found:
            return False
        codec = codecs.get(found[0].domain.codec)
        if codec.compare(codec.validate(found[0].value), codec.validate(target.position)) < 0:
            return False
    return True


def stream_spec(spec: WorkerSpec) -> StreamSpec:
    return StreamSpec(
        name=spec.stream,
        source=get_connector(spec.source.connector).stream_source(spec.source.config),
        sink=streaming_sink(spec),
        resources=spec.resources,
        policy=WritePolicy(spec.policy),
        limits=ReadLimits(records=spec.epoch_records, idle=spec.epoch_idle, age=spec.epoch_age),
        lease_seconds=spec.lease_seconds,
        pipeline=PipelineOptions(batch_rows=spec.batch_rows),
    )


class _Epochs:
    """What the continuous loop drives: one stream's runner, or a member of a divided stream."""

    def __init__(self, spec: WorkerSpec, store: StateStore) -> None:
        stream = stream_spec(spec)
        self._pipelined = spec.pipelined
        self._driver: MemberWorker | StreamRunner = (
            MemberWorker(stream, store, groups=spec.groups, worker_id=spec.worker_id)
            if spec.groups
            else StreamRunner(stream, store, worker_id=spec.worker_id)
        )

    def cancel(self) -> None:
        self._driver.cancel()

    async def step(self, on_certified: Callable[[EpochCertificate], None]) -> None:
        """Epochs for a few seconds, pipelined as under a sensor, or one epoch (a stream), or one
        round of every group held (a member); ``on_certified`` is called with each certificate as
        soon as its epoch is acknowledged."""
        driver = self._driver
        if isinstance(driver, MemberWorker):
            certificates = await driver.run_round()
        elif self._pipelined:
            await driver.run_epochs(STEP_SECONDS, on_certified=on_certified)
            return
        else:
            certificates = [c for c in [await driver.run_epoch()] if c is not None]
        for certificate in certificates:
            on_certified(certificate)

    async def close(self) -> None:
        await self._driver.close()


async def run_continuous(spec: WorkerSpec, events: Events, stop: StopRequest) -> int:
    """Epochs until the targets are certified, a clean stop, a halt, or the deadline (see module); a
    member of a stream divided into ``spec.groups`` groups runs rounds, a ``certified`` event per
    certificate naming its group stream, until a clean stop, a halt or the deadline."""
    store = StateStore(spec.state_url)
    epochs = _Epochs(spec, store)
    stop.on_request(epochs.cancel)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + spec.deadline_seconds
    code = EXIT_DONE
    certified = 0

    def on_certified(certificate: EpochCertificate) -> None:
        nonlocal certified
        certified += 1
        events.emit(
            "certified",
            stream=certificate.stream,
            sequence=certificate.sequence,
            rows=sum(certificate.row_counts.values()),
            fencing_token=certificate.fencing_token,
        )
        if spec.stop_after_epochs is not None and certified == spec.stop_after_epochs:
            loop.call_later(spec.stop_delay, stop.request)

    try:
        while not stop.requested:
            if loop.time() >= deadline:
                events.emit("deadline", certified=certified)
                code = EXIT_DEADLINE
                break
            try:
                await epochs.step(on_certified)
            except FaucetError as exc:
                if await retried(exc, spec, events):
                    continue
                code = EXIT_HALTED
                break
            # Checked after an epoch ran, so even a worker with nothing left opens its sessions (and
            # halts on a source that changed under the certified positions).
            if spec.targets and reached(
                await asyncio.to_thread(store.certified_positions, spec.stream), spec.targets
            ):
                events.emit("done", certified=certified)
                break
        try:
            await epochs.close()
        except FaucetError as exc:
            events.emit("error", during="close", **describe(exc))
            code = EXIT_HALTED
    finally:
        store.close()
    if stop.requested and code == EXIT_DONE:
        events.emit("stopped", certified=certified)
    return code


@dataclass(frozen=True)
class RunStorage:
    """What a finished bounded sync persisted: its bookmark and commit token (Dagster's run storage)."""

    bookmark: JsonValue | None = None
    commit_token: CommitToken | None = None

    @classmethod
    def read(cls, path: str) -> "RunStorage":
        file = Path(path)
        if not file.exists():
            return cls()
        raw = json.loads(file.read_text())
        token = raw.get("commit_token")
        return cls(raw.get("bookmark"), None if token is None else CommitToken.parse(token))

    def write(self, path: str) -> None:
        """Replace the file atomically and durably (a crash leaves the old or the new one)."""
        file = Path(path)
        temporary = file.with_suffix(".tmp")
        token = None if self.commit_token is None else str(self.commit_token)
        with temporary.open("w", encoding="utf-8") as out:
            json.dump({"bookmark": self.bookmark, "commit_token": token}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, file)
        directory = os.open(file.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


class _StopRequested(Exception):
    """A clean stop asked for during a bounded sync: it ends after the page in hand."""


async def _close_sink(sink: Sink) -> None:
    fault_point(Point.DURING_SINK_CLOSE)
    await sink.close()


async def run_bounded(spec: WorkerSpec, events: Events, stop: StopRequest) -> int:
    """One bounded sync from the stored bookmark, retried while it fails retryably (see module)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + spec.deadline_seconds

    def on_page(report: PageReport) -> None:
        events.emit(
            "page",
            number=report.number,
            rows=report.rows_read,
            written=report.rows_written,
            skipped=report.rows_skipped,
        )
        fault_point(Point.AFTER_PAGE)
        if stop.requested:
            raise _StopRequested

    while not stop.requested:
        if loop.time() >= deadline:
            events.emit("deadline")
            return EXIT_DEADLINE
        stored = RunStorage.read(spec.bookmark_file)
        try:
            async with AsyncExitStack() as stack:
                source = get_connector(spec.source.connector).source(spec.source.config)
                stack.push_async_callback(source.close)
                sink = bounded_sink(spec)
                stack.push_async_callback(_close_sink, sink)
                result = await run_bounded_sync(
                    source,
                    sink,
                    SyncSettings(batch_size=spec.batch_size),
                    start_bookmark=stored.bookmark,
                    last_token=stored.commit_token,
                    on_page=on_page,
                )
        except _StopRequested:
            break
        except FaucetError as exc:
            if await retried(exc, spec, events):
                continue
            return EXIT_HALTED
        await asyncio.to_thread(RunStorage(result.bookmark, result.commit_token).write, spec.bookmark_file)
        events.emit(
            "synced",
            rows_read=result.rows_read,
            rows_written=result.rows_written,
            rows_skipped=result.rows_skipped,
        )
        fault_point(Point.AFTER_BOOKMARK)
        events.emit("done")
        return EXIT_DONE
    events.emit("stopped")
    return EXIT_DONE


async def run(spec: WorkerSpec) -> int:
    """Run ``spec``'s pipeline; SIGTERM asks for a clean stop from the moment ``started`` is written."""
    events = Events()
    stop = StopRequest(events)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.request)
    events.emit("started", pid=os.getpid(), worker=spec.worker_id)
    if spec.mode == "continuous":
        return await run_continuous(spec, events, stop)
    return await run_bounded(spec, events, stop)


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    text = Path(args[0]).read_text() if args else sys.stdin.read()
    code = asyncio.run(run(WorkerSpec.from_json(text)))
    # The work is over: a SIGTERM arriving now (the loop's handler is gone) must not change the code.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
