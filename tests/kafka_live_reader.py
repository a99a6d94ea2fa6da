"""A process that reads a Kafka topic through the stream source while the test deletes it (and maybe
recreates it): ``python kafka_live_reader.py BOOTSTRAP TOPIC [head]``. It prints ``reading`` after its
first read (with ``head``: after the first read that found nothing new, so every read after the
deletion is empty), then reads on until a read raises, prints ``raised <ErrorType>: <message>`` and exits 0;
``no error`` (exit 1) when 60 s of reads raised nothing. A crash of the client is its exit code."""

import asyncio
import sys
import time

from faucet_kafka.config import KafkaSourceConfig
from faucet_kafka.source import KafkaStreamSource

from faucet_dagster.protocol import CancelToken, FaucetError, Membership, ReadLimits, WorkerIdentity


class Discard:
    async def write(
        self, domain: object, rows: object, identities: object, *, resource: object = None
    ) -> None:
        return None

    async def control(self, control: object) -> None:
        return None

    async def reject(self, record: object) -> None:
        return None


async def main(bootstrap: str, topic: str, at_head: bool) -> int:
    config = KafkaSourceConfig(bootstrap_servers=bootstrap, topics=(topic,), group_id=f"g_{topic}")
    session = await KafkaStreamSource(config).open([topic], (), Membership(0, 1), WorkerIdentity("w", 1))
    limits = ReadLimits(records=50, idle=0.3)
    try:
        coverage = await session.read(Discard(), limits, CancelToken())  # type: ignore[arg-type]
        while at_head and not coverage.empty:
            coverage = await session.read(Discard(), limits, CancelToken())  # type: ignore[arg-type]
        print("reading", flush=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                await session.read(Discard(), limits, CancelToken())  # type: ignore[arg-type]
            except FaucetError as exc:
                print(f"raised {type(exc).__name__}: {exc}", flush=True)
                return 0
        print("no error", flush=True)
        return 1
    finally:
        await session.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["head"])))
