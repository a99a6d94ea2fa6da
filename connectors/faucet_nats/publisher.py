"""Publishing an epoch's rows to JetStream and settling their acknowledgements (see
:mod:`faucet_nats.sink` for what the sink promises): :class:`Publisher` sends each row as a JSON
message with its ``Nats-Msg-Id``, many outstanding, and settles them: waits for every
acknowledgement, re-publishes the lost ones within the safe part of the duplicate window
(:data:`WINDOW_SAFETY`), and names what it cannot prove stored; :func:`receipts` counts what an
epoch stored and what the stream suppressed.
"""

import asyncio
import base64
import datetime
import decimal
import functools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
import pyarrow as pa
from nats.aio.client import Client
from nats.js.api import PubAck
from nats.js.client import JetStreamContext

from faucet_dagster.protocol import (
    ConfigError,
    ConnectionFailed,
    FaucetError,
    IntegrityError,
    LifecycleError,
    Receipt,
    UncertainOutcome,
)
from faucet_nats.jetstream import JetStreamApi, connect, stream_missing
from faucet_nats.sink_config import NatsSinkConfig

WINDOW_SAFETY = 0.9
"""The part of the duplicate window, counted from a message's first publish, within which a re-publish
must be answered to be trusted; the rest absorbs the server's timers and clock-rate differences."""

RESEND_BACKOFF = (0.05, 1.0)
"""First and longest pause (seconds) before sending a re-publish again that the client refused."""

UNSENT_LIMIT = 8 * 1024 * 1024
"""Bytes of publishes the client may hold unsent (the server reads slower than the sink publishes)
before ``publish`` waits for them to leave: nats-py's own limit (64 MiB) waits without a bound."""

CLOSE_GRACE = 1.0
"""Seconds of a close's budget kept for closing the connection itself (at most a tenth of it)."""

