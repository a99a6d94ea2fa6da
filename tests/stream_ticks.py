"""Helpers for end-to-end stream tests: sensor ticks on a persistent instance, and reading NATS back."""

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import dagster as dg
import nats
from dagster._core.definitions.sensor_definition import SensorExecutionData

from faucet_dagster.protocol import ConnectionFailed, EpochCertificate
from faucet_dagster.state import StateStore
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.runner_cache import close_cached_streams
from faucet_dagster.streams.sensor import faucet_stream_sensor

DRAIN_SECONDS = 600.0
"""How long the tick loops here go on ticking for what they expect: generous, for a loaded machine."""


class SensorTicks:
    """Ticks of one sensor, each evaluated from the last one's cursor, on one instance (or none)."""

    def __init__(self, sensor: dg.SensorDefinition, instance: dg.DagsterInstance | None) -> None:
        self.sensor = sensor
        self.instance = instance
        self.cursor: str | None = None
        self.results: list[SensorExecutionData] = []
        self.reported: list[int] = []
        """The sequence of every certificate the ticks reported, in order."""

    def tick(self) -> SensorExecutionData:
        result = self.sensor.evaluate_tick(sensor_context(self.sensor, self.instance, self.cursor))
        self.cursor = result.cursor
        self.results.append(result)
        materializations = [e for e in result.asset_events or () if isinstance(e, dg.AssetMaterialization)]
        assert len(materializations) <= 1, "one materialization a tick, whatever the epochs certified"
        for event in materializations:
            self.reported.extend(reported_sequences(event))
        return result

    def until_halted(self, what: str) -> SensorExecutionData:
        """Tick until a tick says the stream is halted (``halted since ...``); that tick's result. A tick
        does not wait for the stream's background reader: what the reader meets halts a later tick,
        how much later depending on the machine's speed."""
        ends = time.monotonic() + DRAIN_SECONDS
        while True:
            result = self.tick()
            if str(result.skip_message).startswith("halted since "):
                return result
            assert time.monotonic() < ends, f"{what}: no tick said halted within {DRAIN_SECONDS:.0f}s"
            time.sleep(0.2)

    def until(self, done: Callable[[], bool], what: str) -> None:
        """Tick until ``done()``, for at most :data:`DRAIN_SECONDS`: how much one tick drains within
        its budget depends on the machine's speed, what is certified in the end does not."""
        ends = time.monotonic() + DRAIN_SECONDS
        while not done():
            assert time.monotonic() < ends, f"{what} not within {DRAIN_SECONDS:.0f}s"
            self.tick()


def sensor_context(
    sensor: dg.SensorDefinition,
    instance: dg.DagsterInstance | None = None,
    cursor: str | None = None,
) -> dg.SensorEvaluationContext:
    """A context for one tick of a stream's ``sensor``, with the definitions its asset selection (the
    stream's sink asset) resolves against, as the daemon's code server has them."""
    selection = sensor.asset_selection
    keys = list(getattr(selection, "selected_keys", ())) if selection is not None else []
    defs = dg.Definitions(assets=[dg.AssetSpec(key) for key in keys], sensors=[sensor])
    return dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs)


def reported_sequences(materialization: dg.AssetMaterialization) -> list[int]:
    """The sequence of each certificate a tick's materialization reports (its ``faucet/certificates``)."""
    table = materialization.metadata["faucet/certificates"]
    assert isinstance(table, dg.TableMetadataValue)
    return [int(str(record.data["sequence"])) for record in table.records]


def evaluate_ticks(
    stream: FaucetStream,
    before_ticks: Sequence[Callable[[], None]],
    budget_seconds: float = 8,
    *,
    rows: int,
) -> tuple[list[int], list[EpochCertificate]]:
    """Run ``before()`` then one sensor tick, for each of ``before_ticks``, on one instance; then tick on
    until the certificates hold ``rows`` rows, and until the ticks have reported the last of them.

    Returns the certificate sequences the ticks reported (in order) and the certificates in the state
    store. The sensor caches its runner
    (open sessions) per process: :func:`close_cached_streams` closes it here, while the servers still
    run.
    """
    assert stream.state_url is not None
    store = StateStore(stream.state_url)
    try:
        with dg.instance_for_test() as instance:
            ticks = SensorTicks(faucet_stream_sensor(stream, budget_seconds=budget_seconds), instance)
            for before in before_ticks:
                before()
                ticks.tick()
            ticks.until(
                lambda: certified_rows(store.certificates(stream.name)) >= rows, f"{rows} rows certified"
            )
            # What the last tick certified without reporting it, the next one reports.
            ticks.until(
                lambda: ticks.reported[-1:] == [len(store.certificates(stream.name))],
                "the last certificate reported",
            )
        return ticks.reported, store.certificates(stream.name)
    finally:
        close_cached_streams()
        store.close()


def ticks_reporting(
    sensor: dg.SensorDefinition, epochs: int, instance: dg.DagsterInstance | None = None
) -> list[SensorExecutionData]:
    """Evaluate ``sensor``'s ticks until they have reported ``epochs`` certificates in all; every tick's
    result, in order. A tick waits for its own seal only: the full epochs of a backlog are sealed by the
    reader between ticks, and the next tick reports them, so how many ticks that takes depends on the
    machine's speed."""
    ticks = SensorTicks(sensor, instance)
    ticks.until(lambda: len(ticks.reported) >= epochs, f"{epochs} certificates reported")
    return ticks.results


def certified_rows(certificates: Sequence[EpochCertificate]) -> int:
    return sum(sum(c.row_counts.values()) for c in certificates)


def lose_certificate(store: StateStore, monkeypatch: Any, nth: int) -> None:
    """Make the ``nth`` certificate the store is asked to persist fail, as if the store went away:
    the crash after the destination commit and before the certificate, injected at that exact point."""
    persist = store.append_certificate
    calls = {"n": 0}

    def append_certificate(certificate: EpochCertificate, lease: Any) -> bool:
        calls["n"] += 1
        if calls["n"] == nth:
            raise ConnectionFailed("the state store went away", where="test")
        return persist(certificate, lease)

    monkeypatch.setattr(store, "append_certificate", append_certificate)


def chained_ends(certificates: Sequence[EpochCertificate]) -> dict[str, str]:
    """Check each domain's coverage starts where its previous one ended; return the last end per
    partition."""
    ends: dict[str, str] = {}
    for certificate in certificates:
        for item in certificate.coverage:
            partition = item.domain.partition
            assert item.start == ends.get(partition), f"partition {partition} does not chain"
            ends[partition] = item.end
    return ends


async def stored_messages(url: str, stream: str) -> list[tuple[int, dict[str, Any], str]]:
    """Every message of JetStream ``stream``: (sequence, JSON payload, its Nats-Msg-Id header)."""
    client = await nats.connect(url)
    try:
        jsm = client.jetstream()
        info = await jsm.stream_info(stream)
        found = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
            message = await jsm.get_msg(stream, seq)
            payload = json.loads(message.data or b"")
            found.append((seq, payload, (message.headers or {}).get("Nats-Msg-Id", "")))
        return found
    finally:
        await client.close()


async def stored_ids(url: str, stream: str) -> list[int]:
    """The ``id`` field of every message of JetStream ``stream``, in stream order."""
    return [int(payload["id"]) for _, payload, _ in await stored_messages(url, stream)]
