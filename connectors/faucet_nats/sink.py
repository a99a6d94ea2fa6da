"""The NATS JetStream sink: APPEND each row as a JSON message, deduplicated by its event identity.

Continuous (:class:`NatsStreamingSink`): ``apply`` publishes every row of a batch to the configured
subject with the header ``Nats-Msg-Id`` = the row's event identity digest (stable across replays) and
collects the publish acknowledgements asynchronously, with many outstanding; the stream stores each
message as soon as it acknowledges it, before the epoch commits. ``commit_epoch`` waits for every
acknowledgement of the epoch, records the epoch and its per-domain watermark in a JetStream key-value
bucket (compare-and-set: an epoch of a lower fencing token than the stored one raises OwnershipLost
and never moves the watermark back), and returns one receipt per resource (messages stored,
duplicates the server suppressed, first and last stream sequence, messages re-published). ``abort_epoch``
cannot unpublish: what was published stays. ``close_session`` returns only when no publish of the
session can still land: it first waits for an apply still sending, then for every publish
acknowledgement (re-publishing lost ones); what it cannot wait for it abandons (the connection is
closed) and raises UncertainOutcome naming the unanswered messages. A cancelled ``apply`` stops at
its next message and raises CancelledError (nats-py swallows some cancellations: see
:func:`faucet_nats.publisher.cancellation_watch`); every message it sent is settled by ``commit_epoch`` or
``close_session``.

After a server restart (or a dropped connection) mid-epoch: the publishes in flight, or only their
acknowledgements, are lost, and nats-py never resolves their futures. While settling (in
``commit_epoch``, and in ``close_session`` for aborted epochs) the sink re-publishes every message
still unanswered after ``republish_after`` while the connection is up, with the same payload and
``Nats-Msg-Id``, at most ``republish_attempts`` times, and only within the first
:data:`~faucet_nats.publisher.WINDOW_SAFETY` of the duplicate window counted from the message's first
publish (:mod:`faucet_nats.publisher` does this): the stream then stores it at most once, and a
``duplicate`` answer proves the first publish was stored. So a restart mid-epoch costs a re-publish,
not a halted stream: the commit succeeds with every message stored once (the stream drops a
re-published copy by its ``Nats-Msg-Id``, within the duplicate window: the plan's effectively-once,
not a consensus exactly-once). Receipts stay
truthful: a re-published message answered ``duplicate`` of a sequence after the stream's last sequence
at ``begin_epoch`` was stored by this epoch's first publish and counts as stored; otherwise as a
duplicate; ``republished`` counts the messages re-published. UncertainOutcome remains for what cannot
be proven: acknowledgements still missing after ``ack_timeout`` (the total wait, re-publishes
included), a message past the safe part of the window, or a re-publish stored but answered after it
(the first publish may be stored too). This assumes a lost publish never reaches the server later than
the window after its re-publish: one connection's bytes arrive in order, and a dropped connection's
unread bytes die with it or with the server. Memory: until settled, the sink holds each published
message's payload and id (about the epoch's JSON size), and for an aborted epoch with unanswered
publishes until ``close_session``.

Duplicates: the stream drops a message whose ``Nats-Msg-Id`` it saw within its ``duplicate_window``,
so an epoch replayed within the window adds nothing; a replay older than the window duplicates. The
configured ``duplicate_window`` is what the capabilities declare, and ``open`` refuses a stream whose
window differs, so the plan's promise matches the destination.

Bounded (:class:`NatsSink`): ``write_batch`` publishes and waits for every acknowledgement (no
message ids: a bounded batch carries no event identities, so no deduplication is claimed).
"""

import asyncio
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import partial

