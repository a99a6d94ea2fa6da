"""The FCP checks, numbered as the FCP numbers them (seed 004, section 7).

1. :func:`config_schema`: the config schema is a valid JSON Schema that the setup's config satisfies;
2. :func:`bounded_memory`: pages never exceed ``batch_size``, ``batch_size == 0`` is one page, and a
   paging source holds far less than the dataset at once;
3. :func:`resume`: a run started from a bookmark replays nothing committed and skips nothing;
4. :func:`idempotent_replay`: replaying pages leaves an atomic-watermark or keyed-upsert destination
   unchanged, or the honest branch (no mechanism, effectively-once refused);
5. :func:`capabilities`: each capability claimed works, each one denied is refused by the planner
   (planning the capabilities of the connector built from the spec under test);
6. :func:`no_panic`: bad config, an unreachable endpoint, a malformed record and an empty dataset end
   in a FaucetError (an empty result for the empty dataset) within the timeout.

Each check is a coroutine taking a :class:`~faucet_dagster.conformance.harness.Subject`; it returns an
:class:`Outcome` or raises :class:`ConformanceFailure` naming the rule broken.
"""

import asyncio
import contextlib
import ctypes
import functools
import json
import threading
import tracemalloc
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import jsonschema
import pyarrow as pa

from faucet_dagster.conformance.harness import (
    DOMAIN,
    STREAM,
    WORKER,
    StreamDriver,
    Subject,
    covering,
    ids_of,
    open_sink_session,
    pairs,
    quietly_close,
    rows_batch,
    sink_batch,
)
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.planner import Code, plan
from faucet_dagster.protocol import (
    AddColumn,
    CommitToken,
    Coverage,
    Delivery,
    Durability,
    Emits,
    EpochId,
    FaucetError,
    Mode,
    Operation,
    Ordering,
    OwnershipLost,
    Page,
    PlanError,
    ReadLimits,
    Replay,
    Role,
    SchemaError,
    Sink,
    SinkCapabilities,
    Source,
    SourceCapabilities,
    UnsupportedOperation,
    WritePolicy,
    default_codec_registry,
)

SCHEMA_RULE = "FCP 3 config schema (check 1)"
MEMORY_RULE = "FCP 2.2 bounded memory (check 2)"
RESUME_RULE = "FCP 2.5 resume from the bookmark (check 3)"
REPLAY_RULE = "FCP 3.1 idempotent replay (check 4)"
CAPABILITY_RULE = "FCP 2.4/3.3 truthful capabilities (check 5)"
PANIC_RULE = "FCP 2.1/4 no panic (check 6)"

QUIET = ReadLimits(records=None, bytes=None, idle=0.5, age=None)
"""Read limits for draining a stream source: end a read after half a second with nothing new."""

# -- check 1 ------------------------------------------------------------------------------------------


async def config_schema(subject: Subject) -> Outcome:
    """The role's config schema is a valid JSON Schema of an object, and the setup's config is valid."""
    built = subject.build()
    if isinstance(built, Source | Sink):
        schema = built.config_schema()
    else:
        schema = subject.spec.roles[subject.role].config_model.json_schema()
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(part) for part in exc.path) or "<root>"
        raise ConformanceFailure(
            SCHEMA_RULE, f"the config schema is not a valid JSON Schema at {where}: {exc.message}"
        ) from None
    if schema.get("type") != "object":
        raise ConformanceFailure(
            SCHEMA_RULE, f"the config schema describes a {schema.get('type')!r}, not an object"
        )
    config = json.loads(json.dumps(subject.setup.config, default=str))
    errors = sorted(validator(schema).iter_errors(config), key=lambda error: error.json_path)
    if errors:
        raise ConformanceFailure(
            SCHEMA_RULE,
            f"a config the connector accepts does not validate against its schema: {errors[0].json_path}: "
            f"{errors[0].message}",
        )
    return Outcome.passed(f"{validator.__name__} schema with {len(schema.get('properties', {}))} properties")


# -- check 2 ------------------------------------------------------------------------------------------


async def read_all(subject: Subject, source: Source, batch_size: int, rule: str) -> list[Page]:
    """Every page of one read (held: for checks whose datasets are small)."""

    async def collect() -> list[Page]:
        return [page async for page in source.stream_pages({}, batch_size)]

    try:
        return await subject.within(collect(), rule, f"stream_pages(batch_size={batch_size})")
    finally:
        await subject.within(source.close(), rule, "Source.close")


_WIDTH = 2_000
"""Characters per name in check 2: large rows make the dataset (6 MB at 3 000 rows) stand out from
what a client holds whatever the dataset (librdkafka's fetch buffers hold about 1 MB)."""


