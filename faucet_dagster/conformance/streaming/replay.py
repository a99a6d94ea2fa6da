"""Stream check 8, the replay after the destination commit and before the certificate: a sink's
replay matches the duplicate handling the connector documents
(``ConformanceOptions.replay_duplicates``); a source re-delivers the same events with the same
identities, whichever worker reads them.
"""

from faucet_dagster.conformance.harness import (
    OTHER_WORKER,
    QUIET,
    STREAM,
    WORKER,
    StreamDriver,
    Subject,
    open_sink_session,
    pairs,
    quietly_close,
)
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.conformance.streaming.common import REPLAY_RULE, certified_once, commit_rows, succeeds
from faucet_dagster.protocol import EpochId, Ordering, Role


async def replay_after_commit(subject: Subject) -> Outcome:
    """Interrupted after the destination commit, before the certificate: the replay matches the
    documented duplicate handling (sinks) or re-delivers the same events with the same identities
    (sources)."""
    if subject.role is Role.STREAM_SOURCE:
        return await _source_replay(subject)
    return await _sink_replay(subject)


async def _source_replay(subject: Subject) -> Outcome:
    rows = make_rows(1, 40)
    expected = [row["id"] for row in rows]
    await subject.source_setup.add_rows(rows)
    first = StreamDriver(subject, REPLAY_RULE, acknowledge=False)
    try:
        seen = await succeeds(REPLAY_RULE, "reading", first.read_until(set(expected), QUIET))
    finally:
        await first.close()
    # The replay is another worker's, after a takeover: another worker id, a higher fencing token.
    replay = StreamDriver(subject, REPLAY_RULE, acknowledge=False, worker=OTHER_WORKER)
    try:
        again = await succeeds(REPLAY_RULE, "reading again", replay.read_until(set(expected), QUIET))
    finally:
        await replay.close()
    certified_once(REPLAY_RULE, seen, expected, "the first read")
    # A source promises order only within an ordering domain (a Kafka partition, one NATS stream),
    # so the replay is compared domain by domain unless the source claims one global order.
    strict = subject.stream_source().capabilities().ordering is Ordering.STRICT_GLOBAL
    before, after = _in_promised_order(first.events, strict), _in_promised_order(replay.events, strict)
    if before != after:
        changed = next(
            (
                f"{domain}: {a} then {b}"
                for domain in sorted(before.keys() | after.keys())
                for a, b in zip(before.get(domain, []), after.get(domain, []), strict=False)
                if a != b
            ),
            f"{len(first.events)} then {len(replay.events)} events",
        )
        raise ConformanceFailure(
            REPLAY_RULE,
            f"re-reading from the same certified positions as another worker (fencing token "
            f"{WORKER.fencing_token} then {OTHER_WORKER.fencing_token}) gave other events or identities "
            f"({changed}): an identity is built from the source position, never the worker, lease or "
            "attempt; a deduplicating sink would take the replay for new events",
        )
    return Outcome.passed(f"the replay re-delivered {len(again)} events with the same identities")


def _in_promised_order(
    events: list[tuple[str, str, int, int]], strict_global: bool
) -> dict[str, list[tuple[str, str, int, int]]]:
    """The certified events grouped by the scope whose order the source promises."""
    grouped: dict[str, list[tuple[str, str, int, int]]] = {}
    for event in events:
        grouped.setdefault("*" if strict_global else event[0], []).append(event)
    return grouped


async def _sink_replay(subject: Subject) -> Outcome:
    declared = subject.options.replay_duplicates
    caps = subject.streaming_sink().capabilities()
    backed = {
        "none": caps.atomic_watermark,
        "within_window": caps.dedup_by_event_identity and caps.dedup_window is not None,
        "at_least_once": True,
    }[declared]
    if not backed:
        raise ConformanceFailure(
            REPLAY_RULE,
            f"the connector documents replay_duplicates={declared!r} but its capabilities declare no such "
            f"mechanism (atomic_watermark={caps.atomic_watermark}, dedup_window={caps.dedup_window})",
        )
    rows = make_rows(1, 30)
    epoch = EpochId(STREAM, 1, WORKER.fencing_token)
    session = await open_sink_session(subject, REPLAY_RULE)
    try:
        await commit_rows(subject, session, epoch, rows, REPLAY_RULE)
    finally:
        await quietly_close(session)  # the worker stops before its certificate is persisted
    committed = pairs(await subject.sink_setup.read_back())
    # The replay is another worker's, after a takeover: another worker id, a higher fencing token.
    session = await open_sink_session(
        subject, REPLAY_RULE, token=OTHER_WORKER.fencing_token, worker=OTHER_WORKER.worker_id
    )
    try:
        replayed = EpochId(STREAM, epoch.sequence, OTHER_WORKER.fencing_token)
        receipts = await commit_rows(subject, session, replayed, rows, REPLAY_RULE)
    finally:
        await quietly_close(session)
    after = pairs(await subject.sink_setup.read_back())
    if declared == "at_least_once":
        if set(after) != set(pairs(rows)):
            raise ConformanceFailure(
                REPLAY_RULE, "the replay lost rows (at-least-once allows duplicates, not loss)"
            )
        return Outcome.passed(f"replay kept every row ({len(after) - len(rows)} duplicate(s), as documented)")
    written = sum(receipt.rows_written for receipt in receipts)
    if after != committed or committed != pairs(rows) or written:
        raise ConformanceFailure(
            REPLAY_RULE,
            f"the connector documents replay_duplicates={declared!r}, but replaying a committed epoch of "
            f"{len(rows)} rows took the destination from {len(committed)} to {len(after)} rows "
            f"(receipts: {written} written)",
        )
    return Outcome.passed(f"the replayed epoch added nothing ({declared})")
