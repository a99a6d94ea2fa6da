"""The Delta Lake streaming sink on real Delta tables (delta-rs): local folders, and S3 (moto's server
on loopback) for a stream's epochs, its replay and its fence.

Faults are injected at exact points: another worker's claim of the stream committed between this
worker's snapshot and its Delta commit (what a second process does there), a commit of the same
stream landing there. The runner-level faults (a crash after the commit, before the certificate) are
in ``tests/test_stream_nats_tables.py``; the conformance battery runs the rest.
"""

import asyncio
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from faucet_delta.stream_config import DeltaStreamingSinkConfig
from faucet_delta.stream_sink import DeltaStreamingSink

from faucet_dagster.protocol import (
    ConfigError,
    Coverage,
    DomainCoverage,
    EpochId,
    Identities,
    OrderingDomain,
    OwnershipLost,
    Receipt,
    Role,
    SchemaError,
    SinkBatch,
    StreamingSinkSession,
    WorkerIdentity,
    WritePolicy,
    get_connector,
)
from faucet_dagster.testing import S3Server

DOMAIN = OrderingDomain("nats", "orders", "0", "incarnation-1", "nats.stream_sequence")
STREAM = "orders"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def batch(epoch: EpochId, ids: Sequence[int], version: int = 1, **extra: Any) -> SinkBatch:
    rows = pa.RecordBatch.from_pylist([{"id": i, "name": f"n{i}v{version}", **extra} for i in ids])
    return SinkBatch(epoch, "orders", DOMAIN, rows, Identities([str(i) for i in ids]))


def covering(ids: Sequence[int]) -> Coverage:
    return Coverage((DomainCoverage(DOMAIN, None, str(max(ids))),))


def streaming(
    path: Path, before_commit: Callable[[], None] | None = None, **config: Any
) -> DeltaStreamingSink:
    return DeltaStreamingSink(DeltaStreamingSinkConfig(uri=str(path), **config), before_commit=before_commit)


async def epoch_of(
    session: StreamingSinkSession, epoch: EpochId, *batches: SinkBatch, ids: Sequence[int]
) -> tuple[Receipt, ...]:
    await session.begin_epoch(epoch)
    for item in batches:
        await session.apply(epoch, item)
    return await session.commit_epoch(epoch, covering(ids))


def rows(path: Path, *columns: str) -> list[tuple[Any, ...]]:
    table = DeltaTable(str(path)).to_pyarrow_table(columns=list(columns) or None)
    return sorted(tuple(row.values()) for row in table.to_pylist())


def claim_directly(path: Path, token: int) -> None:
    """Another process's newer worker claiming the stream: an empty commit of the owner identifier."""
    table = DeltaTable(str(path))
    empty = pa.Table.from_batches([], schema=pa.schema(table.schema().to_arrow()))
    owner = CommitProperties(app_transactions=[Transaction(f"faucet:{path.name}:owner:{STREAM}", token)])
    write_deltalake(table, empty, mode="append", commit_properties=owner)


def test_registered_as_a_streaming_sink_declaring_append_upsert_fencing_and_the_atomic_watermark(
    tmp_path: Path,
) -> None:
    spec = get_connector("delta")
    assert Role.STREAMING_SINK in spec.roles and Role.SINK in spec.roles
    caps = spec.streaming_sink({"uri": str(tmp_path / "t")}).capabilities()
    assert caps.continuous_policies == {WritePolicy.APPEND, WritePolicy.UPSERT} and not caps.bounded_policies
    assert caps.atomic_watermark and caps.owner_fencing and caps.schema_evolution
    with pytest.raises(ConfigError, match="mode"):
        spec.streaming_sink({"uri": str(tmp_path / "t"), "mode": "append"})


