"""The documented seam for checking a variant of a connector: its sessions wrapped, one method changed.

A connector that builds its sessions inside ``open()`` (as the shipped PostgreSQL and NATS streaming
sinks do, preparing private state on the way) cannot be subclassed to change one session method
without copying that private code. Wrap its sessions instead: subclass :class:`WrappedSinkSession`
(or :class:`WrappedSession` for a stream source), override the one method, and build the spec with
:func:`wrap_sessions`; everything you do not override is forwarded to the real session::

    from faucet_dagster.conformance.seams import WrappedSinkSession, wrap_sessions
    from faucet_dagster.protocol import Role


    class CountingSession(WrappedSinkSession):
        commits = 0

        async def commit_epoch(self, epoch, coverage):
            CountingSession.commits += 1
            return await super().commit_epoch(epoch, coverage)


    SPEC = wrap_sessions("postgres", Role.STREAMING_SINK, CountingSession)

``SPEC`` runs through ``conformance_tests(streaming_sink=SPEC, config=...)`` or the checks directly.
The battery sends specs to worker processes, so the session classes must be module-level classes
(a spec built this way pickles by reference). The deliberately broken connectors of
:mod:`faucet_dagster.conformance.broken` are built this way.
"""

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from faucet_dagster.protocol import (
    Authority,
    CancelToken,
    ConnectorRole,
    ConnectorSpec,
    Coverage,
    EpochId,
    Membership,
    Position,
    PositionCodec,
    ReadLimits,
    Receipt,
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
    WorkerIdentity,
    WritePolicy,
    get_connector,
)


@functools.cache
def _installed_role(name: str, role: Role) -> ConnectorRole:
    return get_connector(name).roles[role]


def real_role(base: "ConnectorSpec | str", role: Role) -> ConnectorRole:
    """``base``'s ``role``: a spec's own, or an installed connector's (looked up once per process)."""
    return _installed_role(base, role) if isinstance(base, str) else base.roles[role]


def spec_with(
    base: "ConnectorSpec | str", role: Role, build: Callable[[Any], object], config_model: Any = None
) -> ConnectorSpec:
    """Connector ``base`` with its ``role`` built by ``build(config)`` (the real config model)."""
    name = base if isinstance(base, str) else base.name
    return ConnectorSpec(
        name, {role: ConnectorRole(config_model or real_role(base, role).config_model, build)}
    )


@dataclass(frozen=True)
class Wrap:
    """A factory: the real connector ``base`` in ``role``, built from the config, then wrapped as
    ``wrapper(inner, *args)`` (``wrapper`` a module-level class or function, so it pickles)."""

    base: "ConnectorSpec | str"
    role: Role
    wrapper: Callable[..., object]
    args: tuple[Any, ...] = ()

    def __call__(self, config: Any) -> object:
        return self.wrapper(real_role(self.base, self.role).factory(config), *self.args)


def wrapping(
    base: "ConnectorSpec | str", role: Role, wrapper: Callable[..., object], *args: Any
) -> ConnectorSpec:
    """Connector ``base`` whose ``role`` is the real connector wrapped by ``wrapper(inner, *args)``."""
    return spec_with(base, role, Wrap(base, role, wrapper, args))


_OPENED = [0]


def _next_open() -> int:
    """A number per session opened in this process."""
    _OPENED[0] += 1
    return _OPENED[0]


class WrappedSinkSession(StreamingSinkSession):
    """A sink session forwarding everything to the real one; subclasses break one method."""

    def __init__(
        self,
        inner: StreamingSinkSession,
        opened: int,
        worker: WorkerIdentity,
        policy: WritePolicy = WritePolicy.APPEND,
    ) -> None:
        self.inner = inner
        self.opened = opened
        self.worker = worker
        self.policy = policy
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

        return replace(self.inner.capabilities(), **self.claims)

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> StreamingSinkSession:
        inner = await self.inner.open(self.destination_stream(stream), policy, key, worker)
        return self.session_type(inner, _next_open(), worker, policy)

    def destination_stream(self, stream: str) -> str:
        """The stream name the real sink is opened with (subclasses break it)."""
        return stream


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


def wrap_sessions(
    base: "ConnectorSpec | str",
    role: Role,
    session_type: "type[WrappedSinkSession] | type[WrappedSession]",
    claims: dict[str, Any] | None = None,
) -> ConnectorSpec:
    """Connector ``base`` (an installed name or a spec) in ``role`` (a streaming sink or a stream
    source), its sessions wrapped in ``session_type``; ``claims`` replaces capability fields."""
    if role is Role.STREAMING_SINK:
        return wrapping(base, role, WrappedStreamingSink, session_type, claims)
    if role is Role.STREAM_SOURCE:
        return wrapping(base, role, WrappedSource, session_type)
    raise ValueError(f"sessions are wrapped for streaming sinks and stream sources, not {role.value}")


__all__ = [
    "Wrap",
    "WrappedSession",
    "WrappedSinkSession",
    "WrappedSource",
    "WrappedStreamingSink",
    "real_role",
    "spec_with",
    "wrap_sessions",
    "wrapping",
]