async def bounded_memory(subject: Subject) -> Outcome:
    """Pages of at most ``batch_size`` rows; one page for 0; far less held than the whole dataset."""
    rows, size = subject.options.dataset_rows, subject.options.batch_size
    # The rows stay referenced while memory is measured: a setup's thread releasing its copy of them
    # at some later moment must not look like (or hide) memory the source holds.
    added = make_rows(1, rows, width=_WIDTH)
    await subject.source_setup.add_rows(added)
    expected = list(range(1, rows + 1))
    whole = await read_all(subject, subject.source(), 0, MEMORY_RULE)
    if len(whole) != 1:
        raise ConformanceFailure(
            MEMORY_RULE, f"batch_size 0 must give exactly one page, it gave {len(whole)}"
        )
    if sorted(ids_of(whole[0].records)) != expected:
        raise ConformanceFailure(MEMORY_RULE, f"the one page of batch_size 0 does not hold the {rows} rows")
    del whole
    pages = await read_all(subject, subject.source(), size, MEMORY_RULE)
    for number, page in enumerate(pages, 1):
        if page.num_rows > size:
            raise ConformanceFailure(
                MEMORY_RULE, f"page {number} holds {page.num_rows} rows, more than batch_size {size}"
            )
    got = sorted(i for page in pages for i in ids_of(page.records))
    if got != expected:
        raise ConformanceFailure(MEMORY_RULE, f"paging lost or duplicated rows: {len(got)} read of {rows}")
    dataset = sum(_nbytes(page) for page in pages)
    del pages
    # The same read again over twice the dataset: what a source holds natively (its client's threads,
    # connections, arenas) costs the same both times unless it grows with the dataset.
    held = await _held_while_paging(subject, size)
    more = make_rows(rows + 1, rows, width=_WIDTH)
    await subject.source_setup.add_rows(more)
    doubled = await _held_while_paging(subject, size)
    del added, more
    if doubled.python + doubled.arrow > dataset:
        raise ConformanceFailure(
            MEMORY_RULE,
            f"reading {2 * rows} rows ({2 * dataset} B as Arrow) in pages of {size} held up to {doubled}: "
            "a paging source must not buffer the dataset",
        )
    grown = doubled.native - held.native
    if grown > dataset / 2:
        raise ConformanceFailure(
            MEMORY_RULE,
            f"reading {rows} rows more ({dataset} B as Arrow) in pages of {size} held {grown} B more "
            f"native memory ({held}, then {doubled}): a paging source must not buffer the dataset, "
            "natively either (a "
            "client-side cursor, a client library's prefetch of everything)",
        )
    spawned = doubled.children - held.children
    if spawned > dataset / 2:
        raise ConformanceFailure(
            MEMORY_RULE,
            f"reading {rows} rows more ({dataset} B as Arrow) in pages of {size}, the processes the "
            f"source started held {spawned} B more resident memory ({held}, then {doubled}): a "
            "paging source must not buffer the dataset natively, in a helper process either (a "
            "driver's client-side cursor in its own process, a local proxy's result buffer)",
        )
    return Outcome.passed(
        f"{2 * rows} rows ({2 * dataset} B) in pages of <= {size}; held at most {doubled}, "
        f"{grown} B more native and {spawned} B more in started processes than for half of them"
    )


def _nbytes(page: Page) -> int:
    records = page.records
    if isinstance(records, pa.RecordBatch):
        return int(records.nbytes)
    return len(json.dumps(records, default=str))


@dataclass(frozen=True)
class _Held:
    """The most held at once at any page of a read, by where: the Python heap, the Arrow pool,
    native memory (bytes live in the C allocator), and the resident memory of the processes the
    read started (``children``)."""

    python: int
    arrow: int
    native: int
    children: int

    def __str__(self) -> str:
        return (
            f"{self.python} B Python heap + {self.arrow} B Arrow pool, {self.native} B native, "
            f"{self.children} B resident in started processes"
        )


async def _held_while_paging(subject: Subject, batch_size: int) -> _Held:
    """What a read consumed page by page (each page dropped before the next) holds at each page.

    Sampled when a page is handed over, never by a clock: a source that buffers the dataset holds it
    at every page, whatever the machine's speed. The native part sees a buffer a client library
    keeps outside Python and Arrow (a client-side cursor's result, a prefetch queue); the children
    part the private resident memory of the processes started during the read (a driver's helper
    process holding the result), not of those running before it (in a test run, the servers).
    """
    source = subject.source()
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    python_floor = tracemalloc.get_traced_memory()[0]
    arrow_floor = pa.total_allocated_bytes()
    native_floor = _native_bytes()
    running = _started_processes(frozenset())[1]
    python = arrow = native = children = 0

    async def consume() -> None:
        nonlocal python, arrow, native, children
        async for page in source.stream_pages({}, batch_size):
            size = _nbytes(page)
            python = max(python, tracemalloc.get_traced_memory()[0] - python_floor - size)
            arrow = max(arrow, pa.total_allocated_bytes() - arrow_floor - size)
            native = max(native, _native_bytes() - native_floor)
            children = max(children, _started_processes(running)[0])
            del page

    try:
        await subject.within(consume(), MEMORY_RULE, f"stream_pages(batch_size={batch_size})")
    finally:
        if not tracing:
            tracemalloc.stop()
        await subject.within(source.close(), MEMORY_RULE, "Source.close")
    return _Held(max(0, python), max(0, arrow), max(0, native), children)


def _started_processes(running: frozenset[int]) -> tuple[int, frozenset[int]]:
    """The private resident bytes (RSS less shared pages) of the processes this process started
    that are not in ``running``, with their descendants, and the pids of this process's children.

    Only new children and their trees count: a server running before the read (a child in a test
    run) forks a backend per connection, and that backend's pages of the server's shared memory are
    the server's, not the source's."""
    import psutil

    resident, children = 0, psutil.Process().children()
    for child in children:
        if child.pid in running:
            continue
        try:
            for process in (child, *child.children(recursive=True)):
                memory = process.memory_info()
                resident += max(0, int(memory.rss) - int(getattr(memory, "shared", 0)))
        except psutil.Error:
            continue  # it ended meanwhile: it holds nothing
    return resident, frozenset(child.pid for child in children)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    """glibc's ``mallinfo2`` (live bytes of every arena), or None where the C library has none."""
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    function.argtypes = []
    return cast(Callable[[], _MallInfo2], function)


