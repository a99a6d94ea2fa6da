"""The worker process's side: a connector under test, driven by the battery over a pipe.

The battery runs every connector call of a scenario in a worker process (:mod:`.workers`), so a
crash is a real one (SIGKILL: no ``finally``, no ``close``, no process-wide cache surviving it) and a
second process can read what the first left behind. The worker builds the connector from its spec
and config, keeps what the calls return (sessions, connectors) under numbered handles, and answers
each request with a picklable :class:`Reply`. A request may arm a crash at an effect
(:mod:`.effects`); the reply then never comes.

Everything here runs in the child; nothing in it talks to the battery's model or oracle.
"""

import asyncio
import contextlib
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import pyarrow as pa

from faucet_dagster.conformance.harness import ProbeSinkSession, Tap
from faucet_dagster.conformance.scenarios.effects import EffectCounter
from faucet_dagster.pipeline import Pipeline, ResourceSchema
from faucet_dagster.protocol import (
    CancelToken,
    ConnectorSpec,
    Control,
    Coverage,
    EpochId,
    FaucetError,
    OwnershipLost,
    Position,
    ReadLimits,
    Role,
    Sink,
    Source,
    StreamingSink,
    StreamingSinkSession,
    StreamSession,
    StreamSource,
)


@dataclass(frozen=True)
class AgentPlan:
    """What a worker process is: the connector's spec in one role, and the effects it counts
    (``None``: no crash can be armed, and no call is profiled)."""

    spec: ConnectorSpec
    role: Role
    effects: frozenset[str] | None = None


@dataclass(frozen=True)
class Handle:
    """An object kept in the worker (a connector, a session), named by number."""

    number: int
    kind: str


@dataclass(frozen=True)
class RemoteError:
    """An exception raised in the worker: its class and base classes by name, and its message."""

    names: tuple[str, ...]
    message: str
    detail: str = ""

    @classmethod
    def of(cls, exc: BaseException) -> "RemoteError":
        names = tuple(kind.__name__ for kind in type(exc).__mro__)
        text = exc.message if isinstance(exc, FaucetError) else str(exc)
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return cls(names, text, detail)

    def is_a(self, *kinds: type[BaseException]) -> bool:
        return any(kind.__name__ in self.names for kind in kinds)

    @property
    def faucet(self) -> bool:
        return "FaucetError" in self.names

    @property
    def kind(self) -> str:
        return self.names[0]

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass(frozen=True)
class Reply:
    """The answer to one request: its value or its error, and the effects made meanwhile."""

    value: Any = None
    error: RemoteError | None = None
    effects: tuple[str, ...] = ()


@dataclass(frozen=True)
class Event:
    """One row a read delivered and the pipeline certified at the battery's probe."""

    domain: Any  # OrderingDomain
    position: str
    ordinal: int
    resource: str
    row: Mapping[str, Any]


@dataclass(frozen=True)
class EpochRead:
    """What one epoch of a stream source did: the coverage sealed (empty: nothing certified), the
    events the pipeline handed the probe, the controls in order, and whether it was interrupted."""

    coverage: Coverage
    events: tuple[Event, ...]
    controls: tuple[Control, ...]
    interrupted: bool = False


@dataclass(frozen=True)
class PageSeen:
    """One page of a bounded read: its rows and its bookmark."""

    rows: tuple[Mapping[str, Any], ...]
    bookmark: Any


@dataclass(frozen=True)
class Acknowledged:
    """An acknowledgement: how often it asked the authority, and its error (None: it returned)."""

    asked: int
    error: RemoteError | None


@dataclass
class _Held:
    """A stream session with the pipeline that keeps its resources' schemas across epochs."""

    session: StreamSession
    pipeline: Pipeline = field(default_factory=lambda: Pipeline(default_schema=ResourceSchema()))


