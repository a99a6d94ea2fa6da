"""NATS JetStream to NATS JetStream through sensor ticks: the real NATS server and state store.

The source is a stream read by faucet's durable consumer, the sink another stream that deduplicates
by event identity (stream sequence of the source) within its duplicate window.
"""

import asyncio
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import nats
from stream_ticks import chained_ends, evaluate_ticks, stored_ids

from faucet_dagster.declarations.resources import FaucetConnection
from faucet_dagster.protocol import ReadLimits
from faucet_dagster.streams.declaration import FaucetStream


async def setup(url: str, source: str, target: str) -> None:
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        await js.add_stream(name=source, subjects=[f"{source}.>"])
        await js.add_stream(name=target, subjects=[f"{target}.rows"], duplicate_window=60)
    finally:
        await client.close()


async def publish(url: str, stream: str, start: int, count: int) -> None:
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        for i in range(start, start + count):
            await js.publish(f"{stream}.orders", json.dumps({"id": i}).encode())
    finally:
        await client.close()


def test_nats_to_nats_through_sensor_ticks_lands_every_message_once(
    nats_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> None:
    source, target = unique_name("src"), unique_name("dst")
    asyncio.run(setup(nats_url, source, target))
    connection = FaucetConnection(connector="nats", config={"servers": [nats_url]})
    stream = FaucetStream(
        name=unique_name("stream"),
        source=connection.using(stream=source),
        sink=connection.using(
            stream=target, subject=f"{target}.rows", duplicate_window=60, watermark_bucket=f"w_{target}"
        ),
        resources=(source,),
        limits=ReadLimits(records=400, idle=0.5),
        state_url=f"sqlite:///{tmp_path / 'state.db'}",
    )
    sequences, certificates = evaluate_ticks(
        stream,
        [partial(asyncio.run, publish(nats_url, source, batch * 500, 500)) for batch in range(2)],
        rows=1000,
    )
    assert sequences == list(range(1, len(sequences) + 1))
    assert sum(sum(c.row_counts.values()) for c in certificates) == 1000
    assert list(chained_ends(certificates).values()) == ["1000"]
    assert sorted(asyncio.run(stored_ids(nats_url, target))) == list(range(1000))