def test_an_epoch_is_one_commit_carrying_its_epoch_owner_and_domain_watermark_identifiers(
    tmp_path: Path,
) -> None:
    path = tmp_path / "orders"

    async def scenario() -> tuple[Any, ...]:
        session = await streaming(path).open(STREAM, WritePolicy.APPEND, (), WorkerIdentity("w", 3))
        one, two = EpochId(STREAM, 1, 3), EpochId(STREAM, 2, 3)
        first = await epoch_of(session, one, batch(one, [1, 2]), batch(one, [3]), ids=[1, 2, 3])
        second = await epoch_of(session, two, batch(two, [4, 5]), ids=[4, 5])
        state = await session.last_committed()
        await session.close_session()
        return first, second, state

    first, second, state = run(scenario())
    table = DeltaTable(str(path))
    assert table.version() == 1, "a missing table is created by the first epoch; one commit per epoch"
    assert [int(r.details["version"]) for r in (*first, *second)] == [0, 1]
    assert (first[0].rows_written, second[0].rows_written) == (3, 2)
    assert table.transaction_version(f"faucet:orders:epoch:{STREAM}") == 2
    assert table.transaction_version(f"faucet:orders:owner:{STREAM}") == 3
    assert table.transaction_version(f"faucet:orders:watermark:{STREAM}@nats/orders/0") == 5
    assert state.epoch == EpochId(STREAM, 2, 3) and [p.value for p in state.watermarks] == ["5"]
    assert rows(path, "id") == [(i,) for i in range(1, 6)]


def test_a_stale_owner_whose_snapshot_predates_a_newer_claim_conflicts_and_is_fenced(tmp_path: Path) -> None:
    path = tmp_path / "orders"
    run(_first_epoch(path))
    claims: list[int] = []

    def newer_worker_claims() -> None:  # between the stale worker's snapshot read and its commit
        if not claims:
            claims.append(9)
            claim_directly(path, 9)

    async def stale() -> None:
        session = await streaming(path, newer_worker_claims).open(
            STREAM, WritePolicy.APPEND, (), WorkerIdentity("old", 1)
        )
        epoch = EpochId(STREAM, 2, 1)
        try:
            with pytest.raises(OwnershipLost, match="fencing token 9"):
                await epoch_of(session, epoch, batch(epoch, [10, 11]), ids=[10, 11])
            await session.abort_epoch(epoch)
        finally:
            await session.close_session()

    run(stale())
    assert claims == [9], "the newer claim was not injected"
    assert rows(path, "id") == [(1,)], "the stale worker's epoch landed"
    assert DeltaTable(str(path)).transaction_version(f"faucet:orders:owner:{STREAM}") == 9
    with pytest.raises(OwnershipLost):
        run(streaming(path).open(STREAM, WritePolicy.APPEND, (), WorkerIdentity("older", 4)))


async def _first_epoch(path: Path, token: int = 1) -> None:
    session = await streaming(path).open(STREAM, WritePolicy.APPEND, (), WorkerIdentity("w", token))
    epoch = EpochId(STREAM, 1, token)
    await epoch_of(session, epoch, batch(epoch, [1]), ids=[1])
    await session.close_session()


def test_a_commit_of_the_same_epoch_landing_after_the_snapshot_makes_the_replay_skip_its_rows(
    tmp_path: Path,
) -> None:
    path = tmp_path / "orders"
    run(_first_epoch(path))
    epoch = EpochId(STREAM, 2, 1)
    landed: list[int] = []

    def the_same_epoch_commits_elsewhere() -> None:  # an earlier, uncertain commit of the epoch
        if not landed:
            landed.append(_commit_in_another_process(path, epoch))

    async def replay() -> tuple[Receipt, ...]:
        session = await streaming(path, the_same_epoch_commits_elsewhere).open(
            STREAM, WritePolicy.APPEND, (), WorkerIdentity("w", 1)
        )
        try:
            return await epoch_of(session, epoch, batch(epoch, [2, 3, 4]), ids=[2, 3, 4])
        finally:
            await session.close_session()

    receipts = run(replay())
    assert landed == [3]
    assert (receipts[0].rows_written, receipts[0].rows_skipped) == (0, 3)
    assert rows(path, "id") == [(1,), (2,), (3,), (4,)]


