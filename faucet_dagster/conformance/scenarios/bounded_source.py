"""The scenarios of a bounded source: runs resumed from bookmarks while the dataset changes.

The battery plays the bounded runner: a *run* (a worker process of its own) applies the last
committed bookmark (kept as JSON), reads pages of a size drawn from the seed, and commits the
bookmark of the last page it took; a run may stop after any page (a crash between pages). Between
runs the source gains rows (one transaction of several rows: they share a cursor value), rows where
the source reads them first (a file whose name sorts before every file read), and changed rows (a
cursor moves them past the others). Each run is judged against the model: nothing committed is
delivered again, nothing is skipped (a complete run delivers every row not yet committed, in its
current version), and a run resumed from *any* page's bookmark delivers exactly the rows after that
page. A lane runs through the setup's config, another through its cursor config where it has one.
"""

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from faucet_dagster.conformance.scenarios.agent import PageSeen
from faucet_dagster.conformance.scenarios.engine import Divergence, Step, Trace
from faucet_dagster.conformance.scenarios.runs import WorkerRun
from faucet_dagster.conformance.scenarios.workers import Failed
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.protocol import Role

RESUME_RULE = "FCP 2.5 resume from the bookmark: nothing committed is read again, nothing is skipped"
PAGE_RULE = "FCP 2.2 pages hold at most batch_size rows, and a resumable source bookmarks its last page"
WORKS_RULE = "FCP 2.1 a read of a valid config works, or fails with a typed FaucetError"


@dataclass(frozen=True)
class BoundedSourceDeclaration:
    resumable: bool
    cursor: bool
    """The setup has a cursor config and can change rows (``update_rows``)."""
    anywhere: bool
    """The setup can add rows the source reads before the ones it holds (``add_rows_before``)."""


@dataclass(frozen=True)
class Cast(Step):
    lanes: tuple[str, ...]
    fixed = True

    def describe(self) -> str:
        return "lanes: " + ", ".join(self.lanes)


@dataclass(frozen=True)
class Add(Step):
    count: int
    before: bool = False

    def describe(self) -> str:
        where = " where the source reads them before everything it holds" if self.before else ""
        return f"source: {self.count} rows added in one transaction{where}"


@dataclass(frozen=True)
class Change(Step):
    """Rows changed (their cursor moves past every other row's)."""

    picks: tuple[int, ...]

    def describe(self) -> str:
        return f"source: {len(self.picks)} row(s) changed"


@dataclass(frozen=True)
class Run(Step):
    lane: str
    batch_size: int
    take: int | None = None

    def describe(self) -> str:
        stop = (
            "every page" if self.take is None else f"{self.take} page(s), then stops (a crash between pages)"
        )
        return f"{self.lane}: a run from the committed bookmark in pages of {self.batch_size}, takes {stop}"


@dataclass(frozen=True)
class ResumeEverywhere(Step):
    """A run in pages of ``batch_size`` without committing, then a run from each page's bookmark."""

    lane: str
    batch_size: int

    def describe(self) -> str:
        return f"{self.lane}: reads in pages of {self.batch_size}, then resumes from every page's bookmark"


def declaration(subject: Any) -> BoundedSourceDeclaration:
    setup = subject.source_setup
    source = subject.source()
    return BoundedSourceDeclaration(
        resumable=source.state_key() is not None,
        cursor=setup.cursor_config is not None and setup.update_rows is not None,
        anywhere=setup.add_rows_before is not None,
    )


