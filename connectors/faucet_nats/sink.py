"""The NATS JetStream sink: APPEND each row as a JSON message, deduplicated by its event identity.

Continuous (:class:`NatsStreamingSink`): ``apply`` publishes every row of a batch to the configured
subject with the header ``Nats-Msg-Id`` = the row's event identity digest (stable across replays) and
collects the publish acknowledgements asynchronously, with many outstanding; the stream stores each
message as soon as it acknowledges it, before the epoch commits. ``commit_epoch`` waits for every
acknowledgement of the epoch, records the epoch and its per-domain watermark in a JetStream key-value
bucket (compare-and-set: an epoch of a lower fencing token than the stored one raises OwnershipLost
and never moves the watermark back), and returns one receipt per resource (messages stored,
duplicates the server suppressed, first and last stream sequence). ``abort_epoch`` cannot
unpublish: what was published stays. ``close_session`` returns only when no publish of the session
can still land; otherwise it raises UncertainOutcome.

Duplicates: the stream drops a message whose ``Nats-Msg-Id`` it saw within its ``duplicate_window``,
so an epoch replayed within the window adds nothing; a replay older than the window duplicates. The
configured ``duplicate_window`` is what the capabilities declare, and ``open`` refuses a stream whose
window differs, so the plan's promise matches the destination.

Bounded (:class:`NatsSink`): ``write_batch`` publishes and waits for every acknowledgement (no
message ids: a bounded batch carries no event identities, so no deduplication is claimed).
"""

import asyncio
import base64
import datetime
import decimal
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import nats.errors
import nats.js.errors
import pyarrow as pa
from nats.aio.client import Client
from nats.js.api import PubAck
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from faucet_dagster.protocol import (
    ConfigError,
    ConnectionFailed,
    Coverage,
    Durability,
    EpochId,
    EpochMismatch,
    FaucetError,
    IntegrityError,
    LifecycleError,
    OrderingDomain,
    OwnershipLost,
    Position,
    Receipt,
    Sink,
    SinkBatch,
    SinkCapabilities,
    SinkCommitState,
    StreamingSink,
    StreamingSinkSession,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
)
from faucet_nats.jetstream import JetStreamApi, connect, stream_missing
from faucet_nats.sink_config import NatsSinkConfig

_WATERMARK_ATTEMPTS = 5
"""Compare-and-set attempts of a watermark write before concurrent writers are reported."""


