"""FCP check 4, idempotent replay: replaying pages leaves an atomic-watermark or keyed-upsert
destination unchanged, an idempotent write interrupted at any point stores its records and its
commit token together or neither, or the honest branch (no mechanism: effectively-once refused).
"""

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from faucet_dagster.conformance.bounded.common import REPLAY_RULE, planner_refuses, policy_of
from faucet_dagster.conformance.harness import Subject, pairs, rows_batch
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.planner import Code
from faucet_dagster.protocol import CommitToken, Delivery, FaucetError, Mode, Sink


async def idempotent_replay(subject: Subject) -> Outcome:
    """A replayed page leaves the destination unchanged (watermark, keyed upsert) or the honest branch."""
    setup = subject.sink_setup
    sink = subject.sink()
    page, later = make_rows(1, 50), make_rows(51, 30)
    done: list[str] = []
    try:
        if sink.supports_idempotent_writes():
            await _watermark_replay(subject, sink, page, later)
            done.append("atomic watermark")
    finally:
        await subject.within(sink.close(), REPLAY_RULE, "Sink.close")
    if setup.keyed_config is not None and setup.read_keyed is not None:
        keyed = subject.sink(setup.keyed_config)
        try:
            if keyed.dedups_by_key():
                await _keyed_replay(subject, keyed, page, setup.read_keyed)
                done.append("keyed upsert")
        finally:
            await subject.within(keyed.close(), REPLAY_RULE, "Sink.close")
    if done:
        return Outcome.passed(f"a replayed page changed nothing ({', '.join(done)})")
    if sink.dedups_by_key():
        raise ConformanceFailure(
            REPLAY_RULE, "dedups_by_key() is True but the setup names no keyed destination"
        )
    await planner_refuses(
        subject,
        Mode.BOUNDED,
        policy_of(sink),
        Code.EFFECTIVELY_ONCE_UNREACHABLE,
        REPLAY_RULE,
        sink_caps=sink.capabilities(),
        delivery=Delivery.EFFECTIVELY_ONCE,
    )
    return Outcome.not_applicable(
        "no atomic watermark and no keyed upsert: effectively-once is refused by the planner"
    )


async def _watermark_replay(
    subject: Subject, sink: Sink, page: list[dict[str, Any]], later: list[dict[str, Any]]
) -> None:
    read_back = subject.sink_setup.read_back
    first, second = CommitToken(1_000), CommitToken(2_000)
    written = await subject.within(sink.write_batch_idempotent(rows_batch(page), first), REPLAY_RULE, "write")
    if written != len(page):
        raise ConformanceFailure(REPLAY_RULE, f"write_batch_idempotent wrote {written} of {len(page)} rows")
    before = pairs(await read_back())
    for token in (first, CommitToken(999)):
        again = await subject.within(
            sink.write_batch_idempotent(rows_batch(page), token), REPLAY_RULE, "replay"
        )
        after = pairs(await read_back())
        if again != 0 or after != before:
            raise ConformanceFailure(
                REPLAY_RULE,
                f"replaying a page with token {token} (not newer than the watermark {first}) wrote {again} "
                f"rows and the destination went from {len(before)} to {len(after)} rows: the commit token "
                "must make the replay a no-op",
            )
    fresh = subject.sink()
    try:
        stored = await subject.within(fresh.last_committed_token(), REPLAY_RULE, "last_committed_token")
        if stored != first:
            raise ConformanceFailure(
                REPLAY_RULE, f"last_committed_token() read back {stored}, the last committed token is {first}"
            )
        await subject.within(fresh.write_batch_idempotent(rows_batch(later), second), REPLAY_RULE, "write")
    finally:
        await subject.within(fresh.close(), REPLAY_RULE, "Sink.close")
    if pairs(await read_back()) != sorted([*before, *pairs(later)]):
        raise ConformanceFailure(
            REPLAY_RULE, f"a page with the newer token {second} was not written exactly once"
        )
    await _interrupted_writes(subject, CommitToken(3_000))


_MAX_POINTS = 32
"""How many interruption points of one idempotent write the battery tries at most."""


