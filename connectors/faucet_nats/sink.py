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
:func:`_cancellation_watch`); every message it sent is settled by ``commit_epoch`` or
``close_session``.

After a server restart (or a dropped connection) mid-epoch: the publishes in flight, or only their
acknowledgements, are lost, and nats-py never resolves their futures. While settling (in
``commit_epoch``, and in ``close_session`` for aborted epochs) the sink re-publishes every message
still unanswered after ``republish_after`` while the connection is up, with the same payload and
``Nats-Msg-Id``, at most ``republish_attempts`` times, and only within the first
:data:`_WINDOW_SAFETY` of the duplicate window counted from the message's first publish: the stream
then stores it at most once, and a ``duplicate`` answer proves the first publish was stored. So a
restart mid-epoch costs a re-publish, not a halted stream: the commit succeeds with every message
stored exactly once. Receipts stay truthful: a re-published message answered ``duplicate`` of a
sequence after the stream's last sequence at ``begin_epoch`` was stored by this epoch's first publish
and counts as stored; otherwise as a duplicate; ``republished`` counts the messages re-published.
UncertainOutcome remains for what cannot be proven: acknowledgements still missing after
``ack_timeout`` (the total wait, re-publishes included), a message past the safe part of the window,
or a re-publish stored but answered after it (the first publish may be stored too). This assumes a
lost publish never reaches the server later than the window after its re-publish: one connection's
bytes arrive in order, and a dropped connection's unread bytes die with it or with the server.
Memory: until settled, the sink holds each published message's payload and id (about the epoch's
JSON size), and for an aborted epoch with unanswered publishes until ``close_session``.

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
import functools
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
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

_WINDOW_SAFETY = 0.9
"""The part of the duplicate window, counted from a message's first publish, within which a re-publish
must be answered to be trusted; the rest absorbs the server's timers and clock-rate differences."""

_RESEND_BACKOFF = (0.05, 1.0)
"""First and longest pause (seconds) before sending a re-publish again that the client refused."""

LOG = logging.getLogger("faucet_nats")


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


def _cancellation_watch() -> Callable[[], bool]:
    """Whether the current task was asked to cancel since this call.

    nats-py swallows a cancellation that arrives while ``publish_async`` waits (its flush helper
    catches CancelledError, and Python 3.11's ``wait_for`` returns a result that was ready when the
    cancellation came), so a cancelled publishing loop would go on sending the rest of its batch
    and return as if it completed. The task still counts the request (``Task.cancelling``): the
    loop asks after every message and stops there, every message sent so far tracked.
    """
    task = asyncio.current_task()
    if task is None:
        return lambda: False
    before = task.cancelling()
    return lambda: task.cancelling() > before