class _Agent:
    def __init__(self, plan: AgentPlan) -> None:
        self.spec = plan.spec
        self.role = plan.role
        self.objects: dict[int, Any] = {}

    def keep(self, value: Any) -> Any:
        kinds = (Source, Sink, StreamSource, StreamingSink, StreamingSinkSession, StreamSession)
        if not isinstance(value, kinds):
            return value
        number = len(self.objects) + 1
        self.objects[number] = _Held(value) if isinstance(value, StreamSession) else value
        return Handle(number, type(value).__name__)

    def get(self, handle: Handle) -> Any:
        held = self.objects[handle.number]
        return held.session if isinstance(held, _Held) else held

    async def build(self, config: Mapping[str, Any]) -> Any:
        return self.keep(self.spec.build(self.role, dict(config)))

    async def call(self, handle: Handle, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        target = self.get(handle)
        result = getattr(target, method)(*args, **kwargs)
        if isinstance(result, Awaitable):
            result = await result
        return self.keep(result)

    async def attribute(self, handle: Handle, name: str) -> Any:
        return getattr(self.get(handle), name)

    async def read_epoch(
        self,
        handle: Handle,
        epoch: EpochId,
        certified: tuple[Position, ...],
        limits: ReadLimits,
        cancel_after_writes: int | None,
    ) -> EpochRead:
        """One epoch as the runner runs it, at the battery's probe: begin, read, seal, commit."""
        held = self.objects[handle.number]
        assert isinstance(held, _Held)
        probe = ProbeSinkSession()
        await probe.begin_epoch(epoch)
        pipeline = held.pipeline.begin(epoch, probe, certified)
        cancel = CancelToken()

        async def written(rows: int) -> None:
            writes.count += 1
            if cancel_after_writes is not None and writes.count >= cancel_after_writes:
                cancel.cancel()

        writes = _Count()
        tap = Tap(pipeline, written)
        try:
            coverage = await held.session.read(tap, limits, cancel)
            if cancel.cancelled:
                if not coverage.empty:
                    await pipeline.seal(coverage)
                await pipeline.discard()
                await probe.abort_epoch(epoch)
                return EpochRead(Coverage(), (), tuple(tap.controls), interrupted=True)
            if coverage.empty and not pipeline.has_evidence:
                await probe.abort_epoch(epoch)
                return EpochRead(coverage, (), tuple(tap.controls))
            sealed = await pipeline.seal(coverage)
        except BaseException:
            await pipeline.discard()
            await probe.abort_epoch(epoch)
            raise
        await probe.commit_epoch(epoch, sealed.coverage)
        events = tuple(
            Event(
                batch.domain,
                batch.identities.positions[index],
                0 if batch.identities.ordinals is None else batch.identities.ordinals[index],
                batch.resource,
                row,
            )
            for batch in probe.committed
            for index, row in enumerate(_rows(batch.records))
        )
        return EpochRead(sealed.coverage, events, tuple(tap.controls))

    async def acknowledge(self, handle: Handle, coverage: Coverage, lost: bool) -> Acknowledged:
        asked = _Count()

        async def authority() -> None:
            asked.count += 1
            if lost:
                raise OwnershipLost("the conformance battery gave the stream to a newer worker")

        try:
            await self.get(handle).acknowledge(coverage, authority)
        except FaucetError as exc:
            return Acknowledged(asked.count, RemoteError.of(exc))
        return Acknowledged(asked.count, None)

    async def pages(self, handle: Handle, batch_size: int, take: int | None) -> tuple[PageSeen, ...]:
        """A bounded read of ``handle`` (a Source): its pages, stopping after ``take`` of them (the
        runner gave up there: the rest are not delivered), then the source is closed."""
        source = self.get(handle)
        seen: list[PageSeen] = []
        try:
            stream = source.stream_pages({}, batch_size)
            try:
                async for page in stream:
                    records = page.records
                    rows = (
                        _rows(records) if isinstance(records, pa.RecordBatch) else [dict(r) for r in records]
                    )
                    seen.append(PageSeen(tuple(rows), page.bookmark))
                    if take is not None and len(seen) >= take:
                        break
            finally:
                await stream.aclose()
        finally:
            await source.close()
        return tuple(seen)


class _Count:
    count = 0


def _rows(records: pa.RecordBatch) -> list[dict[str, Any]]:
    return [dict(row) for row in records.to_pylist()]


_OPERATIONS: Mapping[str, Callable[..., Awaitable[Any]]] = {
    "build": _Agent.build,
    "call": _Agent.call,
    "attribute": _Agent.attribute,
    "read_epoch": _Agent.read_epoch,
    "acknowledge": _Agent.acknowledge,
    "pages": _Agent.pages,
}


def serve(conn: Connection, plan: AgentPlan) -> None:
    """The worker process's main: answer requests ``(operation, args, crash_at)`` until the pipe closes."""
    counter: EffectCounter | None = None
    if plan.effects is not None:
        counter = EffectCounter(plan.effects)
        counter.install()
    asyncio.run(_serve(conn, plan, counter))


async def _serve(conn: Connection, plan: AgentPlan, counter: EffectCounter | None) -> None:
    loop = asyncio.get_running_loop()
    pipe = ThreadPoolExecutor(1, thread_name_prefix="battery-pipe")
    try:
        agent = _Agent(plan)
    except Exception as exc:  # noqa: BLE001 - sent to the battery, which judges it
        conn.send(Reply(error=RemoteError.of(exc)))
        return
    conn.send(Reply(value="ready"))
    while True:
        try:
            operation, args, crash_at = await loop.run_in_executor(pipe, conn.recv)
        except (EOFError, OSError):
            break
        if counter is not None:
            counter.arm(crash_at)
        try:
            value = await _OPERATIONS[operation](agent, *args)
            reply = Reply(value=value)
        except BaseException as exc:  # noqa: BLE001 - every failure, cancellations too, is the battery's to judge
            reply = Reply(error=RemoteError.of(exc))
        effects = counter.disarm() if counter is not None else ()
        with contextlib.suppress(BrokenPipeError):
            try:
                conn.send(Reply(reply.value, reply.error, effects))
            except (TypeError, AttributeError, ValueError) as exc:  # the value does not pickle
                conn.send(Reply(error=RemoteError.of(exc), effects=effects))
    pipe.shutdown(wait=False)


__all__ = [
    "Acknowledged",
    "AgentPlan",
    "EpochRead",
    "Event",
    "Handle",
    "PageSeen",
    "RemoteError",
    "Reply",
    "serve",
]
