"""A stream worker process for the kill test of ``test_stream_postgres_cdc.py``.

``python tests/cdc_worker.py '<json>'`` runs one CDC -> PostgreSQL APPLY_CHANGES stream through the
continuous runner, with the real connectors built from the registry. It prints ``certified N`` for each
certified epoch. When epoch ``hold_epoch`` applies its first batch at the sink (rows staged in the open
destination transaction, the source transaction read only in part), it prints ``holding`` and stops
there, so the test can SIGKILL it at that exact point.

The JSON names ``name``, ``state_url``, ``source`` and ``sink`` (connector configs), ``resources``,
``lease_seconds`` and ``hold_epoch``.
"""

import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from faucet_dagster.protocol import (
    Coverage,
    EpochId,
    ReadLimits,
    Receipt,
    SinkBatch,
    SinkCapabilities,
    SinkCommitState,
    StreamingSink,
    StreamingSinkSession,
    WorkerIdentity,
    WritePolicy,
    get_connector,
)
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.state import StateStore


class HoldingSession(StreamingSinkSession):
    """The real sink session; the first ``apply`` of epoch ``hold`` announces itself and never returns."""

    def __init__(self, inner: StreamingSinkSession, hold: int) -> None:
        self.inner = inner
        self.hold = hold

    async def last_committed(self) -> SinkCommitState | None:
        return await self.inner.last_committed()

    async def begin_epoch(self, epoch: EpochId) -> None:
        await self.inner.begin_epoch(epoch)

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        await self.inner.apply(epoch, batch)
        if epoch.sequence >= self.hold:
            print("holding", flush=True)
            await asyncio.Event().wait()

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        return await self.inner.commit_epoch(epoch, coverage)

    async def abort_epoch(self, epoch: EpochId) -> None:
        await self.inner.abort_epoch(epoch)

    async def close_session(self) -> None:
        await self.inner.close_session()


class HoldingSink(StreamingSink):
    connector_name = "postgres"

    def __init__(self, inner: StreamingSink, hold: int) -> None:
        self.inner = inner
        self.hold = hold

    def capabilities(self) -> SinkCapabilities:
        return self.inner.capabilities()

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> StreamingSinkSession:
        return HoldingSession(await self.inner.open(stream, policy, key, worker), self.hold)


async def work(settings: dict[str, Any]) -> None:
    postgres = get_connector("postgres")
    spec = StreamSpec(
        name=settings["name"],
        source=postgres.stream_source(settings["source"]),
        sink=HoldingSink(postgres.streaming_sink(settings["sink"]), settings["hold_epoch"]),
        resources=tuple(settings["resources"]),
        policy=WritePolicy.APPLY_CHANGES,
        limits=ReadLimits(records=1, idle=0.3),
        lease_seconds=settings["lease_seconds"],
    )
    with StateStore(settings["state_url"]) as store:
        runner = StreamRunner(spec, store, worker_id="doomed")
        while True:
            certificate = await runner.run_epoch()
            if certificate is not None:
                print(f"certified {certificate.sequence}", flush=True)


if __name__ == "__main__":
    asyncio.run(work(json.loads(sys.argv[1])))