def _native_bytes() -> int:
    """Bytes live in the C allocator: what client libraries allocate outside Python and Arrow. Not
    RSS, which keeps freed arenas resident and grows with allocation churn rather than with what is
    held; nor child processes, which in a test run are the servers themselves."""
    info = _mallinfo2()
    if info is None:
        return 0
    found = info()
    return int(found.uordblks + found.hblkhd)


# -- check 3 ------------------------------------------------------------------------------------------


async def resume(subject: Subject) -> Outcome:
    """From a bookmark (kept as JSON), a new read returns exactly the rows after it."""
    setup, size = subject.source_setup, subject.options.batch_size
    probe = subject.source()
    if probe.state_key() is None:
        await _expect_unsupported(lambda: probe.apply_start_bookmark({}), "apply_start_bookmark")
        return Outcome.not_applicable("state_key() is None and apply_start_bookmark is refused: no resume")
    first = make_rows(1, 3 * size + 7)
    await setup.add_rows(first)
    pages = await read_all(subject, subject.source(), size, RESUME_RULE)
    read = [ids_of(page.records) for page in pages]
    if sorted(i for ids in read for i in ids) != [row["id"] for row in first]:
        raise ConformanceFailure(RESUME_RULE, "the first read did not return every row once")
    marked = [index for index, page in enumerate(pages) if page.bookmark is not None]
    if not marked or marked[-1] != len(pages) - 1:
        raise ConformanceFailure(RESUME_RULE, "a resumable source must put a bookmark on its final page")
    then = make_rows(10_001, 2 * size + 3)
    await setup.add_rows(then)
    checked = [len(pages) - 1, *marked[:1]] if marked[0] != len(pages) - 1 else [len(pages) - 1]
    for index in checked:
        delivered = {i for ids in read[: index + 1] for i in ids}
        expected = sorted({row["id"] for row in [*first, *then]} - delivered)
        bookmark = json.loads(json.dumps(pages[index].bookmark))
        source = subject.source()
        source.apply_start_bookmark(bookmark)
        again = sorted(
            i for page in await read_all(subject, source, size, RESUME_RULE) for i in ids_of(page.records)
        )
        replayed = sorted(set(again) & delivered)
        if replayed:
            raise ConformanceFailure(
                RESUME_RULE,
                f"a run started from the bookmark of page {index + 1} replayed {len(replayed)} committed "
                f"record(s) (ids {replayed[:5]}...)",
            )
        if again != expected:
            missing = sorted(set(expected) - set(again))
            raise ConformanceFailure(
                RESUME_RULE,
                f"a run started from the bookmark of page {index + 1} returned {len(again)} rows, expected "
                f"{len(expected)} (missing ids {missing[:5]}, duplicates {len(again) - len(set(again))})",
            )
    return Outcome.passed(f"resumed from {len(checked)} bookmark(s) without replay or loss")


async def _expect_unsupported(call: Callable[[], object], what: str) -> None:
    try:
        result = call()
        if isinstance(result, Awaitable):
            await result
    except UnsupportedOperation:
        return
    except FaucetError as exc:
        raise ConformanceFailure(
            CAPABILITY_RULE, f"{what} is declared unsupported but raised {type(exc).__name__}: {exc}"
        ) from exc
    raise ConformanceFailure(CAPABILITY_RULE, f"{what} is declared unsupported but it returned")


