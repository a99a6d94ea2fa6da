"""What the targets share: a port nothing listens on, setup run from synchronous code, the rows a
destination of the battery refuses, a server process stopped for a while.
"""

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any, TypeVar

from faucet_dagster.protocol import WritePolicy

T = TypeVar("T")

NAME_LIMIT = 40
"""The destinations the battery writes to refuse a ``name`` longer than this (a row-level refusal)."""


def closed_port() -> int:
    """A loopback TCP port nothing listens on (it was free a moment ago)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def run_setup(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run setup work from a synchronous factory (pytest fixtures and the CLI call them outside a loop)."""
    return asyncio.run(factory())


def refused_rows() -> list[dict[str, Any]]:
    return [{"id": 900_001, "name": "fits"}, {"id": 900_002, "name": "x" * (NAME_LIMIT * 50)}]


def unreachable_url() -> str:
    return f"postgresql://conformance@127.0.0.1:{closed_port()}/conformance"


def with_mode(config: Mapping[str, Any]) -> Callable[[WritePolicy, tuple[str, ...]], dict[str, Any]]:
    """``configure`` of a sink whose config has ``mode`` and ``key`` fields."""

    def configure(policy: WritePolicy, key: tuple[str, ...]) -> dict[str, Any]:
        return {**config, "mode": policy.value, "key": list(key)}

    return configure


@contextlib.asynccontextmanager
async def process_stopped(pid: int | None) -> AsyncIterator[None]:
    """The server process ``pid`` stopped (SIGSTOP) inside the context, continued (SIGCONT) on exit."""
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
