"""Pipelined epochs: the next epoch is read while the last one commits, certifies and acknowledges.

What holds, each with a fault at an exact point (the in-memory doubles of ``stream_doubles``: its
source session refuses a call while another runs, its sink session refuses to begin an epoch while
one is active; the state store is real, SQLite):

* epoch N+1 is read while epoch N's commit waits; it is begun at the sink only after that commit;
* certificates are persisted in sequence, and each acknowledgement follows its certificate, in sequence;
* a failed commit rewinds the read-ahead: nothing of it reaches the sink, the source reopens at the
  certified positions, and the next run certifies everything once;
* a certificate lost after the read-ahead began at the sink aborts it there too, and the next run
  recovers the committed epoch without duplicates.
"""

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from stream_doubles import MemoryDestination, MemoryLog, MemorySession, MemorySink, MemorySource, SinkFaults
from test_continuous_runner import run

from faucet_dagster.protocol import (
    Authority,
    ConnectionFailed,
    Coverage,
    EpochCertificate,
    EpochId,
    ReadLimits,
)
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.state import Lease, StateStore

WAIT = 10.0
"""How long a held commit waits for the read-ahead it expects (generous: a loaded machine)."""


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    return StateStore(f"sqlite:///{tmp_path / 'state.db'}")


def runner(store: StateStore, source: MemorySource, sink: MemorySink) -> StreamRunner:
    spec = StreamSpec(
        name="s",
        source=source,
        sink=sink,
        resources=("items",),
        limits=ReadLimits(records=100, idle=0.05, age=5.0),
        lease_seconds=30.0,
    )
    return StreamRunner(spec, store, worker_id="w1")


def ids_of(destination: MemoryDestination) -> list[int]:
    return [row["id"] for row in destination.rows]


async def until(condition: Callable[[], bool]) -> bool:
    """Wait (at most ``WAIT``) for ``condition``; whether it held."""
    loop = asyncio.get_running_loop()
    ends = loop.time() + WAIT
    while not condition():
        if loop.time() >= ends:
            return False
        await asyncio.sleep(0.01)
    return True


def test_the_next_epoch_is_read_while_the_last_one_commits(store: StateStore) -> None:
    log = MemoryLog()
    log.append(300)
    read_while_committing: dict[int, bool] = {}
    source = MemorySource(log)

    async def before_commit(epoch: EpochId) -> None:
        # Held until the source was read for the next epoch (past row 100 for epoch 1), if it comes.
        end = epoch.sequence * 100
        if end < len(log.rows):
            read_while_committing[epoch.sequence] = await until(
                lambda: any(session.position > end for session in source.sessions)
            )

    sink = MemorySink(faults=SinkFaults(before_commit=before_commit))
    certificates = run(lambda: _epochs_then_close(runner(store, source, sink)))
    assert [c.row_counts for c in certificates] == [{"items": 100}] * 3
    assert read_while_committing[1] and read_while_committing[2], read_while_committing
    # One active epoch per sink session: each begin follows the commit before it.
    calls = [call for call in sink.destination.calls if not call.startswith("apply")]
    assert calls == ["begin 1", "commit 1", "begin 2", "commit 2", "begin 3", "commit 3", "close"]
    assert ids_of(sink.destination) == list(range(1, 301))


async def _epochs_then_close(stream: StreamRunner) -> list[EpochCertificate]:
    try:
        return await stream.run_epochs(budget_seconds=60)
    finally:
        await stream.close()