# -- check 4 ------------------------------------------------------------------------------------------


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
    await _refused(
        subject,
        Mode.BOUNDED,
        _policy_of(sink),
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


# -- planner and CLI refusals ---------------------------------------------------------------------------

ANY_SOURCE = SourceCapabilities(
    emits=Emits.ROWS,
    operations=frozenset({Operation.INSERT}),
    ordering=Ordering.STRICT_GLOBAL,
    replay=Replay.REPLAYABLE_AT_LEAST_ONCE,
    bounded=True,
    continuous=True,
    deterministic=True,
    event_identity=True,
)
"""The counterpart of a sink under test when the planner is asked: a source that breaks no rule."""

ANY_SINK = SinkCapabilities(
    bounded_policies=frozenset(WritePolicy),
    continuous_policies=frozenset(WritePolicy) - {WritePolicy.REPLACE},
    durability=Durability.TRANSACTIONAL,
    atomic_watermark=True,
)
"""The counterpart of a source under test: a sink that accepts every policy and has a watermark."""


def _policy_of(sink: Sink) -> WritePolicy:
    return sink.write_mode()[0]


async def _refused(
    subject: Subject,
    mode: Mode,
    policy: WritePolicy,
    code: Code,
    rule: str,
    *,
    source_caps: SourceCapabilities | None = None,
    sink_caps: SinkCapabilities | None = None,
    delivery: Delivery | None = None,
    key: tuple[str, ...] = (),
) -> None:
    """The planner must refuse the pair with ``code`` (the honest branch).

    The subject's side is the capabilities of the connector built from the spec under test (never a
    lookup of an installed connector by name); the other side is :data:`ANY_SOURCE` /
    :data:`ANY_SINK`.
    """
    source = source_caps or ANY_SOURCE
    sink = sink_caps or ANY_SINK
    try:
        accepted = plan(source, sink, mode, policy, key, delivery=delivery)
    except PlanError as exc:
        if code not in exc.codes:
            raise ConformanceFailure(
                rule, f"the planner refused {mode} {policy} for {exc.codes}, not {code}"
            ) from exc
    else:
        raise ConformanceFailure(
            rule,
            f"the planner accepted {mode} {policy} ({accepted.delivery}) though the capabilities "
            f"deny it ({code})",
        )


# -- check 5 ------------------------------------------------------------------------------------------


async def capabilities(subject: Subject) -> Outcome:
    """Every capability claimed true works; every one denied is refused (honest branch)."""
    check = {
        Role.SOURCE: _source_capabilities,
        Role.SINK: _sink_capabilities,
        Role.STREAM_SOURCE: _stream_source_capabilities,
        Role.STREAMING_SINK: _streaming_sink_capabilities,
    }[subject.role]
    proven = await check(subject)
    return Outcome.passed("; ".join(proven))


async def _source_capabilities(subject: Subject) -> list[str]:
    size = subject.options.batch_size
    rows = make_rows(1, 2 * size + 5)
    await subject.source_setup.add_rows(rows)
    expected = [row["id"] for row in rows]
    source = subject.source()
    caps = source.capabilities()
    proven: list[str] = []
    if not caps.bounded:
        raise ConformanceFailure(CAPABILITY_RULE, "a bounded Source declares bounded=False")
    pages = await read_all(subject, source, size, CAPABILITY_RULE)
    read = [i for page in pages for i in ids_of(page.records)]
    if sorted(read) != expected:
        raise ConformanceFailure(
            CAPABILITY_RULE, f"a bounded read returned {len(read)} of {len(expected)} rows"
        )
    proven.append("bounded read ends")
    if caps.ordering is Ordering.STRICT_GLOBAL:
        if read != expected:
            raise ConformanceFailure(
                CAPABILITY_RULE,
                "ordering is strict_global but rows came in another order than they were added",
            )
        proven.append("strict global order")
    if caps.columns is not None:
        for page in pages:
            names = (
                page.records.schema.names
                if isinstance(page.records, pa.RecordBatch)
                else list(page.records[0])
            )
            missing = [column for column in caps.columns if column not in names]
            if missing:
                raise ConformanceFailure(
                    CAPABILITY_RULE, f"declared columns {missing} are not in the records"
                )
        proven.append(f"columns {list(caps.columns)}")
    if caps.deterministic:
        again = await read_all(subject, subject.source(), size, CAPABILITY_RULE)
        if [ids_of(page.records) for page in again] != [ids_of(page.records) for page in pages]:
            raise ConformanceFailure(
                CAPABILITY_RULE, "deterministic is True but a second read gave other pages or another order"
            )
        proven.append("deterministic re-read")
    else:
        await _refused(
            subject,
            Mode.BOUNDED,
            WritePolicy.APPEND,
            Code.EFFECTIVELY_ONCE_UNREACHABLE,
            CAPABILITY_RULE,
            source_caps=caps,
            delivery=Delivery.EFFECTIVELY_ONCE,
        )
        proven.append("not deterministic: watermark delivery refused")
    if caps.discover:
        found = await subject.within(source.discover(), CAPABILITY_RULE, "discover")
        if not found:
            raise ConformanceFailure(CAPABILITY_RULE, "discover is True but discover() found no dataset")
        proven.append(f"discover found {len(found)}")
    else:
        await _expect_unsupported(source.discover, "discover()")
    if caps.shardable:
        proven.append(await _shards(subject, source, expected))
    else:
        await _expect_unsupported(source.enumerate_shards, "enumerate_shards()")
        await _expect_unsupported(lambda: subject.source().apply_shard("any"), "apply_shard()")
    if not caps.continuous:
        await _refused(
            subject,
            Mode.CONTINUOUS,
            WritePolicy.APPEND,
            Code.SOURCE_NOT_CONTINUOUS,
            CAPABILITY_RULE,
            source_caps=caps,
        )
        proven.append("not continuous: refused")
    return proven


async def _shards(subject: Subject, source: Source, expected: list[int]) -> str:
    shards = await subject.within(source.enumerate_shards(), CAPABILITY_RULE, "enumerate_shards")
    if not shards or len(set(shards)) != len(shards):
        raise ConformanceFailure(
            CAPABILITY_RULE, f"shardable is True but enumerate_shards() gave {list(shards)}"
        )
    seen: list[int] = []
    for shard in shards:
        part = subject.source()
        part.apply_shard(shard)
        seen.extend(
            i for page in await read_all(subject, part, 0, CAPABILITY_RULE) for i in ids_of(page.records)
        )
    if sorted(seen) != expected:
        raise ConformanceFailure(
            CAPABILITY_RULE,
            f"the {len(shards)} shards together returned {len(seen)} rows ({len(set(seen))} distinct), "
            f"the dataset has {len(expected)}: shards must partition it",
        )
    return f"{len(shards)} shards partition the dataset"


async def _sink_capabilities(subject: Subject) -> list[str]:
    setup = subject.sink_setup
    sink = subject.sink()
    caps = sink.capabilities()
    proven: list[str] = []
    try:
        policy, key = sink.write_mode()
        if (
            not sink.supported_write_modes() <= caps.bounded_policies
            or policy not in sink.supported_write_modes()
        ):
            raise ConformanceFailure(
                CAPABILITY_RULE,
                f"the configured mode {policy} is not among supported_write_modes() "
                f"{sorted(sink.supported_write_modes())} within the bounded policies",
            )
        rows = make_rows(1, 20)
        await subject.within(sink.write_batch(rows_batch(rows)), CAPABILITY_RULE, "write_batch")
        await subject.within(sink.flush(), CAPABILITY_RULE, "flush")
        await subject.within(sink.finish(), CAPABILITY_RULE, "finish")
        if pairs(await setup.read_back()) != pairs(rows):
            raise ConformanceFailure(
                CAPABILITY_RULE, f"a {policy} write of {len(rows)} rows did not land as written"
            )
        proven.append(f"{policy} writes")
        _dedups_as_configured(sink, policy, key)
        if setup.configure is not None:
            proven.append(await _dedups_follow_the_config(subject, setup.configure))
        if sink.supports_schema_evolution():
            change = [AddColumn("conformance_extra", pa.string())]
            for _ in range(2):  # ADD COLUMN IF NOT EXISTS: repeating it is harmless
                await subject.within(sink.evolve_schema(change), CAPABILITY_RULE, "evolve_schema")
            schema = await subject.within(sink.current_schema(), CAPABILITY_RULE, "current_schema")
            if schema is None or "conformance_extra" not in schema.names:
                raise ConformanceFailure(
                    CAPABILITY_RULE, "schema evolution is claimed but evolve_schema() did not add the column"
                )
            proven.append("schema evolution adds a column")
        else:
            try:
                await sink.evolve_schema([AddColumn("conformance_extra", pa.string())])
            except (SchemaError, UnsupportedOperation):
                proven.append("no schema evolution: refused")
            else:
                raise ConformanceFailure(
                    CAPABILITY_RULE, "schema evolution is denied but evolve_schema() returned"
                )
        if caps.partial_results and setup.refused_rows is not None:
            proven.append(await _partial(subject, sink, setup.refused_rows))
        unsupported = sorted(set(WritePolicy) - sink.supported_write_modes())
        if unsupported:
            await _refused(
                subject,
                Mode.BOUNDED,
                unsupported[0],
                Code.POLICY_NOT_SUPPORTED,
                CAPABILITY_RULE,
                sink_caps=caps,
            )
            proven.append(f"{unsupported[0]} refused")
    finally:
        await subject.within(sink.close(), CAPABILITY_RULE, "Sink.close")
    if not sink.supports_idempotent_writes():
        try:
            await sink.write_batch_idempotent(rows_batch(make_rows(100, 1)), CommitToken(1))
        except FaucetError:
            proven.append("no watermark: idempotent write refused")
        else:
            raise ConformanceFailure(
                CAPABILITY_RULE, "idempotent writes are denied but write_batch_idempotent() wrote"
            )
        finally:
            await sink.close()
    return proven


_KEYED_POLICIES = (WritePolicy.UPSERT, WritePolicy.DELETE, WritePolicy.VERSIONED_UPSERT)


def _dedups_as_configured(sink: Sink, policy: WritePolicy, key: Sequence[str]) -> None:
    keyed = policy in _KEYED_POLICIES and bool(key)
    if sink.dedups_by_key() != keyed:
        raise ConformanceFailure(
            CAPABILITY_RULE,
            f"dedups_by_key() is {sink.dedups_by_key()} for mode {policy} with key {list(key)}: it must "
            "reflect the live config (an upsert or delete with a non-empty key)",
        )


async def _dedups_follow_the_config(
    subject: Subject, configure: Callable[[WritePolicy, tuple[str, ...]], Mapping[str, Any]]
) -> str:
    """dedups_by_key() of sinks built from configs that tell a mode from a key: append with a key,
    each keyed policy with and without one. A config the connector refuses (ConfigError) is fine."""
    keys: tuple[tuple[str, ...], ...] = (("id",), ())
    variants = [(WritePolicy.APPEND, keys[0]), *((policy, key) for policy in _KEYED_POLICIES for key in keys)]
    built: list[str] = []
    for policy, key in variants:
        try:
            sink = subject.sink(dict(configure(policy, key)))
        except FaucetError:
            continue  # the connector refuses this config: nothing to claim
        try:
            configured = sink.write_mode()
            if configured != (policy, key):
                raise ConformanceFailure(
                    CAPABILITY_RULE,
                    f"a sink configured for {policy} with key {list(key)} reports write_mode() {configured}",
                )
            _dedups_as_configured(sink, policy, key)
        finally:
            await subject.within(sink.close(), CAPABILITY_RULE, "Sink.close")
        built.append(f"{policy}{list(key)}")
    return f"dedups_by_key() follows the config ({', '.join(built)})"


async def _partial(subject: Subject, sink: Sink, rows: Sequence[Mapping[str, Any]]) -> str:
    before = pairs(await subject.sink_setup.read_back())
    result = await subject.within(
        sink.write_batch_partial(rows_batch(rows)), CAPABILITY_RULE, "write_batch_partial"
    )
    refused = {rows[rejected.index]["id"] for rejected in result.rejected}
    landed = [row for row in rows if row["id"] not in refused]
    after = pairs(await subject.sink_setup.read_back())
    if not refused or result.written != len(landed) or after != sorted([*before, *pairs(landed)]):
        raise ConformanceFailure(
            CAPABILITY_RULE,
            f"partial_results is claimed but write_batch_partial() reported {result.written} written and "
            f"{len(refused)} refused of {len(rows)}, and the destination does not hold exactly the rest",
        )
    return f"partial results refused {len(refused)} row(s)"


async def _stream_source_capabilities(subject: Subject) -> list[str]:
    source = subject.stream_source()
    caps = source.capabilities()
    proven: list[str] = []
    registry = default_codec_registry()
    for codec in source.codecs():
        if type(registry.get(codec.name)) is not type(codec):
            raise ConformanceFailure(
                CAPABILITY_RULE, f"codec {codec.name!r} is not the one registered under its name"
            )
    proven.append(f"codecs {[codec.name for codec in source.codecs()]} registered")
    rows = make_rows(1, 30)
    await subject.source_setup.add_rows(rows)
    driver = StreamDriver(subject, CAPABILITY_RULE)
    try:
        seen = await driver.read_until({row["id"] for row in rows}, QUIET)
        if sorted(seen) != [row["id"] for row in rows]:
            raise ConformanceFailure(
                CAPABILITY_RULE, f"the stream delivered {len(seen)} of {len(rows)} rows once each"
            )
        if caps.ordering is Ordering.STRICT_GLOBAL and seen != [row["id"] for row in rows]:
            raise ConformanceFailure(
                CAPABILITY_RULE, "ordering is strict_global but rows came in another order"
            )
        identities = [event[:3] for event in driver.events]
        if caps.event_identity and len(set(identities)) != len(identities):
            raise ConformanceFailure(CAPABILITY_RULE, "event_identity is True but two rows share an identity")
        kinds = {type(control).__name__ for control in driver.controls}
        if caps.transaction_boundaries and not {"TransactionBegin", "TransactionEnd"} <= kinds:
            raise ConformanceFailure(
                CAPABILITY_RULE, f"transaction_boundaries is True but the reads sent only {sorted(kinds)}"
            )
        if caps.bounded:
            assert driver.session is not None
            if not driver.session.exhausted:
                raise ConformanceFailure(
                    CAPABILITY_RULE, "bounded is True but the session never became exhausted"
                )
            proven.append("bounded session exhausted")
    finally:
        await driver.close()
    proven.append(f"{len(seen)} rows with {'stable ' if caps.event_identity else ''}identities")
    if not caps.bounded:
        try:
            plan(caps, ANY_SINK, Mode.BOUNDED, WritePolicy.APPEND)
        except PlanError as exc:
            if Code.SOURCE_NOT_BOUNDED not in exc.codes:
                raise ConformanceFailure(
                    CAPABILITY_RULE, f"bounded mode was refused for {exc.codes}"
                ) from exc
        else:
            raise ConformanceFailure(
                CAPABILITY_RULE, "the planner accepted a bounded read of a non-bounded source"
            )
        proven.append("not bounded: refused")
    if caps.ordering is not Ordering.STRICT_GLOBAL:
        await _refused(
            subject,
            Mode.CONTINUOUS,
            WritePolicy.UPSERT,
            Code.ORDER_DEPENDENT_POLICY,
            CAPABILITY_RULE,
            source_caps=caps,
            key=("id",),
        )
        proven.append(f"{caps.ordering} order: order-dependent upsert refused")
    if caps.replay is not Replay.REPLAYABLE_AT_LEAST_ONCE or not caps.continuous:
        code = Code.SOURCE_NOT_CONTINUOUS if not caps.continuous else Code.SOURCE_NOT_REPLAYABLE
        await _refused(subject, Mode.CONTINUOUS, WritePolicy.APPEND, code, CAPABILITY_RULE, source_caps=caps)
        proven.append(f"{code} refused")
    return proven


async def _streaming_sink_capabilities(subject: Subject) -> list[str]:
    setup = subject.sink_setup
    caps = subject.streaming_sink().capabilities()
    proven: list[str] = []
    rows = make_rows(1, 20)
    session = await open_sink_session(subject, CAPABILITY_RULE)
    try:
        epoch = EpochId(STREAM, 1, WORKER.fencing_token)
        await subject.within(session.begin_epoch(epoch), CAPABILITY_RULE, "begin_epoch")
        await subject.within(session.apply(epoch, sink_batch(epoch, rows)), CAPABILITY_RULE, "apply")
        if caps.durability is Durability.TRANSACTIONAL and pairs(await setup.read_back()):
            raise ConformanceFailure(
                CAPABILITY_RULE, "durability is transactional but applied rows are visible before the commit"
            )
        receipts = await subject.within(
            session.commit_epoch(epoch, covering(rows)), CAPABILITY_RULE, "commit_epoch"
        )
        if pairs(await setup.read_back()) != pairs(rows) or sum(r.rows_written for r in receipts) != len(
            rows
        ):
            raise ConformanceFailure(
                CAPABILITY_RULE,
                f"an APPEND epoch of {len(rows)} rows did not land as its receipts say ({receipts})",
            )
        proven.append(f"append lands ({caps.durability})")
        await subject.within(session.close_session(), CAPABILITY_RULE, "close_session")
        session = await open_sink_session(subject, CAPABILITY_RULE)
        state = await subject.within(session.last_committed(), CAPABILITY_RULE, "last_committed")
        if caps.atomic_watermark:
            ends = {position.domain: position.value for position in state.watermarks} if state else {}
            if state is None or state.epoch != epoch or ends.get(DOMAIN) != str(rows[-1]["id"]):
                raise ConformanceFailure(
                    CAPABILITY_RULE, f"atomic_watermark is True but last_committed() read back {state}"
                )
            proven.append("watermark read back")
        if caps.owner_fencing:
            proven.append(await _fenced(subject, session))
    finally:
        await quietly_close(session)
    for policy in sorted(set(WritePolicy) - caps.continuous_policies):
        await _refused(
            subject,
            Mode.CONTINUOUS,
            policy,
            Code.POLICY_NOT_SUPPORTED,
            CAPABILITY_RULE,
            sink_caps=caps,
            key=("id",),
        )
        try:
            refused = await subject.streaming_sink().open(STREAM, policy, ("id",), WORKER)
        except FaucetError:
            continue
        await quietly_close(refused)
        raise ConformanceFailure(
            CAPABILITY_RULE, f"{policy} is not a continuous policy but open() accepted it"
        )
    proven.append("undeclared policies refused")
    if not caps.atomic_watermark and not caps.dedup_by_event_identity:
        await _refused(
            subject,
            Mode.CONTINUOUS,
            WritePolicy.APPEND,
            Code.EFFECTIVELY_ONCE_UNREACHABLE,
            CAPABILITY_RULE,
            sink_caps=caps,
            delivery=Delivery.EFFECTIVELY_ONCE,
        )
        proven.append("no mechanism: effectively-once refused")
    return proven


async def _fenced(subject: Subject, stale: Any) -> str:
    """owner_fencing: a session opened under a higher token makes the older one's commit write nothing."""
    epoch = EpochId(STREAM, 2, WORKER.fencing_token)
    rows = make_rows(100, 5)
    before = pairs(await subject.sink_setup.read_back())
    await subject.within(stale.begin_epoch(epoch), CAPABILITY_RULE, "begin_epoch")
    await subject.within(stale.apply(epoch, sink_batch(epoch, rows)), CAPABILITY_RULE, "apply")
    newer = await open_sink_session(subject, CAPABILITY_RULE, token=WORKER.fencing_token + 1)
    try:
        try:
            await subject.within(
                stale.commit_epoch(epoch, covering(rows, 20)), CAPABILITY_RULE, "commit_epoch"
            )
        except OwnershipLost:
            pass
        else:
            raise ConformanceFailure(
                CAPABILITY_RULE,
                "owner_fencing is True but a stale worker's commit succeeded after a newer one opened",
            )
        if pairs(await subject.sink_setup.read_back()) != before:
            raise ConformanceFailure(
                CAPABILITY_RULE, "owner_fencing is True but a fenced commit changed the destination"
            )
    finally:
        await quietly_close(newer)
    return "stale owner fenced"


# -- check 6 ------------------------------------------------------------------------------------------


async def no_panic(subject: Subject) -> Outcome:
    """Bad config, an unreachable endpoint, a malformed record: a FaucetError in time; empty: empty."""
    setup = subject.setup
    exercise = _EXERCISES[subject.role]
    done: list[str] = []
    for label, config in _bad_configs(subject):
        await _expect_error(subject, f"bad config ({label})", functools.partial(exercise, subject, config))
    done.append("bad config")
    if setup.unreachable is not None:
        unreachable = setup.unreachable
        await _expect_error(
            subject, "an unreachable endpoint", functools.partial(exercise, subject, unreachable)
        )
        done.append("unreachable endpoint")
    done.extend(await _declared_calls(subject))
    try:
        count = await exercise(subject, None)
    except FaucetError as exc:
        raise ConformanceFailure(
            PANIC_RULE, f"an empty dataset raised {type(exc).__name__}: {exc}; an empty result is no error"
        ) from exc
    if count:
        raise ConformanceFailure(PANIC_RULE, f"an empty dataset gave {count} rows")
    done.append("empty result")
    malformed = await _malformed(subject)
    if malformed is not None:
        await _expect_error(subject, "a malformed record", malformed)
        done.append("malformed record")
    return Outcome.passed(", ".join(done) + " handled")


async def _declared_calls(subject: Subject) -> list[str]:
    """``check()`` and every other call the connector declares (``discover``, ``enumerate_shards``,
    ``apply_shard``, ``capture_resume_position``): each works on the setup's config and ends in a
    FaucetError, in time, on the unreachable one (never a raw client exception)."""
    if subject.role not in (Role.SOURCE, Role.SINK):
        return []
    setup = subject.setup
    built = subject.build()
    assert isinstance(built, Source | Sink)
    calls: list[tuple[str, Callable[[Source | Sink], Awaitable[object]]]] = [("check()", _preflight)]
    if isinstance(built, Source):
        caps = built.capabilities()
        if caps.discover:
            calls.append(("discover()", _discover))
        if caps.shardable:
            calls.append(("enumerate_shards()", _enumerate_shards))
        if type(built).capture_resume_position is not Source.capture_resume_position:
            calls.append(("capture_resume_position()", _capture))
    await _close(subject, built)
    done: list[str] = []
    for what, call in calls:
        connector = subject.build()
        assert isinstance(connector, Source | Sink)
        try:
            await _succeeds_or_fails(subject, f"{what} on a usable config", call, connector)
        finally:
            await _close(subject, connector)
        if setup.unreachable is not None:
            unreachable = functools.partial(_on_config, subject, call, dict(setup.unreachable))
            await _expect_error(subject, f"{what} on an unreachable endpoint", unreachable)
        done.append(what)
    if isinstance(built, Source) and built.capabilities().shardable:

        async def unknown_shard() -> object:
            source = subject.source()
            source.apply_shard("faucet-conformance-no-such-shard")
            return await read_all(subject, source, subject.options.batch_size, PANIC_RULE)

        try:
            await asyncio.wait_for(unknown_shard(), subject.options.timeout)
        except FaucetError:
            pass
        except TimeoutError:
            raise ConformanceFailure(PANIC_RULE, "a read of an unknown shard did not end (a hang)") from None
        except Exception as exc:
            raise ConformanceFailure(
                PANIC_RULE, f"apply_shard() of an unknown shard raised {type(exc).__name__}: {exc}"
            ) from exc
        done.append("apply_shard()")
    return done


async def _on_config(
    subject: Subject, call: Callable[[Source | Sink], Awaitable[object]], config: dict[str, Any]
) -> object:
    connector = subject.build(config)
    assert isinstance(connector, Source | Sink)
    try:
        return await call(connector)
    finally:
        await _close(subject, connector)


async def _preflight(connector: Source | Sink) -> object:
    await connector.check()
    return None


async def _discover(connector: Source | Sink) -> object:
    assert isinstance(connector, Source)
    return await connector.discover()


async def _enumerate_shards(connector: Source | Sink) -> object:
    assert isinstance(connector, Source)
    return await connector.enumerate_shards()


async def _capture(connector: Source | Sink) -> object:
    assert isinstance(connector, Source)
    return await connector.capture_resume_position()


async def _close(subject: Subject, connector: Source | Sink) -> None:
    await subject.within(connector.close(), PANIC_RULE, f"{type(connector).__name__}.close")


async def _succeeds_or_fails(
    subject: Subject,
    what: str,
    call: Callable[[Source | Sink], Awaitable[object]],
    connector: Source | Sink,
) -> None:
    try:
        await subject.within(call(connector), PANIC_RULE, what)
    except ConformanceFailure:
        raise
    except FaucetError as exc:
        raise ConformanceFailure(
            PANIC_RULE, f"{what} raised {type(exc).__name__}: {exc}; it must work where the reads work"
        ) from exc
    except Exception as exc:
        raise ConformanceFailure(
            PANIC_RULE, f"{what} raised {type(exc).__name__}: {exc} instead of a FaucetError"
        ) from exc


def _bad_configs(subject: Subject) -> list[tuple[str, dict[str, Any]]]:
    config = dict(subject.setup.config)
    variants = [("unknown key", {**config, "faucet_conformance_unknown": 1})]
    schema = subject.spec.roles[subject.role].config_model.json_schema()
    required = [name for name in schema.get("required", []) if name in config]
    if required:
        name = required[0]
        variants.append((f"{name} missing", {k: v for k, v in config.items() if k != name}))
        variants.append((f"{name} of a wrong type", {**config, name: {"not": ["a", "valid", "value"]}}))
    return variants


async def _expect_error(subject: Subject, what: str, step: Callable[[], Awaitable[object]]) -> None:
    try:
        await asyncio.wait_for(step(), subject.options.timeout)
    except FaucetError:
        return
    except ConformanceFailure:
        raise
    except TimeoutError:
        raise ConformanceFailure(
            PANIC_RULE, f"{what} did not end within {subject.options.timeout:g}s (a hang)"
        ) from None
    except Exception as exc:
        raise ConformanceFailure(
            PANIC_RULE, f"{what} raised {type(exc).__name__}: {exc} instead of a FaucetError"
        ) from exc
    raise ConformanceFailure(PANIC_RULE, f"{what} ended without an error: a failure was swallowed")


async def _malformed(subject: Subject) -> Callable[[], Awaitable[object]] | None:
    """The step that must fail on a malformed record, or None when the setup has no such record."""
    setup = subject.setup
    if subject.role in (Role.SOURCE, Role.STREAM_SOURCE):
        add = getattr(setup, "add_malformed", None)
        if add is None:
            return None
        await add()
        if subject.role is Role.STREAM_SOURCE:
            # A row after the malformed record: the read must fail before certifying it. Waiting for
            # it, not for a quiet spell, tells "not read yet" from "swallowed" on a loaded machine.
            after = make_rows(_AFTER_MALFORMED, 1)
            await subject.source_setup.add_rows(after)
            return lambda: _stream_past_malformed(subject)
        return lambda: _EXERCISES[subject.role](subject, None)
    refused = getattr(setup, "refused_rows", None)
    if refused is None:
        return None
    return lambda: _EXERCISES[subject.role](subject, None, refused)


_AFTER_MALFORMED = 900_000
"""The id of the row added after the malformed record (even: the same Kafka partition as key 0)."""


async def _stream_past_malformed(subject: Subject) -> int:
    driver = StreamDriver(subject, PANIC_RULE)
    try:
        return len(await driver.read_until({_AFTER_MALFORMED}, QUIET))
    finally:
        await driver.close()


async def _exercise_source(subject: Subject, config: Any, rows: Any = None) -> int:
    source = subject.source(config)
    return sum(
        page.num_rows for page in await read_all(subject, source, subject.options.batch_size, PANIC_RULE)
    )


async def _exercise_sink(subject: Subject, config: Any, rows: Any = None) -> int:
    sink = subject.sink(config)
    try:
        written = await sink.write_batch(rows_batch(rows or []))
        await sink.flush()
        await sink.finish()
        return written
    finally:
        await sink.close()


async def _exercise_stream_source(subject: Subject, config: Any, rows: Any = None) -> int:
    driver = StreamDriver(subject, PANIC_RULE)
    try:
        await driver.open(subject.stream_source(config))
        _, ids = await driver.epoch(QUIET)
        return len(ids)
    finally:
        await driver.close()


async def _exercise_streaming_sink(subject: Subject, config: Any, rows: Any = None) -> int:
    session = await open_sink_session(subject, PANIC_RULE, config=config)
    try:
        epoch = EpochId(STREAM, 1, WORKER.fencing_token)
        await session.begin_epoch(epoch)
        coverage = covering(rows) if rows else Coverage()
        if rows:
            await session.apply(epoch, sink_batch(epoch, rows))
        receipts = await session.commit_epoch(epoch, coverage)
        await session.close_session()
        return sum(receipt.rows_written for receipt in receipts)
    except BaseException:
        await quietly_close(session)
        raise


_EXERCISES: dict[Role, Callable[..., Awaitable[int]]] = {
    Role.SOURCE: _exercise_source,
    Role.SINK: _exercise_sink,
    Role.STREAM_SOURCE: _exercise_stream_source,
    Role.STREAMING_SINK: _exercise_streaming_sink,
}