def _subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` matches one token, a final ``>`` one or more."""
    wanted, tokens = pattern.split("."), subject.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > index
        if index >= len(tokens) or (token != "*" and token != tokens[index]):
            return False
    return len(tokens) == len(wanted)


def _json_default(value: Any) -> Any:
    """JSON for the Arrow values ``json`` cannot encode: times as ISO 8601, decimals as text, bytes
    as base64."""
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class _Publisher:
    """One connection to the target stream: checks it, publishes rows, settles acknowledgements."""

    def __init__(self, config: NatsSinkConfig) -> None:
        self.config = config
        self.where = f"nats stream {config.stream} subject {config.subject}"
        self._client: Client | None = None
        self._js: JetStreamContext | None = None

    async def open(self) -> JetStreamContext:
        """Connect and check the target stream captures the subject, acknowledges, and has the
        configured duplicate window; ConfigError names what differs."""
        client = await connect(self.config, where=self.where)
        self._client = client
        try:
            answer = await JetStreamApi(client, self.config).request(
                f"STREAM.INFO.{self.config.stream}", None, where=self.where
            )
        except FaucetError as exc:
            if stream_missing(exc):
                raise ConfigError(f"stream {self.config.stream} does not exist", where=self.where) from exc
            raise
        stream_config = answer.get("config") or {}
        subjects = stream_config.get("subjects") or []
        if not any(_subject_matches(pattern, self.config.subject) for pattern in subjects):
            raise ConfigError(
                f"stream {self.config.stream} does not capture subject {self.config.subject} "
                f"(it captures {', '.join(subjects) or 'nothing'})",
                where=self.where,
            )
        if stream_config.get("no_ack"):
            raise ConfigError("the stream does not acknowledge publishes (no_ack)", where=self.where)
        window = int(stream_config.get("duplicate_window") or 0) / 1e9
        if abs(window - self.config.duplicate_window) > 1e-3:
            raise ConfigError(
                f"the stream's duplicate window is {window:g}s, the sink is configured for "
                f"{self.config.duplicate_window:g}s: set duplicate_window to what the stream has",
                where=self.where,
            )
        prefix = self.config.api_prefix
        self._js = client.jetstream(prefix=prefix, publish_async_max_pending=self.config.max_outstanding_acks)
        return self._js

    async def publish(
        self, records: pa.RecordBatch, message_ids: Sequence[str] | None
    ) -> list[asyncio.Future[PubAck]]:
        """Publish every row as a JSON message (with ``Nats-Msg-Id`` when ids are given); returns the
        acknowledgement futures. Blocks while ``max_outstanding_acks`` are outstanding."""
        js = self._require()
        dumps = json.dumps
        subject, stall = self.config.subject, self.config.ack_timeout
        futures: list[asyncio.Future[PubAck]] = []
        try:
            for index, row in enumerate(records.to_pylist()):
                payload = dumps(row, default=_json_default, separators=(",", ":")).encode()
                headers = None if message_ids is None else {"Nats-Msg-Id": message_ids[index]}
                futures.append(await js.publish_async(subject, payload, wait_stall=stall, headers=headers))
        except TypeError as exc:
            raise IntegrityError(f"a row cannot be encoded as JSON: {exc}", where=self.where) from exc
        except nats.js.errors.TooManyStalledMsgsError as exc:
            raise ConnectionFailed(
                f"{self.config.max_outstanding_acks} publishes waited {stall}s for their acknowledgements",
                where=self.where,
            ) from exc
        except (nats.errors.Error, OSError) as exc:
            raise ConnectionFailed(f"publishing failed: {type(exc).__name__}", where=self.where) from exc
        return futures

    async def settle(self, futures: Sequence[asyncio.Future[PubAck]], what: str) -> list[PubAck]:
        """Wait for every future; UncertainOutcome when some did not resolve within ``ack_timeout``
        (those messages may or may not be stored), ConnectionFailed when the stream refused one."""
        if futures:
            _, pending = await asyncio.wait(futures, timeout=self.config.ack_timeout)
            if pending:
                raise UncertainOutcome(
                    f"{len(pending)} of {len(futures)} publishes of {what} were not acknowledged within "
                    f"{self.config.ack_timeout:g}s: they may or may not be stored",
                    where=self.where,
                )
        acks: list[PubAck] = []
        for future in futures:
            if future.cancelled():
                raise ConnectionFailed(f"a publish of {what} was cancelled", where=self.where, retryable=True)
            error = future.exception()
            if error is not None:
                raise ConnectionFailed(
                    f"the stream refused a publish of {what}: {error}", where=self.where, retryable=True
                ) from error
            acks.append(future.result())
        return acks

    async def close(self) -> None:
        client, self._client, self._js = self._client, None, None
        if client is not None and not client.is_closed:
            try:
                await client.close()
            except (nats.errors.Error, OSError) as exc:
                raise ConnectionFailed(f"closing the connection failed: {exc}", where=self.where) from exc

    def _require(self) -> JetStreamContext:
        if self._js is None:
            raise LifecycleError("the NATS sink is not open", where=self.where)
        return self._js


def _receipt(resource: str, acks: Sequence[PubAck], config: NatsSinkConfig) -> Receipt:
    stored = [ack.seq for ack in acks if not ack.duplicate]
    details = {"stream": config.stream, "subject": config.subject, "duplicates": str(len(acks) - len(stored))}
    if stored:
        details["first_sequence"] = str(min(stored))
        details["last_sequence"] = str(max(stored))
    return Receipt(resource, len(stored), len(acks) - len(stored), details)


@dataclass
class _Epoch:
    epoch: EpochId
    futures: dict[str, list[asyncio.Future[PubAck]]] = field(default_factory=dict)


class NatsSinkSession(StreamingSinkSession):
    """One stream's session on the target subject. Calls are serialized by the runner.

    ``last_committed`` reads the watermark bucket: the epoch whose every publish was acknowledged and
    the position it reached in each domain it covered. It proves that the messages up to
    there are stored; messages published by a later epoch that never committed may be stored too
    (replaying them within the duplicate window adds nothing).
    """

    def __init__(self, publisher: _Publisher, stream: str, kv: KeyValue) -> None:
        self._publisher = publisher
        self._stream = stream
        self._kv = kv
        self._key = (
            "w_"
            + hashlib.blake2b(
                f"{publisher.config.stream}\0{publisher.config.subject}\0{stream}".encode(), digest_size=16
            ).hexdigest()
        )
        self._active: _Epoch | None = None
        self._unsettled: list[asyncio.Future[PubAck]] = []
        self._closed = False

    @property
    def where(self) -> str:
        return self._publisher.where

    async def last_committed(self) -> SinkCommitState | None:
        entry = await self._watermark_entry()
        return None if entry is None else self._parse(entry.value)

    async def _watermark_entry(self) -> KeyValue.Entry | None:
        try:
            return await self._kv.get(self._key)
        except nats.js.errors.KeyNotFoundError:
            return None
        except (nats.errors.Error, OSError) as exc:
            raise ConnectionFailed(
                f"reading the watermark failed: {type(exc).__name__}", where=self.where
            ) from exc

    def _parse(self, value: bytes | None) -> SinkCommitState:
        try:
            raw = json.loads(value or b"")
            epoch = EpochId(**raw["epoch"])
            watermarks = tuple(
                Position(OrderingDomain(**item["domain"]), item["position"]) for item in raw["watermarks"]
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError("the stored watermark is not one this sink wrote", where=self.where) from exc
        return SinkCommitState(epoch, watermarks)

    async def _store_watermark(self, epoch: EpochId, value: bytes) -> None:
        """Store the epoch's watermark, unless an epoch of a higher fencing token is stored.

        A worker that lost its lease and resumed (a zombie) must not move the watermark back under
        its successor: the next worker would find the destination behind its certificates. The
        write is compare-and-set on the entry's revision, so a write between the read and this one
        is seen and judged again. Raises OwnershipLost for a stale epoch.
        """
        for _ in range(_WATERMARK_ATTEMPTS):
            entry = await self._watermark_entry()
            if entry is not None:
                stored = self._parse(entry.value).epoch
                if stored.fencing_token > epoch.fencing_token:
                    raise OwnershipLost(
                        f"epoch {stored} of fencing token {stored.fencing_token} is committed here: "
                        f"epoch {epoch} is stale and does not move the watermark",
                        where=self.where,
                    )
            try:
                if entry is None:
                    await self._kv.create(self._key, value)
                else:
                    await self._kv.update(self._key, value, last=entry.revision)
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # another session wrote in between: judge its epoch
            except (nats.errors.Error, OSError) as exc:
                raise ConnectionFailed(
                    f"storing the watermark failed: {type(exc).__name__}", where=self.where
                ) from exc
        raise OwnershipLost(
            f"the watermark kept changing while epoch {epoch} was committed: another session writes it",
            where=self.where,
        )

    async def begin_epoch(self, epoch: EpochId) -> None:
        self._check_open()
        if self._active is not None:
            raise LifecycleError(
                f"epoch {self._active.epoch} is still active; cannot begin {epoch}", where=self.where
            )
        if epoch.stream != self._stream:
            raise EpochMismatch(f"epoch {epoch} is not of stream {self._stream}", where=self.where)
        self._active = _Epoch(epoch)

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        """Publish the batch's rows with their identities; returns once every publish is sent (its
        acknowledgement may still be outstanding: ``commit_epoch`` waits for them)."""
        active = self._require_active(epoch, "apply")
        if batch.epoch != epoch:
            raise EpochMismatch(f"a batch of epoch {batch.epoch} was applied in {epoch}", where=self.where)
        if len(batch.identities) != batch.records.num_rows:
            raise IntegrityError(
                f"{batch.records.num_rows} rows came with {len(batch.identities)} identities",
                where=self.where,
            )
        ids = [batch.identities.at(batch.domain, index).digest() for index in range(len(batch.identities))]
        futures = await self._publisher.publish(batch.records, ids)
        active.futures.setdefault(batch.resource, []).extend(futures)

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        """Wait for every acknowledgement of the epoch, store the epoch and watermark, return receipts.

        UncertainOutcome when acknowledgements are missing after ``ack_timeout``; ConnectionFailed
        when the stream refused a publish or the watermark could not be stored; OwnershipLost when
        an epoch of a higher fencing token is stored. The epoch stays active after a failure, so the
        runner aborts it.
        """
        active = self._require_active(epoch, "commit")
        acks = {
            resource: await self._publisher.settle(futures, f"epoch {epoch}")
            for resource, futures in active.futures.items()
        }
        watermarks = coverage.end_positions()
        record = {
            "stream": self._stream,
            "target": {"stream": self._publisher.config.stream, "subject": self._publisher.config.subject},
            "epoch": asdict(epoch),
            "watermarks": [{"domain": asdict(p.domain), "position": p.value} for p in watermarks],
        }
        await self._store_watermark(epoch, json.dumps(record, sort_keys=True).encode())
        self._active = None
        return tuple(
            _receipt(resource, resource_acks, self._publisher.config)
            for resource, resource_acks in acks.items()
        )

    async def abort_epoch(self, epoch: EpochId) -> None:
        """Forget the epoch. What it published stays in the stream (NATS cannot unpublish); its
        outstanding acknowledgements are still awaited by ``close_session``."""
        active = self._require_active(epoch, "abort")
        for futures in active.futures.values():
            self._unsettled.extend(future for future in futures if not future.done())
        self._active = None

    async def close_session(self) -> None:
        """Wait (up to ``ack_timeout``) for every publish of the session to be acknowledged or refused,
        then close the connection. Raises UncertainOutcome when some are still outstanding: those
        messages may still be stored after this returns. Idempotent once it succeeded."""
        if self._closed:
            return
        self._closed = True
        outstanding = list(self._unsettled)
        if self._active is not None:
            outstanding.extend(future for futures in self._active.futures.values() for future in futures)
            self._active = None
        self._unsettled = []
        uncertain: UncertainOutcome | None = None
        if outstanding:
            _, pending = await asyncio.wait(outstanding, timeout=self._publisher.config.ack_timeout)
            if pending:
                uncertain = UncertainOutcome(
                    f"{len(pending)} published messages were not acknowledged when the session closed: "
                    "they may still be stored",
                    where=self.where,
                )
        await self._publisher.close()
        if uncertain is not None:
            raise uncertain

    def _require_active(self, epoch: EpochId, action: str) -> _Epoch:
        self._check_open()
        if self._active is None:
            raise LifecycleError(f"{action} of epoch {epoch} without an active epoch", where=self.where)
        if self._active.epoch != epoch:
            raise EpochMismatch(
                f"{action} of epoch {epoch}, the active one is {self._active.epoch}", where=self.where
            )
        return self._active

    def _check_open(self) -> None:
        if self._closed:
            raise LifecycleError("the NATS sink session is closed", where=self.where)


def _capabilities(config: NatsSinkConfig, *, continuous: bool) -> SinkCapabilities:
    append = frozenset({WritePolicy.APPEND})
    return SinkCapabilities(
        bounded_policies=frozenset() if continuous else append,
        continuous_policies=append if continuous else frozenset(),
        durability=Durability.ACKNOWLEDGED,
        atomic_watermark=False,
        dedup_by_event_identity=continuous,
        dedup_window=timedelta(seconds=config.duplicate_window) if continuous else None,
        owner_fencing=False,
    )


class NatsStreamingSink(StreamingSink):
    """The continuous NATS sink (APPEND). Building it does no I/O; ``open`` connects and checks."""

    connector_name = "nats"

    def __init__(self, config: NatsSinkConfig) -> None:
        self.config = config

    def capabilities(self) -> SinkCapabilities:
        return _capabilities(self.config, continuous=True)

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> NatsSinkSession:
        if policy is not WritePolicy.APPEND:
            raise ConfigError(
                f"the NATS sink appends; it cannot apply {policy.value}", where=self.config.stream
            )
        publisher = _Publisher(self.config)
        try:
            js = await publisher.open()
            kv = await _watermark_bucket(js, self.config.watermark_bucket, publisher.where)
            session = NatsSinkSession(publisher, stream, kv)
        except BaseException:
            await publisher.close()
            raise
        return session


async def _watermark_bucket(js: JetStreamContext, bucket: str, where: str) -> KeyValue:
    try:
        try:
            return await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            return await js.create_key_value(bucket=bucket, history=1)
    except (nats.errors.Error, OSError) as exc:
        raise ConnectionFailed(f"opening the watermark bucket {bucket} failed: {exc}", where=where) from exc


class NatsSink(Sink):
    """The bounded NATS sink (APPEND): each batch is published and acknowledged before it returns."""

    connector_name = "nats"
    config_model = NatsSinkConfig

    def __init__(self, config: NatsSinkConfig) -> None:
        self.config = config
        self._publisher: _Publisher | None = None

    def capabilities(self) -> SinkCapabilities:
        return _capabilities(self.config, continuous=False)

    def dataset_uri(self) -> str:
        return f"nats://{self.config.servers[0].split('://')[-1]}/{self.config.stream}/{self.config.subject}"

    async def check(self) -> None:
        publisher = _Publisher(self.config)
        try:
            await publisher.open()
        finally:
            await publisher.close()

    async def write_batch(self, records: pa.RecordBatch) -> int:
        """Publish every row and return once each was acknowledged (stored) by the stream."""
        if self._publisher is None:
            publisher = _Publisher(self.config)
            try:
                await publisher.open()
            except BaseException:
                await publisher.close()
                raise
            self._publisher = publisher
        futures = await self._publisher.publish(records, None)
        return len(await self._publisher.settle(futures, "a batch"))

    async def close(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            await publisher.close()