async def _interrupted_writes(subject: Subject, first_token: CommitToken) -> None:
    """An idempotent write interrupted at each point where it waits (after 0, 1, 2... event-loop
    steps, then ever more): whatever the point, the records and the commit token are both stored or
    neither. A sink committing them in two transactions leaves records without their token when the
    interruption falls between the two, the crash a replay then duplicates.

    Counting loop steps, not time, makes the points independent of the machine's speed: a write
    advances at most one wait per step, so every wait of the write is an interruption point.
    """
    threads = _CountingExecutor()
    asyncio.get_running_loop().set_default_executor(threads)
    steps, token, point = 0, first_token.sequence, 0
    while point < _MAX_POINTS:
        point += 1
        token += 1
        page = make_rows(100_000 + point * 1_000, 5)
        sink = subject.sink()
        write = asyncio.ensure_future(sink.write_batch_idempotent(rows_batch(page), CommitToken(token)))
        for _ in range(steps):
            await asyncio.sleep(0)
        finished = write.done()
        write.cancel()
        await asyncio.wait([write], timeout=subject.options.timeout)
        if write.done() and not write.cancelled():
            write.exception()  # an interrupted write may fail: only what it left matters
        with contextlib.suppress(FaucetError):
            await subject.within(sink.close(), REPLAY_RULE, "Sink.close")
        await threads.idle(subject.options.timeout)
        landed, stored = await _settled_write(subject, page, patient=not finished)
        has_token = stored is not None and stored.sequence >= token
        if landed != has_token:
            raise ConformanceFailure(
                REPLAY_RULE,
                f"a write_batch_idempotent interrupted after {steps} event-loop step(s) left the records "
                f"{'in' if landed else 'out of'} the destination but last_committed_token() is {stored} "
                f"(the write's token is {token}): records and commit token must commit atomically, in one "
                "transaction",
            )
        if finished:
            return
        steps = steps + 1 if steps < 8 else steps * 2


class _CountingExecutor(ThreadPoolExecutor):
    """The event loop's default executor while writes are interrupted: it knows when the work a
    cancelled write handed to a thread (``asyncio.to_thread``) has finished, so the battery reads
    the destination after it, however slow the machine, instead of after a guessed delay."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._pending = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> "Future[Any]":
        with self._lock:
            self._pending += 1
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, _: "Future[Any]") -> None:
        with self._lock:
            self._pending -= 1

    async def idle(self, timeout: float) -> None:
        """Return once no submitted work is running or queued (or after ``timeout`` seconds)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._pending and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)


async def _settled_write(
    subject: Subject, page: list[dict[str, Any]], *, patient: bool
) -> tuple[bool, CommitToken | None]:
    """Whether rows of ``page`` are in the destination, and its last committed token, read so that a
    commit landing between the two reads is read again. Work a sink runs outside the loop's default
    executor may still land: a ``patient`` look (the write was interrupted) looks again after
    ``settle_seconds`` when the rows have not shown."""
    read_back = subject.sink_setup.read_back
    for look in range(2 if patient else 1):
        if look:
            await asyncio.sleep(subject.options.settle_seconds)
        while True:
            landed = bool(set(pairs(page)) & set(pairs(await read_back())))
            probe = subject.sink()
            try:
                stored = await subject.within(
                    probe.last_committed_token(), REPLAY_RULE, "last_committed_token"
                )
            finally:
                await subject.within(probe.close(), REPLAY_RULE, "Sink.close")
            if landed == bool(set(pairs(page)) & set(pairs(await read_back()))):
                break
        if landed:
            break
    return landed, stored


async def _keyed_replay(
    subject: Subject,
    sink: Sink,
    page: list[dict[str, Any]],
    read_back: Callable[[], Awaitable[list[dict[str, Any]]]],
) -> None:
    await subject.within(sink.write_batch(rows_batch(page)), REPLAY_RULE, "write_batch")
    before = pairs(await read_back())
    await subject.within(sink.write_batch(rows_batch(page)), REPLAY_RULE, "write_batch (replay)")
    after = pairs(await read_back())
    if after != before or before != pairs(page):
        raise ConformanceFailure(
            REPLAY_RULE,
            f"dedups_by_key() is True but replaying a page of {len(page)} rows took the destination from "
            f"{len(before)} to {len(after)} rows: a keyed upsert must converge",
        )