def generate(rng: random.Random, declared: BoundedSourceDeclaration) -> list[Step]:
    lanes = ("config", *(("cursor",) if declared.cursor else ()))
    steps: list[Step] = [Cast(lanes)]

    def add() -> Step:
        return Add(2 + rng.randrange(3))

    def size() -> int:
        return 2 + rng.randrange(3)

    # Three transactions of three rows, read in pages of two: page boundaries fall inside the groups
    # of rows that share a cursor value, whatever the seed.
    steps += [Add(3), Add(3), Add(3)]
    for lane in lanes:
        steps += [Run(lane, 2, take=1 + rng.randrange(2)), ResumeEverywhere(lane, 2)]
    if declared.anywhere:
        steps += [Add(2 + rng.randrange(2), before=True)]
    if declared.cursor:
        steps += [Change(tuple(rng.randrange(100) for _ in range(2 + rng.randrange(2))))]
    steps += [add()]
    for lane in lanes:
        steps += [Run(lane, size()), ResumeEverywhere(lane, size())]
    for _ in range(6):
        choice = rng.choice(["add", "before", "change", "run", "run"])
        if (
            choice == "add"
            or (choice == "before" and not declared.anywhere)
            or (choice == "change" and not declared.cursor)
        ):
            steps.append(add())
        elif choice == "before":
            steps.append(Add(1 + rng.randrange(3), before=True))
        elif choice == "change":
            steps.append(Change((rng.randrange(100),)))
        else:
            steps.append(Run(rng.choice(lanes), size(), take=rng.choice([None, 1, 2])))
    for lane in lanes:
        steps += [Run(lane, size()), Run(lane, size())]
    return steps


@dataclass
class _Lane:
    name: str
    config: Mapping[str, Any]
    bookmark: Any = None
    committed: dict[int, str] = field(default_factory=dict)
    """Rows committed: id -> the row's version (its name) when it was delivered."""