LOG = logging.getLogger("faucet_nats")


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` matches one token, a final ``>`` one or more."""
    wanted, tokens = pattern.split("."), subject.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > index
        if index >= len(tokens) or (token != "*" and token != tokens[index]):
            return False
    return len(tokens) == len(wanted)


def json_default(value: Any) -> Any:
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


def cancellation_watch() -> Callable[[], bool]:
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
class Published:
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


class Publisher:
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
        if not any(subject_matches(pattern, self.config.subject) for pattern in subjects):
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
        self._js = client.jetstream(
            prefix=prefix,
            timeout=self.config.request_timeout,  # every request it makes (the watermark bucket's too)
            publish_async_max_pending=self.config.max_outstanding_acks,
        )
        return self._js

    async def last_sequence(self) -> int:
        """The target stream's last sequence now: every message stored before this call is at or below it."""
        if self._client is None:
            raise LifecycleError("the NATS sink is not open", where=self.where)
        return (await JetStreamApi(self._client, self.config).stream(self.config.stream)).last_seq

    async def publish(self, records: pa.RecordBatch, sent: Published) -> None:
        """Publish every row as a JSON message (with ``Nats-Msg-Id`` when ``sent.ids`` are given),
        appending each message and its acknowledgement future to ``sent`` as soon as it is sent (so a
        failure part-way leaves the sent ones there to settle). Blocks while ``max_outstanding_acks``
        are outstanding."""
        js = self._require()
        dumps = json.dumps
        subject, stall, ids = self.config.subject, self.config.ack_timeout, sent.ids
        payloads, futures = sent.payloads, sent.futures
        cancelled = cancellation_watch()
        try:
            for index, row in enumerate(records.to_pylist()):
                if self._client is not None and self._client.pending_data_size > UNSENT_LIMIT:
                    await self._unsent_drained(stall)
                payload = dumps(row, default=json_default, separators=(",", ":")).encode()
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

    async def _unsent_drained(self, stall: float) -> None:
        """Wait (at most ``stall`` seconds) until the client's unsent publishes fall below
        :data:`UNSENT_LIMIT`; ConnectionFailed when the server does not read them (it hangs)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + stall
        while (client := self._client) is not None and client.pending_data_size > UNSENT_LIMIT:
            if loop.time() >= deadline:
                raise ConnectionFailed(
                    f"the server read none of {client.pending_data_size} bytes of publishes for {stall:g}s",
                    where=self.where,
                )
            await asyncio.sleep(0.01)

    async def settle(
        self, published: Sequence[Published], what: str, *, refusals_fail: bool, deadline: float | None = None
    ) -> None:
        """Wait until every message of ``published`` is answered, re-publishing those that may be lost.

        Every ``republish_after`` seconds in which some stayed unanswered, and only while the connection
        is up (a publish sent while it reconnects would queue behind the lost ones), each unanswered
        message with an ``Nats-Msg-Id`` is re-published under that id, at most ``republish_attempts``
        times, and only while within :data:`WINDOW_SAFETY` of the duplicate window since its first
        publish (the stream then stores it at most once). Blocks at most ``ack_timeout`` in total,
        re-publishes included. On return every message's future holds its acknowledgement or refusal.

        Raises UncertainOutcome when some are unanswered at the deadline (or the connection closed for
        good), or when a re-publish was stored but answered past the safe part of the window (the
        first publish may be stored too); ConnectionFailed for a refusal when ``refusals_fail``
        (a refused publish stored nothing: ``close_session`` accepts it). ``deadline`` (loop time)
        ends the wait earlier than ``ack_timeout`` from now.
        """
        loop = asyncio.get_running_loop()
        budget_end = loop.time() + self.config.ack_timeout
        deadline = budget_end if deadline is None else min(deadline, budget_end)
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

    async def _republish(self, published: Sequence[Published], deadline: float) -> None:
        """Re-publish each unanswered message that may be (see :meth:`settle`) under its id."""
        client = self._client
        if client is None or not client.is_connected:
            return
        js = self._require()
        loop = asyncio.get_running_loop()
        safe = self.config.duplicate_window * WINDOW_SAFETY
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
        self, js: JetStreamContext, sent: Published, index: int, deadline: float
    ) -> asyncio.Future[PubAck] | None:
        """Send message ``index`` of ``sent`` again; while the client refuses (its buffer is full while
        it reconnects, the connection dropped again), retry with growing pauses until ``deadline``.
        None when the deadline passed or the connection is closed for good."""
        assert sent.ids is not None
        loop = asyncio.get_running_loop()
        pause, longest = RESEND_BACKOFF
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

    def _raise_refusal(self, published: Sequence[Published], what: str) -> None:
        for sent in published:
            for future in sent.futures:
                if future.done() and not future.cancelled() and (error := future.exception()) is not None:
                    raise ConnectionFailed(
                        f"the stream refused a publish of {what}: {error}", where=self.where, retryable=True
                    ) from error

    def _check_settled(self, published: Sequence[Published], what: str) -> None:
        """UncertainOutcome unless every message is answered and each stored re-publish was answered
        within the safe part of the duplicate window."""
        now = asyncio.get_running_loop().time()
        safe = self.config.duplicate_window * WINDOW_SAFETY
        window = f"{WINDOW_SAFETY:.0%} of the {self.config.duplicate_window:g}s duplicate window"
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
                f"{self.config.ack_timeout:g}s{reason}: they may or may not be stored{naming(published)}",
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

    async def close(self, timeout: float | None = None) -> None:
        """Close the connection: nats-py flushes what it holds unsent, then closes the socket.

        Against a server that hangs that waits without a bound (the flush and the socket's own
        close wait for the server to read). With ``timeout`` (seconds) it waits at most that long,
        then aborts the socket (a reset: what the kernel still holds unsent is dropped; what the
        server's kernel already received it may still read when it resumes, which is why a close
        of the sink only promises something when every publish was answered before)."""
        client, self._client, self._js = self._client, None, None
        if client is None or client.is_closed:
            return
        closing = asyncio.ensure_future(client.close())
        try:
            done, _ = await asyncio.wait({closing}, timeout=timeout)
            if not done:
                LOG.warning("the connection did not close within %gs: aborted (%s)", timeout, self.where)
                _abort(client)
                await asyncio.wait({closing}, timeout=CLOSE_GRACE)
                if not closing.done():
                    closing.cancel()
                    await asyncio.wait({closing})
                return
            closing.result()
        except (nats.errors.Error, OSError) as exc:
            raise ConnectionFailed(f"closing the connection failed: {exc}", where=self.where) from exc
        finally:
            if closing.done() and not closing.cancelled():
                closing.exception()  # retrieved: an aborted close's error is expected

    def _require(self) -> JetStreamContext:
        if self._js is None:
            raise LifecycleError("the NATS sink is not open", where=self.where)
        return self._js


def _abort(client: Client) -> None:
    """Reset the client's socket at once (nats-py has no public way to: its transport's writer)."""
    transport = getattr(client, "_transport", None)
    writer = getattr(transport, "_io_writer", None)
    if writer is not None:
        writer.transport.abort()


def naming(published: Sequence[Published], shown: int = 3) -> str:
    """Which messages are unanswered: their resource and first ``Nats-Msg-Id`` values."""
    names = [
        f"{sent.resource} {sent.ids[index] if sent.ids is not None else f'#{index}'}"
        for sent in published
        for index in sent.unanswered()
    ]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f" ({', '.join(names[:shown])}{more})" if names else ""


def receipts(published: Sequence[Published], baseline: int, config: NatsSinkConfig) -> tuple[Receipt, ...]:
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