import nats.errors
import nats.js.errors
import pyarrow as pa
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from faucet_dagster.protocol import (
    ConfigError,
    ConnectionFailed,
    Coverage,
    DestinationReader,
    Durability,
    EpochId,
    EpochMismatch,
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
from faucet_nats.publisher import CLOSE_GRACE, Published, Publisher, receipts
from faucet_nats.sink_config import NatsSinkConfig

_WATERMARK_ATTEMPTS = 5
"""Compare-and-set attempts of a watermark write before concurrent writers are reported."""


@dataclass
class _Epoch:
    """The active epoch: the stream's last sequence before its first publish, and what it published."""

    epoch: EpochId
    baseline: int
    published: list[Published] = field(default_factory=list)


class NatsSinkSession(StreamingSinkSession):
    """One stream's session on the target subject. Calls are serialized by the runner.

    ``last_committed`` reads the watermark bucket: the epoch whose every publish was acknowledged and
    the position it reached in each domain it covered. It proves that the messages up to
    there are stored; messages published by a later epoch that never committed may be stored too
    (replaying them within the duplicate window adds nothing).
    """

    def __init__(self, publisher: Publisher, stream: str, kv: KeyValue) -> None:
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
        self._unsettled: list[Published] = []
        self._closed = False
        self._applies = 0
        self._no_apply = asyncio.Event()
        self._no_apply.set()

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
        """Start the epoch, reading the target stream's last sequence (one JetStream request):
        ConnectionFailed when the stream cannot be asked, and no epoch is then active."""
        self._check_open()
        if self._active is not None:
            raise LifecycleError(
                f"epoch {self._active.epoch} is still active; cannot begin {epoch}", where=self.where
            )
        if epoch.stream != self._stream:
            raise EpochMismatch(f"epoch {epoch} is not of stream {self._stream}", where=self.where)
        # Read before any publish of the epoch: what the receipts judge a re-publish's duplicate by.
        self._active = _Epoch(epoch, await self._publisher.last_sequence())

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
        sent = Published(batch.resource, ids, asyncio.get_running_loop().time())
        active.published.append(sent)
        self._applies += 1
        self._no_apply.clear()
        try:
            await self._publisher.publish(batch.records, sent)
        finally:
            self._applies -= 1
            if not self._applies:
                self._no_apply.set()

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        """Wait for every acknowledgement of the epoch, store the epoch and watermark, return receipts.

        Publishes unanswered after ``republish_after`` (lost in a server restart or a dropped
        connection) are re-published under their ``Nats-Msg-Id`` while the duplicate window makes that
        safe (see :meth:`Publisher.settle`); waits at most ``ack_timeout`` for them, then stores the
        watermark (up to ``request_timeout`` per request). A message the epoch stored once counts once
        as stored, whichever of its publishes was acknowledged (see :func:`receipts`); the receipt's
        ``republished`` detail counts the messages re-published.

        UncertainOutcome when acknowledgements are still missing after ``ack_timeout`` (or a
        re-publish could not be proven single); ConnectionFailed when the stream refused a publish or
        the watermark could not be stored; OwnershipLost when an epoch of a higher fencing token is
        stored. The epoch stays active after a failure, so the runner aborts it.
        """
        active = self._require_active(epoch, "commit")
        await self._publisher.settle(active.published, f"epoch {epoch}", refusals_fail=True)
        watermarks = coverage.end_positions()
        record = {
            "stream": self._stream,
            "target": {"stream": self._publisher.config.stream, "subject": self._publisher.config.subject},
            "epoch": asdict(epoch),
            "watermarks": [{"domain": asdict(p.domain), "position": p.value} for p in watermarks],
        }
        await self._store_watermark(epoch, json.dumps(record, sort_keys=True).encode())
        self._active = None
        return receipts(active.published, active.baseline, self._publisher.config)

    async def abort_epoch(self, epoch: EpochId) -> None:
        """Forget the epoch. What it published stays in the stream (NATS cannot unpublish); its
        unanswered publishes are settled by ``close_session``."""
        active = self._require_active(epoch, "abort")
        self._unsettled.extend(sent for sent in active.published if sent.unanswered())
        self._active = None

    async def close_session(self) -> None:
        """Return, or raise UncertainOutcome, within ``ack_timeout`` whatever the server does.

        Waits for an apply still sending (see :meth:`_apply_ended`), then settles every unanswered
        publish of the session (aborted epochs and the active one) as ``commit_epoch`` does,
        re-publishing lost ones while the duplicate window allows; then closes the connection. The
        three share one budget, ``ack_timeout``, the last :data:`~faucet_nats.publisher.CLOSE_GRACE`
        of it (at most a tenth) kept for closing the connection, which is reset when the server does
        not let it close in time (a server that hangs). A refused publish stored nothing and is
        settled. Returns only when every publish of the session was answered: then nothing the
        session sent can still be stored later (what a reset connection leaves in the server's
        kernel are no publishes). Raises UncertainOutcome, naming the first unanswered messages,
        when some are still unanswered: they are abandoned but may still be stored after this
        returns. Idempotent once it succeeded."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        budget = self._publisher.config.ack_timeout
        grace = min(CLOSE_GRACE, budget / 10)
        settled_by = loop.time() + budget - grace
        uncertain: UncertainOutcome | None = None
        try:
            await self._apply_ended(settled_by)
            outstanding = self._unsettled
            if self._active is not None:
                outstanding.extend(self._active.published)
                self._active = None
            self._unsettled = []
            await self._publisher.settle(outstanding, "the session", refusals_fail=False, deadline=settled_by)
        except UncertainOutcome as exc:
            uncertain = exc
        try:
            await self._publisher.close(timeout=max(0.0, settled_by + grace - loop.time()))
        except ConnectionFailed:
            if uncertain is None:
                raise
        if uncertain is not None:
            raise uncertain

    async def _apply_ended(self, deadline: float) -> None:
        """Wait (until ``deadline``, loop time) for an apply still sending (one its caller gave up on
        without waiting for it: a cancelled apply stops at its next message); UncertainOutcome when
        it does not end (the caller closes the connection under it)."""
        try:
            await asyncio.wait_for(
                self._no_apply.wait(), max(0.0, deadline - asyncio.get_running_loop().time())
            )
        except TimeoutError:
            raise UncertainOutcome(
                "an apply was still sending when the close's budget (ack_timeout "
                f"{self._publisher.config.ack_timeout:g}s) ran out: the connection was closed under it, "
                "and what it sent may or may not be stored",
                where=self.where,
            ) from None

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

    async def reader(self, stream: str, policy: WritePolicy, key: Sequence[str]) -> DestinationReader:
        """Read back what ``stream`` published, for ``faucet verify`` (:mod:`faucet_nats.verification`)."""
        from faucet_nats.verification import NatsDestinationReader

        return NatsDestinationReader(self.config, stream, partial(committed_watermark, self.config, stream))

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> NatsSinkSession:
        if policy is not WritePolicy.APPEND:
            raise ConfigError(
                f"the NATS sink appends; it cannot apply {policy.value}", where=self.config.stream
            )
        publisher = Publisher(self.config)
        try:
            js = await publisher.open()
            kv = await _watermark_bucket(js, self.config.watermark_bucket, publisher.where)
            session = NatsSinkSession(publisher, stream, kv)
        except BaseException:
            await publisher.close()
            raise
        return session


async def committed_watermark(config: NatsSinkConfig, stream: str) -> SinkCommitState | None:
    """What ``stream`` last committed to ``config``'s target, read without a session and without
    creating the watermark bucket (None: nothing committed, or no bucket yet)."""
    publisher = Publisher(config)
    try:
        js = await publisher.open()
        try:
            kv = await js.key_value(config.watermark_bucket)
        except nats.js.errors.BucketNotFoundError:
            return None
        except (nats.errors.Error, OSError) as exc:
            raise ConnectionFailed(
                f"opening the watermark bucket {config.watermark_bucket} failed: {type(exc).__name__}",
                where=publisher.where,
            ) from exc
        return await NatsSinkSession(publisher, stream, kv).last_committed()
    finally:
        await publisher.close()


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
        self._publisher: Publisher | None = None

    def capabilities(self) -> SinkCapabilities:
        return _capabilities(self.config, continuous=False)

    def dataset_uri(self) -> str:
        return f"nats://{self.config.servers[0].split('://')[-1]}/{self.config.stream}/{self.config.subject}"

    async def check(self) -> None:
        publisher = Publisher(self.config)
        try:
            await publisher.open()
        finally:
            await publisher.close()

    async def write_batch(self, records: pa.RecordBatch) -> int:
        """Publish every row and return once each was acknowledged (stored) by the stream."""
        if self._publisher is None:
            publisher = Publisher(self.config)
            try:
                await publisher.open()
            except BaseException:
                await publisher.close()
                raise
            self._publisher = publisher
        sent = Published("a batch", None, asyncio.get_running_loop().time())
        await self._publisher.publish(records, sent)
        await self._publisher.settle([sent], "a batch", refusals_fail=True)
        return len(sent.futures)

    async def close(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            await publisher.close()
