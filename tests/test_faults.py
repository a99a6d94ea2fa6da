"""Crash and recover: every named fault once per pair, on the real servers, judged record by record.

Each case runs a real pipeline in a worker process (the continuous runner the sensor uses, or a
bounded sync), breaks it (see :mod:`faucet_dagster.testing.faults.scenarios`), recovers it with a
fresh worker where the fault allows, and asks the oracle about every produced key (the PostgreSQL
change-data-capture pair: about every row of the source table, which its replica must equal). The
randomized
schedule runs outside the suite: ``python -m faucet_dagster.testing.faults --pairs all
--iterations 200 --seed 7``.

The regressions at the end pin the bugs the harness found, each at the component that had it.
"""

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nats
import pyarrow as pa
import pytest
from faucet_nats.sink import NatsStreamingSink
from faucet_nats.sink_config import NatsSinkConfig
from test_state_store import certificate

from faucet_dagster.protocol import (
    Coverage,
    DomainCoverage,
    EpochId,
    Identities,
    Mode,
    OrderingDomain,
    OwnershipLost,
    Receipt,
    SinkBatch,
    WorkerIdentity,
    WritePolicy,
)
from faucet_dagster.runner.faults import Action
from faucet_dagster.state import Lease, StateStore
from faucet_dagster.testing import NatsServer, PostgresServer, make_unique_name
from faucet_dagster.testing.faults.case import CaseParams
from faucet_dagster.testing.faults.catalog import Fault, FaultKind, Moment, named_faults
from faucet_dagster.testing.faults.harness import random_schedule
from faucet_dagster.testing.faults.oracle import Verdict, judge_state
from faucet_dagster.testing.faults.pairs import PAIRS, Pair, Servers, pair_named
from faucet_dagster.testing.faults.scenarios import run_case
from faucet_dagster.testing.servers import ConformantFetchKafkaServer

CASES = [(pair, fault) for pair in PAIRS for fault in named_faults(pair)]


@pytest.fixture(scope="module")
def servers(postgres_server: PostgresServer, nats_server: NatsServer) -> Iterator[Servers]:
    """The session's servers (restart faults restart them), a database for the sinks, and a broker of
    the module's own: Tansu behind the relay that answers a deleted topic's Fetch as Kafka does (its
    own answer crashes librdkafka, see ConformantFetchKafkaServer), as the harness's command runs it."""
    name = make_unique_name("faults")
    with ConformantFetchKafkaServer() as kafka:
        yield Servers(postgres_server, nats_server, kafka, postgres_server.create_database(name))
    postgres_server.start()
    postgres_server.drop_database(name)


@pytest.mark.parametrize(
    ("pair", "fault"), CASES, ids=[f"{pair.name}:{fault.name.replace(' ', '_')}" for pair, fault in CASES]
)
def test_every_record_survives_the_fault_or_the_stream_halts_explicitly(
    servers: Servers, tmp_path: Path, pair: Pair, fault: Fault
) -> None:
    # Bounded syncs are fast: small pages keep a random moment inside the run.
    size = 100 if pair.mode is Mode.BOUNDED else 400
    params = CaseParams(records=2_000, epoch_records=size)
    result = run_case(servers, tmp_path / "run0", pair, fault, params)
    for again in range(1, 3 if fault.kind is FaultKind.RANDOM else 1):
        if result.fired:
            break
        # A signal at a random moment can come after a fast worker finished (the test process starved
        # on a loaded machine while it polled): the case proved nothing, so it runs again.
        result = run_case(servers, tmp_path / f"run{again}", pair, fault, params)
    assert result.fired, f"the fault did not happen as scheduled: {result.notes}"
    assert result.halted_correctly, result.notes
    verdict = result.verdict
    assert verdict.lost == 0 and verdict.unexpected == 0, verdict
    if not result.duplicates_allowed:
        assert verdict.duplicated == 0, verdict
    halting = (FaultKind.RESTART, FaultKind.RECREATE, FaultKind.PURGE, FaultKind.DDL, FaultKind.RETENTION)
    halting += (FaultKind.SNAPSHOT_CRASH,)  # it deletes rows at the source before the recovery
    halting += (FaultKind.DELETE,)  # the source is gone: what was not read is never delivered
    if fault.kind not in halting:
        # Every record produced (a page crash adds some before its rerun) is judged, and found.
        assert verdict.records >= 2_000 and verdict.found >= verdict.records, verdict
    assert result.passed


