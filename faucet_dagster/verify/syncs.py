"""``faucet verify`` of a bounded sync: its runs re-read bookmark to bookmark and compared with the
destination.

A run is what one materialization recorded: the bookmark it started from and the one it ended at
(:class:`SyncRun`). :func:`verify_sync` re-reads each run's range with ``Source.replay_pages`` (a
REPLACE run: the whole snapshot) and compares the rows with what the sink's reader finds, as its
write mode promises: APPEND each row there (exactly, with nothing else, when the runs verified are
every run the sync made, from its first), REPLACE the table equal to the last run's snapshot, UPSERT the
last row of each key (unless a later run changed it). A bounded run records no digest: the source
aspect says whether the range could be re-read, the destination aspect whether its rows are there.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa

from faucet_dagster.protocol import (
    DataError,
    Delivery,
    ExpectedRows,
    FaucetError,
    IncarnationChanged,
    IntegrityError,
    JsonValue,
    PositionUnavailable,
    ReadableSink,
    SchemaError,
    Sink,
    Source,
    WritePolicy,
    as_record_batch,
)
from faucet_dagster.verify.destination import compare
from faucet_dagster.verify.results import Aspect, Finding, Outcome, Report, Verification, note_all


@dataclass(frozen=True)
class SyncRun:
    """One completed run of a bounded sync: its number among the sync's runs (1: the first), the
    bookmarks it started from and ended at, the shard it read, and what names it for people."""

    number: int
    start: JsonValue | None
    end: JsonValue | None
    label: str = ""
    shard: str | None = None


@dataclass
class _Reread:
    run: SyncRun
    rows: pa.Table | None = None
    finding: Finding | None = None


async def verify_sync(
    name: str,
    source: Callable[[], Source],
    sink: Sink,
    runs: Sequence[SyncRun],
    *,
    total: int,
    batch_size: int,
    delivery: Delivery = Delivery.EFFECTIVELY_ONCE,
    diff_limit: int = 20,
) -> Report:
    """Verify ``runs`` (ascending) of sync ``name``, of ``total`` runs in all; ``source`` builds a fresh
    source for each re-read (a re-read applies its own bookmarks), ``batch_size`` is the sync's,
    ``delivery`` what its plan promised (at-least-once: a row found twice is allowed)."""
    began = time.perf_counter()
    policy, key = sink.write_mode()
    if policy is WritePolicy.REPLACE:
        runs = runs[-1:]  # a REPLACE run swapped in the whole table: only the last one is there
    rereads = [await _reread(source, run, policy, batch_size) for run in runs]
    findings: dict[int, list[Finding]] = {reread.run.number: [] for reread in rereads}
    for reread in rereads:
        rows = 0 if reread.rows is None else reread.rows.num_rows
        findings[reread.run.number].append(
            reread.finding
            or Finding(
                Aspect.SOURCE, Outcome.VERIFIED, "re-read", name, f"re-read {rows} rows {_span(reread.run)}"
            )
        )
    allowed = delivery is Delivery.AT_LEAST_ONCE
    compared = await _compare(name, sink, rereads, policy, key, total, diff_limit, allowed, findings)
    verifications = tuple(
        Verification(
            name,
            reread.run.number,
            {
                aspect: Outcome.worst(f.outcome for f in findings[reread.run.number] if f.aspect is aspect)
                for aspect in (Aspect.SOURCE, Aspect.DESTINATION)
            },
            tuple(findings[reread.run.number]),
            label=reread.run.label,
        )
        for reread in rereads
    )
    replayed = sum(0 if reread.rows is None else reread.rows.num_rows for reread in rereads)
    return Report(verifications, time.perf_counter() - began, replayed, compared)


def _span(run: SyncRun) -> str:
    start = "the beginning" if run.start is None else "its start bookmark"
    end = "the end" if run.end is None else "its end bookmark"
    return f"from {start} to {end}"


async def _reread(
    source_of: Callable[[], Source], run: SyncRun, policy: WritePolicy, batch_size: int
) -> _Reread:
    where = run.label or f"run {run.number}"
    source = source_of()
    tables: list[pa.Table] = []
    try:
        if run.shard is not None:
            source.apply_shard(run.shard)
        start = None if policy is WritePolicy.REPLACE else run.start
        async for page in source.replay_pages({}, start, run.end, batch_size):
            batch = as_record_batch(page.records)
            if batch.num_rows:
                tables.append(pa.Table.from_batches([batch]))
    except PositionUnavailable as exc:
        return _Reread(
            run, None, Finding(Aspect.SOURCE, Outcome.NOT_VERIFIABLE, "not replayable", where, exc.message)
        )
    except IncarnationChanged as exc:
        return _Reread(
            run, None, Finding(Aspect.SOURCE, Outcome.DIVERGED, "source re-created", where, exc.message)
        )
    except (DataError, IntegrityError, SchemaError) as exc:
        reason = f"re-reading {_span(run)} found what the run could not have written: {exc}"
        return _Reread(run, None, Finding(Aspect.SOURCE, Outcome.DIVERGED, "replay differs", where, reason))
    except FaucetError as exc:
        return _Reread(
            run,
            None,
            Finding(
                Aspect.SOURCE, Outcome.NOT_VERIFIABLE, "not re-read", where, f"{type(exc).__name__}: {exc}"
            ),
        )
    finally:
        await source.close()
    rows = pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})
    return _Reread(run, rows)


async def _compare(
    name: str,
    sink: Sink,
    rereads: Sequence[_Reread],
    policy: WritePolicy,
    key: tuple[str, ...],
    total: int,
    limit: int,
    duplicates_allowed: bool,
    findings: dict[int, list[Finding]],
) -> int:
    """The re-read rows against the destination; the rows compared."""
    complete = [reread for reread in rereads if reread.rows is not None]

    def each(numbers: Sequence[_Reread], outcome: Outcome, kind: str, detail: str) -> None:
        note_all(
            findings,
            [reread.run.number for reread in numbers],
            lambda _: Finding(Aspect.DESTINATION, outcome, kind, name, detail),
        )

    each(
        [r for r in rereads if r.rows is None],
        Outcome.NOT_VERIFIABLE,
        "not compared",
        "its range could not be re-read",
    )
    if not complete:
        return 0
    if not isinstance(sink, ReadableSink):
        each(
            complete,
            Outcome.NOT_VERIFIABLE,
            "no reader",
            f"the {sink.connector_name} sink cannot read back what a sync wrote",
        )
        return 0
    tables = [reread.rows for reread in complete if reread.rows is not None and reread.rows.num_columns]
    epochs = [
        reread.run.number
        for reread in complete
        for _ in range(0 if reread.rows is None else reread.rows.num_rows)
    ]
    rows = pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})
    if not rows.num_rows:
        each(
            complete, Outcome.VERIFIED, "no rows", "the run read nothing: nothing must be at the destination"
        )
        return 0
    expected = ExpectedRows(
        resource=name,
        policy=policy,
        key=key,
        rows=rows,
        epochs=epochs,
        identities=[None] * rows.num_rows,
        sequences=tuple(reread.run.number for reread in complete),
        latest=total,
    )
    reader = await sink.reader(name)
    try:
        result = await compare(reader, expected, limit, duplicates_allowed=duplicates_allowed)
    finally:
        await reader.close()
    for number, items in result.findings.items():
        findings.setdefault(number, []).extend(items)
    return result.compared


__all__ = ["SyncRun", "verify_sync"]