def test_certificates_and_acknowledgements_stay_in_sequence(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = MemoryLog()
    log.append(500)
    events: list[tuple[str, int]] = []
    append = store.append_certificate

    def append_certificate(certificate: EpochCertificate, lease: Lease) -> bool:
        stored = append(certificate, lease)
        events.append(("certificate", certificate.sequence))
        return stored

    monkeypatch.setattr(store, "append_certificate", append_certificate)
    acknowledge = MemorySession.acknowledge

    async def acknowledging(session: MemorySession, coverage: Coverage, authority: Authority) -> None:
        events.append(("acknowledgement", int(coverage.domains[0].end) // 100))
        await acknowledge(session, coverage, authority)

    monkeypatch.setattr(MemorySession, "acknowledge", acknowledging)

    async def uneven_commit(epoch: EpochId) -> None:
        await asyncio.sleep(0.05 * (epoch.sequence % 2))

    source = MemorySource(log)
    sink = MemorySink(faults=SinkFaults(before_commit=uneven_commit))
    certificates = run(lambda: _epochs_then_close(runner(store, source, sink)))
    assert [c.sequence for c in certificates] == [1, 2, 3, 4, 5]
    assert [kind_sequence[1] for kind_sequence in events if kind_sequence[0] == "certificate"] == [
        1,
        2,
        3,
        4,
        5,
    ]
    assert [kind_sequence[1] for kind_sequence in events if kind_sequence[0] == "acknowledgement"] == [
        1,
        2,
        3,
        4,
        5,
    ]
    for sequence in range(1, 6):
        assert events.index(("certificate", sequence)) < events.index(("acknowledgement", sequence)), events
    assert log.acknowledgements == [100, 200, 300, 400, 500]
    assert ids_of(sink.destination) == list(range(1, 501))


def test_a_failed_commit_rewinds_the_read_ahead(store: StateStore) -> None:
    log = MemoryLog()
    log.append(400)
    seen: dict[str, Any] = {}

    async def before_commit(epoch: EpochId) -> None:
        if epoch.sequence == 2 and "failed" not in seen:
            # Epoch 3 is read ahead (rows 201..300 held in its pipeline) before this commit fails.
            seen["read_ahead"] = await until(lambda: any(s.position >= 300 for s in source.sessions))
            seen["failed"] = True
            raise ConnectionFailed("the destination refused the commit", where="memory")

    source = MemorySource(log)
    sink = MemorySink(faults=SinkFaults(before_commit=before_commit))
    stream = runner(store, source, sink)

    async def scenario() -> list[EpochCertificate]:
        with pytest.raises(ConnectionFailed, match="refused the commit"):
            await stream.run_epochs(budget_seconds=60)
        assert [c.sequence for c in store.certificates("s")] == [1]
        assert log.acknowledgements == [100]
        return await _epochs_then_close(stream)

    certificates = run(scenario)
    assert seen["read_ahead"], "epoch 3 was not read while epoch 2 committed"
    calls = sink.destination.calls
    # Epoch 3 never reached the sink before epoch 2's commit failed: its held batches were dropped.
    assert calls.index("abort 2") < calls.index("begin 3"), calls
    assert calls.count("begin 3") == 1, calls
    # The source was rewound: reopened after epoch 1, the last certified position.
    assert [str(p[0].value) for p in source.opened_at[1:]] == ["100"]
    assert [c.row_counts for c in certificates] == [{"items": 100}] * 3
    assert [c.sequence for c in store.certificates("s")] == [1, 2, 3, 4]
    assert ids_of(sink.destination) == list(range(1, 401))
    assert log.acknowledgements == [100, 200, 300, 400]


def test_a_certificate_lost_after_the_read_ahead_began_at_the_sink_aborts_it_there(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = MemoryLog()
    log.append(400)
    destination = MemoryDestination()
    append = store.append_certificate
    seen: dict[str, Any] = {}

    def append_certificate(certificate: EpochCertificate, lease: Lease) -> bool:
        if certificate.sequence == 2 and "lost" not in seen:
            # Epoch 3 began at the sink (after epoch 2's commit) and applied rows; then the store
            # goes away (this runs in the worker thread of the append).
            seen["began"] = _wait_in_thread(lambda: "apply 3 100" in destination.calls)
            seen["lost"] = True
            raise ConnectionFailed("the state store went away", where="test")
        return append(certificate, lease)

    monkeypatch.setattr(store, "append_certificate", append_certificate)
    first = runner(store, MemorySource(log), MemorySink(destination))
    with pytest.raises(ConnectionFailed, match="state store went away"):
        run(lambda: first.run_epochs(budget_seconds=60))
    assert seen["began"], "epoch 3 had not begun at the sink when the certificate was lost"
    assert "abort 3" in destination.calls and destination.calls[-1] == "close"
    assert [c.sequence for c in store.certificates("s")] == [1]
    run(first.close)
    # The next run finds the destination one epoch ahead (epoch 2 committed, no certificate),
    # recovers it, and goes on: every row once.
    recovering = runner(store, MemorySource(log), MemorySink(destination))
    run(lambda: _epochs_then_close(recovering))
    assert [c.sequence for c in store.certificates("s")] == [1, 2, 3, 4]
    assert ids_of(destination) == list(range(1, 401))


def _wait_in_thread(condition: Callable[[], bool]) -> bool:
    ends = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() >= ends:
            return False
        time.sleep(0.01)
    return True