def test_the_state_oracle_finds_stale_missing_resurrected_and_reapplied_rows() -> None:
    """The oracle of the change-data-capture pair fails each way a replica can be wrong."""

    def row(seq: int, version: int) -> dict[str, object]:
        return {"producer": "p", "seq": seq, "id": seq, "version": version, "note": "n"}

    source = {("p", seq): row(seq, 1) for seq in range(4)}
    replica = [(key, {**value, "extra": None}) for key, value in source.items()]
    lease = Lease("s", "w", 1, 0.0)
    clean = certificate(lease, 1, None, "9")
    counted = dataclasses.replace(
        clean,
        receipts=(Receipt("r", 4, 0, {"unexpected_inserts": "0", "unexpected_changes": "0"}),),
    )
    assert judge_state(source, replica, [counted]) == Verdict(4, 4, 0, 0, 0), "extra columns are not compared"
    broken = [
        (("p", 0), row(0, 0)),  # an update lost
        (("p", 2), row(2, 1)),  # row 1 missing: its insert lost
        (("p", 3), row(3, 1)),
        (("p", 3), row(3, 1)),  # twice
        (("p", 9), row(9, 1)),  # deleted at the source
    ]
    assert judge_state(source, broken, [counted]) == Verdict(4, 5, 2, 1, 1)
    reapplied = dataclasses.replace(
        clean,
        receipts=(Receipt("r", 4, 0, {"unexpected_inserts": "2", "unexpected_changes": "1"}),),
    )
    assert judge_state(source, replica, [counted, reapplied]) == Verdict(4, 4, 1, 2, 0)
    with pytest.raises(KeyError):  # a receipt that wrote rows without the counts cannot be judged
        judge_state(source, replica, [clean])


# -- regressions found by the harness ---------------------------------------------------------------


def test_a_zombie_frozen_in_its_first_epoch_does_not_block_its_successor(
    servers: Servers, tmp_path: Path
) -> None:
    """Found by zombie@before_commit at hit 1 on NATS -> PostgreSQL (and CDC -> PostgreSQL): the frozen
    owner's first epoch held its uncommitted CREATE TABLE, and the successor's CREATE TABLE IF NOT
    EXISTS waited for it forever. Now the successor's lock waits end after lock_timeout (retryably,
    retried) and the server ends the frozen transaction after idle_in_transaction_session_timeout."""
    fault = Fault(FaultKind.ZOMBIE, Action.STOP, Moment.BEFORE_COMMIT)
    params = CaseParams(records=1_200, epoch_records=400, hit=1)
    result = run_case(servers, tmp_path, pair_named("nats-postgres"), fault, params)
    assert result.fired and result.halted_correctly, result.notes
    assert result.verdict.lost == 0 and result.verdict.unexpected == 0, result.verdict
    assert result.verdict.records == 1_200 and result.passed, result.verdict


DOMAIN = OrderingDomain("kafka", "orders", "0", "cluster:topic", "kafka.offset")


def sink_batch(epoch: EpochId, start: int, count: int) -> SinkBatch:
    rows = pa.RecordBatch.from_pylist([{"id": i} for i in range(start, start + count)])
    return SinkBatch(epoch, "orders", DOMAIN, rows, Identities([str(i) for i in range(start, start + count)]))


