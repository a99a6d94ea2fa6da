"""A Kafka-protocol relay in front of Tansu that answers a deleted topic's Fetch as Kafka does.

Why: after a topic is deleted, Tansu answers a Fetch (v13+, by topic id) for it with the topic id
all zeros, error UNKNOWN_TOPIC_OR_PARTITION and a CurrentLeader tag on every partition, plus the
NodeEndpoints tag. librdkafka (2.16) turns those tags into a leader update for a topic with no id and
no name, looks the name up in its metadata cache (``rd_kafka_metadata_update_op`` ->
``rd_kafka_metadata_cache_find(rk, NULL)``) and crashes the process with SIGSEGV. Kafka echoes the
topic id it was asked for; with that one field rewritten the same client, in the same sequence, lives
on (see docs/operations.md, "Stopping, exiting and crashing"). Every other byte is relayed as is.

Run as ``python -m faucet_dagster.testing.servers.kafka_shim LISTEN_PORT TARGET_PORT -- TANSU_COMMAND``:
it starts Tansu (its child, in its process group), relays ``127.0.0.1:LISTEN_PORT`` to
``127.0.0.1:TARGET_PORT``, and stops Tansu when it is stopped (SIGTERM, SIGINT).
"""

import asyncio
import contextlib
import signal
import struct
import subprocess
import sys
from collections.abc import Callable

FETCH = 1
_ZERO_ID = bytes(16)


def _uvarint(buffer: bytes | bytearray, position: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buffer[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def _skip_tags(buffer: bytes | bytearray, position: int) -> int:
    count, position = _uvarint(buffer, position)
    for _ in range(count):
        _, position = _uvarint(buffer, position)
        size, position = _uvarint(buffer, position)
        position += size
    return position


def fetch_request_topic_ids(frame: bytes) -> list[bytes]:
    """The topic ids a Fetch v13+ request asks for, in order (``frame``: the request after its size)."""
    position = 8  # api key, version, correlation id
    (client_id_length,) = struct.unpack_from(">h", frame, position)
    position = _skip_tags(frame, position + 2 + max(client_id_length, 0))
    position += 4 + 4 + 4 + 1 + 4 + 4  # max wait, min bytes, max bytes, isolation, session id, epoch
    count, position = _uvarint(frame, position)
    ids = []
    for _ in range(count - 1):
        ids.append(bytes(frame[position : position + 16]))
        partitions, position = _uvarint(frame, position + 16)
        for _ in range(partitions - 1):
            position = _skip_tags(frame, position + 4 + 4 + 8 + 4 + 8 + 4)
        position = _skip_tags(frame, position)
    return ids


def echo_topic_ids(frame: bytes, asked: list[bytes]) -> bytes:
    """A Fetch v13+ response with each all-zero topic id replaced by the id asked for at its place."""
    out = bytearray(frame)
    position = _skip_tags(out, 4) + 4 + 2 + 4  # correlation id, tags; throttle, error, session id
    count, position = _uvarint(out, position)
    for index in range(count - 1):
        if out[position : position + 16] == _ZERO_ID and index < len(asked):
            out[position : position + 16] = asked[index]
        partitions, position = _uvarint(out, position + 16)
        for _ in range(partitions - 1):
            position += 4 + 2 + 8 + 8 + 8
            aborted, position = _uvarint(out, position)
            position += max(aborted - 1, 0) * 16 + 4  # aborted transactions, preferred replica
            records, position = _uvarint(out, position)
            position = _skip_tags(out, position + max(records - 1, 0))
        position = _skip_tags(out, position)
    return bytes(out)


async def _relay(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, change: Callable[[bytes], bytes]
) -> None:
    try:
        while True:
            head = await reader.readexactly(4)
            (size,) = struct.unpack(">i", head)
            frame = change(await reader.readexactly(size))
            writer.write(struct.pack(">i", len(frame)) + frame)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _connection(
    client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, target: int
) -> None:
    try:
        broker_reader, broker_writer = await asyncio.open_connection("127.0.0.1", target)
    except OSError:
        client_writer.close()
        return
    fetches: dict[int, list[bytes]] = {}

    def request(frame: bytes) -> bytes:
        api_key, version, correlation = struct.unpack_from(">hhi", frame, 0)
        if api_key == FETCH and version >= 13:
            with contextlib.suppress(IndexError, struct.error):
                fetches[correlation] = fetch_request_topic_ids(frame)
        return frame

    def response(frame: bytes) -> bytes:
        (correlation,) = struct.unpack_from(">i", frame, 0)
        asked = fetches.pop(correlation, None)
        if not asked:
            return frame
        try:
            return echo_topic_ids(frame, asked)
        except (IndexError, struct.error):
            return frame

    await asyncio.gather(
        _relay(client_reader, broker_writer, request), _relay(broker_reader, client_writer, response)
    )


async def _serve(listen: int, target: int, broker: "subprocess.Popen[bytes]") -> None:
    server = await asyncio.start_server(
        lambda r, w: _connection(r, w, target), "127.0.0.1", listen, reuse_address=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        while not stop.is_set() and broker.poll() is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)


def main(argv: list[str]) -> int:
    listen, target, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: kafka_shim LISTEN_PORT TARGET_PORT -- TANSU_COMMAND...")
    broker = subprocess.Popen(command)
    try:
        asyncio.run(_serve(int(listen), int(target), broker))
    finally:
        if broker.poll() is None:
            broker.terminate()
            try:
                broker.wait(10)
            except subprocess.TimeoutExpired:
                broker.kill()
    return broker.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
