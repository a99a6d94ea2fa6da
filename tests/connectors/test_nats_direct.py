"""Direct delivery from the nats-py parser (faucet_nats.direct), against a real NATS server.

The push consumer's speed rests on it being in effect with the pinned nats-py: these tests fail (not
fall back silently) when nats-py's internals change under it.
"""

import asyncio
from collections.abc import Callable

import nats
from faucet_nats.chunks import Delivery
from faucet_nats.direct import deliver_directly
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig


def test_deliveries_skip_the_callback_in_order_with_headers(
    nats_url: str, unique_name: Callable[..., str]
) -> None:
    """A push consumer's deliveries reach the function in stream order, headers parsed; its heartbeats
    (and every delivery after the restore) still reach the callback."""
    stream = unique_name("direct")

    async def scenario() -> None:
        client = await nats.connect(nats_url)
        try:
            js = client.jetstream()
            await js.add_stream(name=stream, subjects=[f"{stream}.>"])
            for n in range(1, 301):
                headers = {"k": f"v{n}"} if n % 3 == 0 else None
                await js.publish(f"{stream}.m", f"m{n}".encode(), headers=headers)
            direct: list[Delivery] = []
            called: list[Msg] = []

            async def callback(msg: Msg) -> None:
                called.append(msg)

            inbox = client.new_inbox()
            subscription = await client.subscribe(inbox, cb=callback)
            restore = deliver_directly(client, subscription, direct.append)
            assert restore is not None, "nats-py internals changed: deliveries take the slow path"
            config = ConsumerConfig(
                deliver_subject=inbox, ack_policy=AckPolicy.ALL, flow_control=True, idle_heartbeat=0.2
            )
            await js.add_consumer(stream, config)
            # Deliveries, then an idle heartbeat (a status: the callback's).
            await _until(lambda: len(direct) == 300 and len(called) >= 1)
            assert [d[2] for d in direct] == [f"m{n}".encode() for n in range(1, 301)]
            assert [d[1].split(".")[5] for d in direct] == [str(n) for n in range(1, 301)]
            assert all(d[0] == f"{stream}.m" for d in direct)
            assert [d[3] for d in direct[:3]] == [None, None, {"k": "v3"}]
            assert all(msg.headers and msg.headers.get("Status") == "100" for msg in called)

            restore()
            await js.publish(f"{stream}.m", b"after")
            await _until(lambda: any(msg.data == b"after" for msg in called))
            assert len(direct) == 300
        finally:
            await client.close()

    asyncio.run(scenario())


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the deliveries did not arrive within 30 s")