def test_a_worker_that_lost_its_lease_cannot_move_the_nats_sink_watermark_back(
    nats_url: str, unique_name: Callable[..., str]
) -> None:
    """Found by zombie@before_commit on Kafka -> NATS: the resumed owner's commit overwrote its
    successor's watermark with an older epoch, so the next worker's reconciliation refused the
    stream (IntegrityError: the destination behind its certificates)."""
    target = unique_name("out")
    config = NatsSinkConfig(
        servers=(nats_url,),
        stream=target,
        subject=f"{target}.rows",
        duplicate_window=60,
        watermark_bucket=f"w_{target}",
    )

    async def scenario() -> None:
        client = await nats.connect(nats_url)
        try:
            await client.jetstream().add_stream(name=target, subjects=[f"{target}.rows"], duplicate_window=60)
        finally:
            await client.close()
        sink = NatsStreamingSink(config)
        old = await sink.open("s", WritePolicy.APPEND, (), WorkerIdentity("old", 1))
        new = await sink.open("s", WritePolicy.APPEND, (), WorkerIdentity("new", 2))
        try:
            first = EpochId("s", 1, 1)
            await old.begin_epoch(first)
            await old.apply(first, sink_batch(first, 0, 10))
            await old.commit_epoch(first, Coverage((DomainCoverage(DOMAIN, None, "9"),)))
            # The old worker starts epoch 2, then stalls; its successor commits epochs 2 and 3.
            stale = EpochId("s", 2, 1)
            await old.begin_epoch(stale)
            await old.apply(stale, sink_batch(stale, 10, 10))
            for sequence, start in ((2, 10), (3, 20)):
                epoch = EpochId("s", sequence, 2)
                await new.begin_epoch(epoch)
                await new.apply(epoch, sink_batch(epoch, start, 10))
                await new.commit_epoch(
                    epoch, Coverage((DomainCoverage(DOMAIN, str(start - 1), str(start + 9)),))
                )
            with pytest.raises(OwnershipLost, match="fencing token 2"):
                await old.commit_epoch(stale, Coverage((DomainCoverage(DOMAIN, "9", "19"),)))
            await old.abort_epoch(stale)
            state = await new.last_committed()
            assert state is not None and state.epoch == EpochId("s", 3, 2)
            assert [position.value for position in state.watermarks] == ["29"]
        finally:
            await old.close_session()
            await new.close_session()

    asyncio.run(scenario())


def test_a_certificate_of_a_worker_that_lost_its_lease_is_refused_as_ownership_lost(tmp_path: Path) -> None:
    """Found by zombie@before_commit on Kafka -> NATS: the resumed owner's certificate for an epoch
    its successor had certified was refused as an IntegrityError (a conflict), which a sensor tick
    reports as a broken stream, instead of OwnershipLost (another worker runs the stream)."""
    with StateStore(f"sqlite:///{tmp_path / 'state.db'}") as store:
        old = store.acquire_lease("s", "old", 0.2)
        assert store.append_certificate(certificate(old, 1, None, "9"), old)
        time.sleep(0.3)
        new = store.acquire_lease("s", "new", 30)
        assert store.append_certificate(certificate(new, 2, "9", "19"), new)
        with pytest.raises(OwnershipLost, match="leased to new"):
            store.append_certificate(certificate(old, 2, "9", "15"), old)
        with pytest.raises(OwnershipLost, match="leased to new"):
            store.append_certificate(certificate(old, 3, "15", "20"), old)
        assert [(c.sequence, c.worker) for c in store.certificates("s")] == [(1, "old"), (2, "new")]


def test_a_zombie_apply_changes_epoch_is_fenced_before_it_is_judged_for_divergence(
    servers: Servers, tmp_path: Path
) -> None:
    """Found by the randomized schedule (seed 2026, case 192: cdc-postgres zombie@before_commit): the
    resumed owner's APPLY_CHANGES epoch was applied before the sink checked its fence, so the rows its
    successor had replicated meanwhile made the sink refuse it as a diverged replica (IntegrityError)
    instead of as fenced (OwnershipLost). Nothing was committed either way, but a zombie must be told
    it lost the stream, not that the replica diverged."""
    (case,) = [case for case in random_schedule(2026, 200, list(PAIRS)) if case.index == 192]
    assert (case.pair.name, case.fault.kind) == ("cdc-postgres", FaultKind.ZOMBIE)
    result = run_case(servers, tmp_path, case.pair, case.fault, case.params)
    assert result.fired, result.notes
    assert result.halted_correctly and result.passed, result.notes
    assert result.verdict.lost == 0 and result.verdict.duplicated == 0, result.verdict
