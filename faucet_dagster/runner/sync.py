"""The sync bridge: run a runner coroutine to completion from synchronous code (Dagster ops, sensors).

``run_sync(coro)`` blocks the calling thread until ``coro`` finishes and returns its result or raises
its exception. A thread without a running event loop runs the coroutine on a fresh loop of its own
(``asyncio.run``); a thread that already runs a loop (a notebook, an async caller) cannot block that
loop, so the coroutine runs on a fresh loop in a worker thread that this call joins. Either way the
loop is closed, with its async generators finalized, before ``run_sync`` returns.
"""

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on a loop of its own and return its result; safe with or without a running loop."""
    if not _loop_running():
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="faucet-run-sync") as pool:
        return pool.submit(asyncio.run, coro).result()


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