def test_a_first_epoch_whose_table_another_writer_created_meanwhile_is_judged_by_its_commit(
    tmp_path: Path,
) -> None:
    """No table when the epoch's snapshot was read; the same epoch committed elsewhere creates it before
    this commit: the first commit must not append blindly, it retries and skips the epoch's rows."""
    path = tmp_path / "orders"
    epoch = EpochId(STREAM, 1, 1)
    landed: list[int] = []

    def the_same_epoch_creates_the_table_elsewhere() -> None:
        if not landed:
            landed.append(_commit_in_another_process(path, epoch))

    async def first() -> tuple[Receipt, ...]:
        session = await streaming(path, the_same_epoch_creates_the_table_elsewhere).open(
            STREAM, WritePolicy.APPEND, (), WorkerIdentity("w", 1)
        )
        try:
            return await epoch_of(session, epoch, batch(epoch, [2, 3, 4]), ids=[2, 3, 4])
        finally:
            await session.close_session()

    receipts = run(first())
    assert landed == [3]
    assert (receipts[0].rows_written, receipts[0].rows_skipped) == (0, 3)
    assert rows(path, "id") == [(2,), (3,), (4,)]


_ELSEWHERE = """
import asyncio, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import test_delta_stream_sink as t
from faucet_dagster.protocol import EpochId, WorkerIdentity, WritePolicy

async def main():
    epoch = EpochId(t.STREAM, {sequence}, {token})
    worker = WorkerIdentity("w", {token})
    session = await t.streaming(Path({path!r})).open(t.STREAM, WritePolicy.APPEND, (), worker)
    receipts = await t.epoch_of(session, epoch, t.batch(epoch, [2, 3, 4]), ids=[2, 3, 4])
    await session.close_session()
    print(receipts[0].rows_written)

asyncio.run(main())
"""