class BoundedSourceRun(WorkerRun):
    role = Role.SOURCE
    works_rule = WORKS_RULE
    hang = "a read did not end"

    def __init__(self, subject: Any, setup: Any, declared: BoundedSourceDeclaration, trace: Trace) -> None:
        super().__init__(subject, setup, trace)
        self.declared = declared
        self.lanes: dict[str, _Lane] = {}
        self.rows: dict[int, str] = {}
        """The source now: id -> version (name)."""
        self.next_id = 1
        self.changes = 0

    async def _cast(self, step: Cast) -> None:
        for name in step.lanes:
            config = self.setup.config if name == "config" else self.setup.cursor_config
            self.lanes[name] = _Lane(name, dict(config))
        self.trace.exercised.add(
            "bounded reads resumed from bookmarks" if self.declared.resumable else "bounded reads"
        )
        if "cursor" in self.lanes:
            self.trace.exercised.add("a cursor configured, rows changed between runs")

    async def _add(self, step: Add) -> None:
        rows = make_rows(self.next_id, step.count)
        self.next_id += step.count
        for row in rows:
            self.rows[int(row["id"])] = str(row["name"])
        if step.before:
            self.trace.exercised.add("rows that sort before everything read")
            await self.setup.add_rows_before(rows)
        else:
            await self.setup.add_rows(rows)

    async def _change(self, step: Change) -> None:
        if not self.rows:
            self.trace.note("skipped: no rows")
            return
        ids = sorted(self.rows)
        chosen = sorted({ids[pick % len(ids)] for pick in step.picks})
        self.changes += 1
        changed = [{"id": i, "name": f"row-{i}-changed-{self.changes}"} for i in chosen]
        for i, row in zip(chosen, changed, strict=True):
            self.rows[i] = str(row["name"])
        await self.setup.update_rows(changed)

    async def _read(self, lane: _Lane, bookmark: Any, batch_size: int, take: int | None) -> list[PageSeen]:
        worker = self._worker("bounded-source", crashable=False)
        try:
            source = await worker.build(lane.config)
            if bookmark is not None:
                await worker.call(source, "apply_start_bookmark", json.loads(json.dumps(bookmark)))
            pages = await worker.request("pages", source, batch_size, take)
        except Failed as failed:
            raise Divergence(
                WORKS_RULE, f"a read from bookmark {_short(bookmark)} raised {failed.error}"
            ) from None
        finally:
            await worker.stop()
        for number, page in enumerate(pages, 1):
            if len(page.rows) > batch_size:
                raise Divergence(
                    PAGE_RULE, f"page {number} of a read in pages of {batch_size} holds {len(page.rows)} rows"
                )
        return list(pages)

    def _expected(self, lane: _Lane) -> dict[int, str]:
        """What a complete run must deliver: every row not committed in its current version (a
        read without a cursor does not see changes to rows it delivered)."""
        cursor = lane.name == "cursor"
        return {
            i: version
            for i, version in self.rows.items()
            if i not in lane.committed or (cursor and lane.committed[i] != version)
        }

    def _judge(
        self, lane: _Lane, pages: Sequence[PageSeen], committed: Mapping[int, str], complete: bool, start: str
    ) -> None:
        delivered = [(int(row["id"]), str(row["name"])) for page in pages for row in page.rows]
        cursor = lane.name == "cursor"
        replayed = sorted(
            i for i, version in delivered if i in committed and (not cursor or committed[i] == version)
        )
        if replayed:
            raise Divergence(
                RESUME_RULE,
                f"a run {start} delivered {len(replayed)} row(s) committed before: ids {replayed[:6]}",
            )
        twice = sorted({i for i, _ in delivered if sum(1 for j, _ in delivered if j == i) > 1})
        if twice:
            raise Divergence(RESUME_RULE, f"a run {start} delivered ids {twice[:6]} more than once")
        if complete:
            expected = {
                i: version
                for i, version in self.rows.items()
                if i not in committed or (cursor and committed[i] != version)
            }
            got = dict(delivered)
            missing = sorted(i for i in expected if i not in got)
            stale = sorted(i for i in expected if i in got and cursor and got[i] != expected[i])
            if missing or stale:
                what = f"missing ids {missing[:6]}" if missing else f"old versions of ids {stale[:6]}"
                raise Divergence(
                    RESUME_RULE,
                    f"a complete run {start} delivered {len(delivered)} row(s) of the {len(expected)} not "
                    f"yet committed: {what} (skipped)",
                )
        if self.declared.resumable and pages and complete and pages[-1].bookmark is None:
            raise Divergence(
                PAGE_RULE, "a resumable source (state_key() is set) left its final page without a bookmark"
            )

    async def _run(self, step: Run) -> None:
        lane = self.lanes[step.lane]
        if not self.declared.resumable and lane.bookmark is None and lane.committed:
            lane.committed.clear()  # a source that cannot resume reads everything again
        pages = await self._read(lane, lane.bookmark, step.batch_size, step.take)
        self._judge(
            lane,
            pages,
            lane.committed,
            step.take is None or len(pages) < step.take,
            "from the committed bookmark",
        )
        marked = [number for number, page in enumerate(pages) if page.bookmark is not None]
        if not self.declared.resumable:
            return
        if marked:
            last = marked[-1]
            lane.bookmark = pages[last].bookmark
            for page in pages[: last + 1]:
                for row in page.rows:
                    lane.committed[int(row["id"])] = str(row["name"])
        self.trace.note(f"{sum(len(p.rows) for p in pages)} rows in {len(pages)} page(s)")

    async def _resumeeverywhere(self, step: ResumeEverywhere) -> None:
        lane = self.lanes[step.lane]
        if not self.declared.resumable:
            self.trace.note("skipped: the source does not resume")
            return
        self.trace.exercised.add("resumes from every page's bookmark")
        pages = await self._read(lane, lane.bookmark, step.batch_size, None)
        self._judge(lane, pages, lane.committed, True, "from the committed bookmark")
        for number, page in enumerate(pages[:-1]):
            if page.bookmark is None:
                continue
            committed = dict(lane.committed)
            for earlier in pages[: number + 1]:
                for row in earlier.rows:
                    committed[int(row["id"])] = str(row["name"])
            again = await self._read(lane, page.bookmark, step.batch_size, None)
            self._judge(
                lane, again, committed, True, f"from the bookmark of page {number + 1} of {len(pages)}"
            )


def _short(bookmark: Any) -> str:
    text = json.dumps(bookmark)
    return text if len(text) < 120 else text[:117] + "..."


__all__ = [
    "Add",
    "BoundedSourceDeclaration",
    "BoundedSourceRun",
    "Cast",
    "Change",
    "ResumeEverywhere",
    "Run",
    "declaration",
    "generate",
]
