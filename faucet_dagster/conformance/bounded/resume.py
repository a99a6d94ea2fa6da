"""FCP check 3: a run started from a bookmark (kept as JSON) replays nothing committed and skips
nothing.
"""

import json

from faucet_dagster.conformance.bounded.common import RESUME_RULE, expect_unsupported, read_all
from faucet_dagster.conformance.harness import Subject, ids_of
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.setup import make_rows


async def resume(subject: Subject) -> Outcome:
    """From a bookmark (kept as JSON), a new read returns exactly the rows after it."""
    setup, size = subject.source_setup, subject.options.batch_size
    probe = subject.source()
    if probe.state_key() is None:
        await expect_unsupported(lambda: probe.apply_start_bookmark({}), "apply_start_bookmark")
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