def _commit_in_another_process(path: Path, epoch: EpochId) -> int:
    """The epoch committed by another process (this one holds the table's lock meanwhile)."""
    code = _ELSEWHERE.format(
        tests=str(Path(__file__).parent), sequence=epoch.sequence, token=epoch.fencing_token, path=str(path)
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return int(done.stdout.strip())


def test_upsert_merges_the_epoch_by_key_the_last_row_winning_and_merges_new_columns(tmp_path: Path) -> None:
    path = tmp_path / "orders"

    async def scenario() -> None:
        session = await streaming(path).open(STREAM, WritePolicy.UPSERT, ("id",), WorkerIdentity("w", 1))
        one, two = EpochId(STREAM, 1, 1), EpochId(STREAM, 2, 1)
        await epoch_of(session, one, batch(one, [1, 2]), ids=[1, 2])
        updates = SinkBatch(
            two, "orders", DOMAIN, batch(two, [1, 2], 2, note="x").records, Identities(["3", "4"])
        )
        late = SinkBatch(two, "orders", DOMAIN, batch(two, [2], 3).records, Identities(["5"]))
        await epoch_of(session, two, updates, late, ids=[5])
        await session.close_session()

    run(scenario())
    assert rows(path, "id", "name", "note") == [(1, "n1v2", "x"), (2, "n2v3", None)]


def test_schema_evolution_off_refuses_a_new_column_and_the_epoch_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "orders"
    run(_first_epoch(path))

    async def scenario() -> None:
        session = await streaming(path, schema_evolution=False).open(
            STREAM, WritePolicy.APPEND, (), WorkerIdentity("w", 1)
        )
        epoch = EpochId(STREAM, 2, 1)
        try:
            with pytest.raises(SchemaError, match="note"):
                await epoch_of(session, epoch, batch(epoch, [2], note="x"), ids=[2])
            await session.abort_epoch(epoch)
            assert (await session.last_committed()).epoch.sequence == 1
        finally:
            await session.close_session()

    run(scenario())
    assert rows(path, "id") == [(1,)]


def test_an_epoch_without_rows_moves_the_watermark_and_commits_nothing_before_the_table_exists(
    tmp_path: Path,
) -> None:
    path = tmp_path / "orders"

    async def scenario() -> tuple[Any, Any]:
        session = await streaming(path).open(STREAM, WritePolicy.APPEND, (), WorkerIdentity("w", 1))
        one, two, three = (EpochId(STREAM, n, 1) for n in (1, 2, 3))
        await epoch_of(session, one, ids=[1])
        before_table = await session.last_committed()
        await epoch_of(session, two, batch(two, [2]), ids=[2])
        await epoch_of(session, three, ids=[7])
        after = await session.last_committed()
        await session.close_session()
        return before_table, after

    before_table, after = run(scenario())
    assert before_table is None
    assert DeltaTable(str(path)).version() == 1, "epoch 2 created the table, epoch 3 committed no files"
    assert after.epoch.sequence == 3 and [p.value for p in after.watermarks] == ["7"]
    assert rows(path, "id") == [(2,)]


def test_a_streams_name_cannot_spell_another_streams_identifier(tmp_path: Path) -> None:
    path = tmp_path / "orders"

    async def scenario() -> tuple[Receipt, ...]:
        run_on = await streaming(path).open("s", WritePolicy.APPEND, (), WorkerIdentity("w", 1))
        other = await streaming(path).open("s:owner", WritePolicy.APPEND, (), WorkerIdentity("v", 1))
        first, later = EpochId("s", 1, 1), EpochId("s:owner", 5, 1)
        await epoch_of(run_on, first, batch(first, [1]), ids=[1])
        await epoch_of(other, later, batch(later, [2]), ids=[2])  # its epoch 5 is not s's owner at 5
        second = EpochId("s", 2, 1)
        receipts = await epoch_of(run_on, second, batch(second, [3]), ids=[3])
        await run_on.close_session()
        await other.close_session()
        return receipts

    assert run(scenario())[0].rows_written == 1
    assert rows(path, "id") == [(1,), (2,), (3,)]


def test_on_s3_epochs_land_once_a_replay_is_skipped_and_a_stale_owner_is_fenced(
    s3_server: S3Server, s3_bucket: str
) -> None:
    uri = f"s3://{s3_bucket}/lake/orders"
    s3 = {
        "endpoint_url": s3_server.endpoint_url,
        "region": s3_server.region,
        "access_key_id": s3_server.access_key_id,
        "secret_access_key": s3_server.secret_access_key,
        "allow_http": True,
    }
    config = DeltaStreamingSinkConfig.model_validate({"uri": uri, "s3": s3})
    options = config.table().storage_options()

    def table() -> DeltaTable:
        return DeltaTable(uri, storage_options=options)

    def newer_worker_claims() -> None:  # between the stale worker's snapshot read and its commit
        stored = table()
        empty = pa.Table.from_batches([], schema=pa.schema(stored.schema().to_arrow()))
        owner = CommitProperties(app_transactions=[Transaction(f"faucet:orders:owner:{STREAM}", 9)])
        write_deltalake(stored, empty, mode="append", commit_properties=owner)

    async def scenario() -> tuple[tuple[Receipt, ...], ...]:
        worker = WorkerIdentity("w", 3)
        session = await DeltaStreamingSink(config).open(STREAM, WritePolicy.APPEND, (), worker)
        one, two = EpochId(STREAM, 1, 3), EpochId(STREAM, 2, 3)
        first = await epoch_of(session, one, batch(one, [1, 2]), ids=[1, 2])  # creates the table
        second = await epoch_of(session, two, batch(two, [3]), ids=[3])
        await session.close_session()
        again = await DeltaStreamingSink(config).open(STREAM, WritePolicy.APPEND, (), worker)
        replayed = await epoch_of(again, two, batch(two, [3]), ids=[3])  # a replay after a crash
        await again.close_session()
        stale = await DeltaStreamingSink(config, before_commit=newer_worker_claims).open(
            STREAM, WritePolicy.APPEND, (), worker
        )
        three = EpochId(STREAM, 3, 3)
        try:
            with pytest.raises(OwnershipLost, match="fencing token 9"):
                await epoch_of(stale, three, batch(three, [4]), ids=[4])
            await stale.abort_epoch(three)
        finally:
            await stale.close_session()
        return first, second, replayed

    first, second, replayed = run(scenario())
    receipts = (*first, *second)
    assert [r.details["version"] for r in receipts] == ["0", "1"]
    assert {(r.details["database"], r.details["table"], r.details["uri"]) for r in receipts} == {
        ("lake", "orders", f"delta+{uri}")
    }
    assert (replayed[0].rows_written, replayed[0].rows_skipped) == (0, 1)
    stored = table()
    assert stored.transaction_version(f"faucet:orders:epoch:{STREAM}") == 2
    assert stored.transaction_version(f"faucet:orders:owner:{STREAM}") == 9
    assert stored.transaction_version(f"faucet:orders:watermark:{STREAM}@nats/orders/0") == 3
    ids = sorted(row["id"] for row in stored.to_pyarrow_table(columns=["id"]).to_pylist())
    assert ids == [1, 2, 3], "an epoch landed twice, or the stale worker's landed"
