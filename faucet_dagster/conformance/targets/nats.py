"""NATS JetStream: the source (a stream and its durable consumer) and the sink (a stream read back)."""

import contextlib
import json
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from faucet_dagster.conformance.setup import Row, SinkSetup, SourceSetup
from faucet_dagster.conformance.targets._common import (
    T,
    closed_port,
    process_stopped,
    refused_rows,
    run_setup,
)
from faucet_dagster.testing import NatsServer


async def _nats(url: str, work: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
    import nats

    client = await nats.connect(url)
    try:
        return await work(client)
    finally:
        await client.close()


def _nats_unreachable(config: Mapping[str, Any]) -> dict[str, Any]:
    return {**config, "servers": [f"nats://127.0.0.1:{closed_port()}"], "connect_timeout": 1}


def nats_source(nats_url: str, unique_name: Callable[..., str]) -> SourceSetup:
    """A fresh JetStream stream of JSON messages (``<stream>.items``); the source's durable consumer
    acknowledges within one second, so the slow sink outlasts it."""
    stream = unique_name("s")

    async def create(client: Any) -> None:
        await client.jetstream().add_stream(name=stream, subjects=[f"{stream}.>"])

    run_setup(lambda: _nats(nats_url, create))

    async def publish(payloads: Sequence[bytes]) -> None:
        async def send(client: Any) -> None:
            jetstream = client.jetstream()
            for payload in payloads:  # in order: the stream sequence is the rows' order
                await jetstream.publish(f"{stream}.items", payload)

        await _nats(nats_url, send)

    async def add_rows(rows: Sequence[Row]) -> None:
        await publish([json.dumps(dict(row)).encode() for row in rows])

    async def acknowledged() -> str:
        async def floor(client: Any) -> str:
            import nats.js.errors

            try:
                info = await client.jetstream().consumer_info(stream, f"faucet_{stream}")
            except nats.js.errors.NotFoundError:
                return "0"  # no session created the consumer yet: nothing is acknowledged
            return str(info.ack_floor.stream_seq)

        return await _nats(nats_url, floor)

    async def redelivered() -> int:
        async def count(client: Any) -> int:
            import nats.js.errors

            try:
                info = await client.jetstream().consumer_info(stream, f"faucet_{stream}")
            except nats.js.errors.NotFoundError:
                return 0
            # The consumer starts at the stream's first sequence with no filter: every delivery past
            # the last stream sequence delivered is a repeated one.
            return int(info.delivered.consumer_seq - info.delivered.stream_seq)

        return await _nats(nats_url, count)

    async def purge() -> None:
        async def remove(client: Any) -> None:
            await client.jetstream().purge_stream(stream)

        await _nats(nats_url, remove)

    async def cleanup() -> None:
        async def delete(client: Any) -> None:
            await client.jetstream().delete_stream(stream)

        await _nats(nats_url, delete)

    async def recreate() -> None:
        await cleanup()
        await _nats(nats_url, create)

    config = {
        "servers": [nats_url],
        "stream": stream,
        "columns": {"id": "int64 not null", "name": "string"},
        "ack_wait": 1.0,
        "idle_heartbeat": 0.5,
        "chunk_messages": 100,
    }
    return SourceSetup(
        config,
        add_rows,
        resources=(stream,),
        unreachable=_nats_unreachable(config),
        add_malformed=lambda: publish([b"{not json"]),
        acknowledged=acknowledged,
        cleanup=cleanup,
        redelivered=redelivered,
        make_unavailable=purge,
        recreate=recreate,
    )


def nats_sink(nats_server: NatsServer, unique_name: Callable[..., str]) -> SinkSetup:
    """A fresh stream with a 120 s duplicate window that refuses messages over 1 KiB; ``stall``
    stops the server process (SIGSTOP) when this process manages it."""
    nats_url = nats_server.url
    stream = unique_name("s")
    subject = f"{stream}.out"
    bucket = f"w_{stream}"

    async def create(client: Any) -> None:
        await client.jetstream().add_stream(
            name=stream, subjects=[subject], duplicate_window=120, max_msg_size=1024
        )

    run_setup(lambda: _nats(nats_url, create))

    async def read_back() -> list[dict[str, Any]]:
        async def read(client: Any) -> list[dict[str, Any]]:
            jetstream = client.jetstream()
            state = (await jetstream.stream_info(stream)).state
            if not state.messages:
                return []
            found = []
            for sequence in range(state.first_seq, state.last_seq + 1):
                message = await jetstream.get_msg(stream, sequence)
                found.append(json.loads(message.data or b"{}"))
            return found

        return await _nats(nats_url, read)

    async def cleanup() -> None:
        async def delete(client: Any) -> None:
            import nats.js.errors

            jetstream = client.jetstream()
            await jetstream.delete_stream(stream)
            # The bucket exists once a streaming session opened; a bounded sink has none.
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await jetstream.delete_key_value(bucket)

        await _nats(nats_url, delete)

    config = {
        "servers": [nats_url],
        "stream": stream,
        "subject": subject,
        "duplicate_window": 120,
        # nats-py never resolves the future of a publish the stream refuses (its reply handler
        # raises instead): such a write ends as UncertainOutcome after ack_timeout.
        "ack_timeout": 1,
        "watermark_bucket": bucket,
    }
    return SinkSetup(
        config,
        read_back,
        refused_rows=refused_rows(),
        unreachable=_nats_unreachable(config),
        cleanup=cleanup,
        stall=(lambda: process_stopped(nats_server.pid)) if nats_server.pid is not None else None,
    )
