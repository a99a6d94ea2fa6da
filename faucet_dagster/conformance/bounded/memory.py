"""FCP check 2, bounded memory, and how it measures what a read holds.

Pages never exceed ``batch_size``, ``batch_size == 0`` is one page, and a paging source holds far
less than the dataset at once: on the Python heap, in the Arrow pool, in the C allocator, and in
the processes the read started, each sampled when a page is handed over (never by a clock).
"""

import ctypes
import functools
import json
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import pyarrow as pa

from faucet_dagster.conformance.bounded.common import MEMORY_RULE, read_all
from faucet_dagster.conformance.harness import Subject, ids_of
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.protocol import Page

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
    # Half the (single) dataset: a paging source holds a page or two (a few hundred kB here); one
    # that buffers holds the doubled dataset, twice this much and more, whatever the allocator does.
    if doubled.python + doubled.arrow > dataset / 2:
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