@dataclass(eq=False)
class _Published:
    """The messages one ``publish`` call sent, kept until they are settled, so they can be re-published.

    ``payloads[i]`` and ``ids[i]`` (``Nats-Msg-Id``; None for the bounded sink, never re-published) are
    what message ``i`` was sent with, ``futures[i]`` the acknowledgement of its latest publish. ``sent_at``
    is the loop time taken before the first of them was sent: earlier than any reached the server.
    ``retries`` maps every re-published message to its number of re-publishes, ``answered_at`` to when
    its latest re-publish was answered. Memory: each message's JSON payload and id until the epoch is
    settled (about the epoch's JSON size plus some 200 bytes per message).
    """

    resource: str
    ids: Sequence[str] | None
    sent_at: float
    payloads: list[bytes] = field(default_factory=list)
    futures: list[asyncio.Future[PubAck]] = field(default_factory=list)
    retries: dict[int, int] = field(default_factory=dict)
    answered_at: dict[int, float] = field(default_factory=dict)

    def unanswered(self) -> list[int]:
        """The messages whose latest publish has no answer (pending, or cancelled to re-publish it)."""
        return [index for index, future in enumerate(self.futures) if not future.done() or future.cancelled()]

    def record_answer(self, index: int, future: asyncio.Future[PubAck]) -> None:
        if not future.cancelled():
            self.answered_at[index] = future.get_loop().time()


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

    async def last_sequence(self) -> int:
        """The target stream's last sequence now: every message stored before this call is at or below it."""
        if self._client is None:
            raise LifecycleError("the NATS sink is not open", where=self.where)
        return (await JetStreamApi(self._client, self.config).stream(self.config.stream)).last_seq

    async def publish(self, records: pa.RecordBatch, sent: _Published) -> None:
        """Publish every row as a JSON message (with ``Nats-Msg-Id`` when ``sent.ids`` are given),
        appending each message and its acknowledgement future to ``sent`` as soon as it is sent (so a
        failure part-way leaves the sent ones there to settle). Blocks while ``max_outstanding_acks``
        are outstanding."""
        js = self._require()
        dumps = json.dumps
        subject, stall, ids = self.config.subject, self.config.ack_timeout, sent.ids
        payloads, futures = sent.payloads, sent.futures
        cancelled = _cancellation_watch()
        try:
            for index, row in enumerate(records.to_pylist()):
                payload = dumps(row, default=_json_default, separators=(",", ":")).encode()
                headers = None if ids is None else {"Nats-Msg-Id": ids[index]}
                futures.append(await js.publish_async(subject, payload, wait_stall=stall, headers=headers))
                payloads.append(payload)
                if cancelled():
                    raise asyncio.CancelledError
        except TypeError as exc:
            raise IntegrityError(f"a row cannot be encoded as JSON: {exc}", where=self.where) from exc
        except nats.js.errors.TooManyStalledMsgsError as exc:
            if cancelled():  # nats-py reports a cancelled wait for a free slot as a stall
                raise asyncio.CancelledError from exc
            raise ConnectionFailed(
                f"{self.config.max_outstanding_acks} publishes waited {stall}s for their acknowledgements",
                where=self.where,
            ) from exc
        except (nats.errors.Error, OSError) as exc:
            raise ConnectionFailed(f"publishing failed: {type(exc).__name__}", where=self.where) from exc

    async def settle(self, published: Sequence[_Published], what: str, *, refusals_fail: bool) -> None:
        """Wait until every message of ``published`` is answered, re-publishing those that may be lost.

        Every ``republish_after`` seconds in which some stayed unanswered, and only while the connection
        is up (a publish sent while it reconnects would queue behind the lost ones), each unanswered
        message with an ``Nats-Msg-Id`` is re-published under that id, at most ``republish_attempts``
        times, and only while within :data:`_WINDOW_SAFETY` of the duplicate window since its first
        publish (the stream then stores it at most once). Blocks at most ``ack_timeout`` in total,
        re-publishes included. On return every message's future holds its acknowledgement or refusal.

        Raises UncertainOutcome when some are unanswered at the deadline (or the connection closed for
        good), or when a re-publish was stored but answered past the safe part of the window (the
        first publish may be stored too); ConnectionFailed for a refusal when ``refusals_fail``
        (a refused publish stored nothing: ``close_session`` accepts it).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.ack_timeout
        while True:
            if refusals_fail:
                self._raise_refusal(published, what)
            # Cancelled (unanswered, not waiting) publishes remain only when a re-publish could not be
            # sent before the deadline or the connection closed for good: then nothing is left to do.
            waiting = [future for sent in published for future in sent.futures if not future.done()]
            remaining = deadline - loop.time()
            if not waiting or remaining <= 0 or self._closed():
                break
            _, pending = await asyncio.wait(waiting, timeout=min(remaining, self.config.republish_after))
            if pending and loop.time() < deadline:
                await self._republish(published, deadline)
        self._check_settled(published, what)

    async def _republish(self, published: Sequence[_Published], deadline: float) -> None:
        """Re-publish each unanswered message that may be (see :meth:`settle`) under its id."""
        client = self._client
        if client is None or not client.is_connected:
            return
        js = self._require()
        loop = asyncio.get_running_loop()
        safe = self.config.duplicate_window * _WINDOW_SAFETY
        count = 0
        for sent in published:
            if sent.ids is None:
                continue  # no message id: a second publish would store a second message
            for index in sent.unanswered():
                attempts = sent.retries.get(index, 0)
                if attempts >= self.config.republish_attempts or loop.time() >= sent.sent_at + safe:
                    continue
                # Cancelling frees nats-py's slot (it never resolves a lost publish); an answer to the
                # cancelled publish arriving later is dropped: the re-publish answers for the message.
                sent.futures[index].cancel()
                sent.retries[index] = attempts + 1
                future = await self._send_again(js, sent, index, deadline)
                if future is None:
                    return
                future.add_done_callback(functools.partial(sent.record_answer, index))
                sent.futures[index] = future
                count += 1
        if count:
            LOG.warning(
                "re-published %d unacknowledged messages under their Nats-Msg-Id (%s)", count, self.where
            )

    async def _send_again(
        self, js: JetStreamContext, sent: _Published, index: int, deadline: float
    ) -> asyncio.Future[PubAck] | None:
        """Send message ``index`` of ``sent`` again; while the client refuses (its buffer is full while
        it reconnects, the connection dropped again), retry with growing pauses until ``deadline``.
        None when the deadline passed or the connection is closed for good."""
        assert sent.ids is not None
        loop = asyncio.get_running_loop()
        pause, longest = _RESEND_BACKOFF
        headers = {"Nats-Msg-Id": sent.ids[index]}
        while (remaining := deadline - loop.time()) > 0 and not self._closed():
            try:
                return await js.publish_async(
                    self.config.subject, sent.payloads[index], wait_stall=remaining, headers=headers
                )
            except (nats.errors.Error, OSError):
                # Not sent; the message stays unanswered and the deadline decides (UncertainOutcome).
                await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
                pause = min(2 * pause, longest)
        return None

    def _raise_refusal(self, published: Sequence[_Published], what: str) -> None:
        for sent in published:
            for future in sent.futures:
                if future.done() and not future.cancelled() and (error := future.exception()) is not None:
                    raise ConnectionFailed(
                        f"the stream refused a publish of {what}: {error}", where=self.where, retryable=True
                    ) from error

    def _check_settled(self, published: Sequence[_Published], what: str) -> None:
        """UncertainOutcome unless every message is answered and each stored re-publish was answered
        within the safe part of the duplicate window."""
        now = asyncio.get_running_loop().time()
        safe = self.config.duplicate_window * _WINDOW_SAFETY
        window = f"{_WINDOW_SAFETY:.0%} of the {self.config.duplicate_window:g}s duplicate window"
        unanswered = too_late = 0
        for sent in published:
            missing = len(sent.unanswered())
            unanswered += missing
            if sent.ids is not None and now >= sent.sent_at + safe:
                too_late += missing
        if unanswered:
            total = sum(len(sent.futures) for sent in published)
            reason = ""
            if self._closed():
                reason = " (the connection is closed)"
            elif too_late:
                reason = f" ({too_late} of them past {window}, where a re-publish could store them twice)"
            raise UncertainOutcome(
                f"{unanswered} of {total} publishes of {what} were not acknowledged within "
                f"{self.config.ack_timeout:g}s{reason}: they may or may not be stored{_naming(published)}",
                where=self.where,
            )
        for sent in published:
            for index, answered in sent.answered_at.items():
                future = sent.futures[index]
                if (
                    answered >= sent.sent_at + safe
                    and future.exception() is None
                    and not future.result().duplicate
                ):
                    raise UncertainOutcome(
                        f"a re-publish of {what} was stored after {window}: its first publish may be "
                        "stored too",
                        where=self.where,
                    )

    def _closed(self) -> bool:
        return self._client is None or self._client.is_closed

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


def _naming(published: Sequence[_Published], shown: int = 3) -> str:
    """Which messages are unanswered: their resource and first ``Nats-Msg-Id`` values."""
    names = [
        f"{sent.resource} {sent.ids[index] if sent.ids is not None else f'#{index}'}"
        for sent in published
        for index in sent.unanswered()
    ]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f" ({', '.join(names[:shown])}{more})" if names else ""


def _receipts(published: Sequence[_Published], baseline: int, config: NatsSinkConfig) -> tuple[Receipt, ...]:
    """One receipt per resource, in the order of their first batch, from settled publishes.

    A message counts as stored by this epoch when its acknowledgement is not a duplicate, or when it
    was re-published and the duplicate it names was stored after ``baseline`` (the stream's last
    sequence before the epoch's first publish): then the epoch's own first publish stored it and only
    its acknowledgement was lost. (Were a worker that lost its lease publishing the same identities
    during this epoch, a message it stored first would be claimed by both receipts; it is stored once.)
    Otherwise it is a duplicate the stream suppressed.
    """
    stored: dict[str, list[int]] = {}
    duplicates: dict[str, int] = {}
    republished: dict[str, int] = {}
    for sent in published:
        sequences = stored.setdefault(sent.resource, [])
        suppressed = 0
        for index, future in enumerate(sent.futures):
            ack = future.result()
            if not ack.duplicate or (index in sent.retries and ack.seq > baseline):
                sequences.append(ack.seq)
            else:
                suppressed += 1
        duplicates[sent.resource] = duplicates.get(sent.resource, 0) + suppressed
        republished[sent.resource] = republished.get(sent.resource, 0) + len(sent.retries)
    receipts = []
    for resource, sequences in stored.items():
        details = {
            "stream": config.stream,
            "subject": config.subject,
            "duplicates": str(duplicates[resource]),
            "republished": str(republished[resource]),
        }
        if sequences:
            details["first_sequence"] = str(min(sequences))
            details["last_sequence"] = str(max(sequences))
        receipts.append(Receipt(resource, len(sequences), duplicates[resource], details))
    return tuple(receipts)


@dataclass
class _Epoch:
    """The active epoch: the stream's last sequence before its first publish, and what it published."""

    epoch: EpochId
    baseline: int
    published: list[_Published] = field(default_factory=list)


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
        self._unsettled: list[_Published] = []
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
        sent = _Published(batch.resource, ids, asyncio.get_running_loop().time())
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
        safe (see :meth:`_Publisher.settle`); waits at most ``ack_timeout`` for them, then stores the
        watermark (up to ``request_timeout`` per request). A message the epoch stored once counts once
        as stored, whichever of its publishes was acknowledged (see :func:`_receipts`); the receipt's
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
        return _receipts(active.published, active.baseline, self._publisher.config)

    async def abort_epoch(self, epoch: EpochId) -> None:
        """Forget the epoch. What it published stays in the stream (NATS cannot unpublish); its
        unanswered publishes are settled by ``close_session``."""
        active = self._require_active(epoch, "abort")
        self._unsettled.extend(sent for sent in active.published if sent.unanswered())
        self._active = None

    async def close_session(self) -> None:
        """Wait for an apply still sending (see :meth:`_apply_ended`), then settle every unanswered
        publish of the session (aborted epochs and the active one) as ``commit_epoch`` does,
        re-publishing lost ones while the duplicate window allows, within ``ack_timeout``; then close
        the connection. A refused publish stored nothing and is settled. Raises UncertainOutcome,
        naming the first unanswered messages, when some are still unanswered: they are abandoned
        (the connection is closed) but may still be stored after this returns. Idempotent once it
        succeeded."""
        if self._closed:
            return
        self._closed = True
        await self._apply_ended()
        outstanding = self._unsettled
        if self._active is not None:
            outstanding.extend(self._active.published)
            self._active = None
        self._unsettled = []
        uncertain: UncertainOutcome | None = None
        try:
            await self._publisher.settle(outstanding, "the session", refusals_fail=False)
        except UncertainOutcome as exc:
            uncertain = exc
        await self._publisher.close()
        if uncertain is not None:
            raise uncertain

    async def _apply_ended(self) -> None:
        """Wait (at most ``ack_timeout``) for an apply still sending (one its caller gave up on
        without waiting for it: a cancelled apply stops at its next message); UncertainOutcome,
        after closing the connection, when it does not end."""
        try:
            await asyncio.wait_for(self._no_apply.wait(), self._publisher.config.ack_timeout)
        except TimeoutError:
            await self._publisher.close()
            raise UncertainOutcome(
                f"an apply was still sending after {self._publisher.config.ack_timeout:g}s: the "
                "connection was closed under it, and what it sent may or may not be stored",
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
        sent = _Published("a batch", None, asyncio.get_running_loop().time())
        await self._publisher.publish(records, sent)
        await self._publisher.settle([sent], "a batch", refusals_fail=True)
        return len(sent.futures)

    async def close(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            await publisher.close()
