"""A JetStream push consumer read through a plain subscription, with proof that nothing was skipped.

:class:`PushConsumer` (re)creates its consumer at a given stream sequence, delivering to a private
inbox, and turns what arrives into ordered :class:`Chunk` values. Everything per message is done in
bulk with Arrow. Deliveries come straight from the client's protocol parser (:mod:`faucet_nats.direct`)
and are only appended, as plain tuples (:mod:`faucet_nats.chunks`); the subscription callback receives
flow control, heartbeats and statuses (and every message if the parser hook cannot be installed).

Why nothing is skipped, and how it is checked (for every chunk, before any of it is handed on):

* deliveries: a fresh consumer numbers its deliveries 1, 2, 3, ... (the consumer sequence, also for
  redeliveries). Every delivery number must arrive, in order; a missing one (a message lost between
  server and client) fails the read (:class:`IntegrityError`, retryable: a reopen recreates the
  consumer at the certified position). Idle heartbeats name the last delivery number, so a loss at
  the tail is caught too.
* stream sequences: a message whose stream sequence is above every one seen is new data; one at or
  below is a redelivery of something already held and is suppressed. Between two consecutive new
  messages (and between the start position and the first one), stream sequences may be absent only
  because those messages never matched the subject filter. That is proven from the stream itself,
  not assumed, before anything past the gap is handed on: one ``STREAM.MSG.GET`` with
  ``next_by_subj`` per gap must answer the next delivered sequence (or nothing), so no stored
  matching message is inside (else :class:`IntegrityError`); then one ``STREAM.INFO`` must show that
  no sequence of the gap was removed (purged, expired by ``max_age``, limited away by ``max_msgs``
  or ``max_bytes``, deleted): a removed message's subject is unknown, so it cannot be proven
  absent, and the read fails with :class:`PositionUnavailable` naming the stream and the range.
  The order matters: removal only ever grows, so a gap still fully stored after the ``next_by_subj``
  answer was fully stored when it was answered. A bounded read's end is proven the same way. With a
  subject filter, an idle consumer also proves ahead (:meth:`PushConsumer.prove_ahead`, once per
  idle heartbeat) that the stored messages after the last delivered one are of other subjects, so
  retention removing those later is not mistaken for loss.

Acknowledgement is cumulative (``AckAll``) and confirmed (the double ack: the server answers), sent
only by :meth:`PushConsumer.acknowledge`, after the caller's authority check. A background task keeps
every delivered, unacknowledged message alive with ``+WPI`` long before ``ack_wait`` runs out, so a
slow sink never causes a redelivery.
"""

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import pyarrow as pa
import pyarrow.compute as pc
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from faucet_dagster.protocol import (
    ConnectionFailed,
    FaucetError,
    IncarnationChanged,
    IntegrityError,
    OwnershipLost,
    WorkerIdentity,
)
from faucet_nats.chunks import (
    REPLY,
    Chunk,
    Delivery,
    Parsed,
    parse_replies,
    reply_prefix,
    strictly_increasing,
)
from faucet_nats.config import NatsSourceConfig
from faucet_nats.direct import deliver_directly
from faucet_nats.jetstream import JetStreamApi, StreamFacts, stream_missing
from faucet_nats.proofs import GapProofs

ACK_PREFIX = "$JS.ACK."
_ACK = b"+ACK"
_PROGRESS = b"+WPI"
_NANOS = 1_000_000_000
INLINE_PARSE_MESSAGES = 512
"""Arrivals up to this many are parsed on the event loop (a worker thread's hand-off costs more)."""


class PushConsumer:
    """One JetStream push consumer of one stream, delivering to this session's private inbox.

    Not safe for concurrent ``take``/``acknowledge`` calls (the session serializes them); the
    subscription callback and the keep-alive task run beside them on the same event loop.
    """

    def __init__(
        self,
        client: Client,
        api: JetStreamApi,
        config: NatsSourceConfig,
        facts: StreamFacts,
        *,
        start_after: int,
        durable: bool,
        worker: WorkerIdentity | None,
        where: str,
    ) -> None:
        self._client = client
        self._api = api
        self._config = config
        self.facts = facts
        self.where = where
        self._durable = durable
        self._worker = worker
        self.name = config.consumer_name if durable else ""
        self._inbox = client.new_inbox()
        self._subscription: Subscription | None = None
        self._restore: Callable[[], None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        # What arrived, not parsed yet (appended by _arrive, from the parser or the callback).
        self._incoming: list[Delivery] = []
        self._incoming_since = 0.0
        # What an intake is parsing right now (taken from _incoming, not yet a chunk).
        self._parsing: list[Delivery] = []
        self._parsing_since = 0.0
        self._arrived = asyncio.Event()
        self.activity = time.monotonic()
        self.failure: FaucetError | None = None
        self._prefix: str | None = None
        # Delivery bookkeeping: the last consumer sequence seen, the highest stream sequence seen.
        self._last_delivery = 0
        self.max_seen = start_after
        self._proofs = GapProofs(api, config, facts.name, proven=start_after, where=where)
        self.acked = start_after
        self.suppressed = 0
        self._stale_reply: tuple[int, str] | None = None
        # Parsed chunks: ready (not read), reading (handed on by the current read), covered (read to
        # a boundary, not acknowledged). Together with _incoming: every message the server counts as
        # delivered and not acknowledged.
        self.ready: deque[Chunk] = deque()
        self.reading: list[Chunk] = []
        self.covered: deque[Chunk] = deque()

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribe, then (re)create the consumer at ``start_after + 1``; start the keep-alive."""
        config = self._config
        try:
            self._subscription = await self._client.subscribe(
                self._inbox, cb=self._on_message, pending_msgs_limit=0, pending_bytes_limit=0
            )
        except (nats.errors.Error, OSError) as exc:
            raise ConnectionFailed(f"cannot subscribe: {type(exc).__name__}", where=self.where) from exc
        # Deliveries skip nats-py's per-message queue and task: the callback then sees statuses only.
        self._restore = deliver_directly(self._client, self._subscription, self._arrive)
        consumer: dict[str, Any] = {
            "deliver_subject": self._inbox,
            "deliver_policy": "by_start_sequence",
            "opt_start_seq": self.max_seen + 1,
            "ack_policy": "all",
            "ack_wait": int(config.ack_wait * _NANOS),
            "max_deliver": -1,
            "max_ack_pending": config.max_ack_pending,
            "replay_policy": "instant",
            "flow_control": True,
            "idle_heartbeat": int(config.idle_heartbeat * _NANOS),
            "description": "faucet stream source",
        }
        if config.subject:
            consumer["filter_subject"] = config.subject
        if self._worker is not None:
            consumer["metadata"] = {
                "faucet_worker": self._worker.worker_id,
                "faucet_fencing_token": str(self._worker.fencing_token),
            }
        if self._durable:
            consumer["durable_name"] = self.name
            # The certified position, not the consumer's memory, says where to resume: a consumer
            # left by an earlier session is replaced, and its unacknowledged deliveries with it.
            await self._api.delete_consumer(self.facts.name, self.name)
            await self._api.create_consumer(self.facts.name, consumer, durable=self.name)
        else:
            consumer["inactive_threshold"] = int(max(30.0, 4 * config.idle_heartbeat) * _NANOS)
            answer = await self._api.request(
                f"CONSUMER.CREATE.{self.facts.name}",
                {"stream_name": self.facts.name, "config": consumer},
                where=self.where,
            )
            self.name = str(answer.get("name", ""))
        self._keeper = asyncio.create_task(self._keep_alive(), name=f"faucet-nats-keepalive-{self.name}")

    async def close(self) -> None:
        """Stop the keep-alive and the subscription; an ephemeral consumer is deleted.

        Unacknowledged messages stay with the server: a durable consumer redelivers them (and the
        next session recreates it at its certified position anyway).
        """
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()
        subscription, self._subscription = self._subscription, None
        if subscription is not None and not self._client.is_closed:
            try:
                await subscription.unsubscribe()
            except (nats.errors.Error, OSError) as exc:
                raise ConnectionFailed(f"cannot unsubscribe: {type(exc).__name__}", where=self.where) from exc
        if not self._durable and self.name and not self._client.is_closed:
            await self._api.delete_consumer(self.facts.name, self.name)

    # -- arrival (parser hook and subscription callback) ------------------------------------------

    def _arrive(self, msg: Delivery) -> None:
        """A delivery (its reply is an acknowledgement subject): held as arrived, parsed by intake."""
        if not self._incoming:
            self._incoming_since = time.monotonic()
        self._incoming.append(msg)
        self._arrived.set()

    async def _on_message(self, msg: Msg) -> None:
        if msg.reply.startswith(ACK_PREFIX):
            self._arrive((msg.subject, msg.reply, msg.data, msg.headers))
            return
        try:
            await self._on_status(msg)
        except FaucetError as exc:
            self.failure = self.failure or exc
        except (nats.errors.Error, OSError) as exc:
            self.failure = self.failure or ConnectionFailed(
                f"cannot answer the server's flow control: {type(exc).__name__}", where=self.where
            )
        self._arrived.set()

    async def _on_status(self, msg: Msg) -> None:
        """Flow control, idle heartbeats and consumer status messages.

        Handled after deliveries that arrived behind them (those skip the callback's queue): a
        heartbeat's last delivery is compared with what was received by now, never less than at its
        arrival, so the check cannot see a loss that is not one.
        """
        self.activity = time.monotonic()
        headers = msg.headers or {}
        status = headers.get("Status")
        if status == "100":
            if msg.reply:
                await self._client.publish(msg.reply, b"")
            stalled = headers.get("Nats-Consumer-Stalled")
            if stalled:
                await self._client.publish(stalled, b"")
            last = headers.get("Nats-Last-Consumer")
            if last is not None and int(last) > self._received_delivery():
                raise IntegrityError(
                    f"the server delivered up to delivery {last}, this session received up to "
                    f"{self._received_delivery()}: deliveries were lost in transit",
                    where=self.where,
                    retryable=True,
                )
            return
        description = headers.get("Description", "")
        raise ConnectionFailed(
            f"the consumer reported status {status} {description}".strip(), where=self.where
        )

    def _received_delivery(self) -> int:
        """The consumer sequence of the last message received (parsed or not)."""
        last = self._incoming or self._parsing
        if last:
            tokens = last[-1][REPLY].split(".")
            # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>... or the 12-token domain form.
            return int(tokens[6] if len(tokens) == 9 else tokens[8])
        return self._last_delivery

    # -- intake ----------------------------------------------------------------------------------

    @property
    def has_incoming(self) -> bool:
        return bool(self._incoming)

    @property
    def max_ack_pending(self) -> int:
        return self._config.max_ack_pending

    @property
    def held(self) -> int:
        """Messages delivered and not acknowledged that this session holds (not counting arrivals)."""
        return (
            sum(map(len, itertools.chain(self.ready, self.reading, self.covered)))
            + len(self._incoming)
            + len(self._parsing)
        )

    async def wait(self, timeout: float) -> None:
        """Return when something arrived (a message or a status), or after ``timeout`` seconds."""
        if self._incoming or self.failure is not None:
            return
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), timeout)
        except TimeoutError:
            return

    async def intake(self, *, with_stamps: bool) -> None:
        """Parse what arrived into a chunk of new messages (redeliveries of held ones are suppressed).

        More than ``INLINE_PARSE_MESSAGES`` arrivals are parsed in a worker thread (Arrow without the
        GIL), so the event loop meanwhile receives the next deliveries; while they are parsed they
        still count as arrived (delivery checks, ``held``, keep-alive). A cancelled intake puts them
        back, unparsed, in front of what arrived since. Raises :class:`IntegrityError` when a delivery
        is missing.
        """
        if self.failure is not None:
            raise self.failure
        msgs = self._incoming
        if not msgs:
            return
        since = self._incoming_since
        self._incoming = []
        self._parsing, self._parsing_since = msgs, since
        try:
            if len(msgs) <= INLINE_PARSE_MESSAGES:
                parsed = self._parse(msgs, with_stamps=with_stamps)
            else:
                parsed = await asyncio.to_thread(self._parse, msgs, with_stamps=with_stamps)
        except asyncio.CancelledError:
            self._incoming[:0] = msgs
            self._incoming_since = since
            raise
        finally:
            self._parsing = []
        self.activity = time.monotonic()
        count = len(msgs)
        deliveries = parsed.deliveries
        first_delivery = int(deliveries[0].as_py())
        last_delivery = int(deliveries[-1].as_py())
        if (
            first_delivery != self._last_delivery + 1
            or last_delivery - first_delivery != count - 1
            or not strictly_increasing(deliveries)
        ):
            raise IntegrityError(
                f"deliveries {self._last_delivery + 1} to {last_delivery} arrived incomplete or out of "
                "order: messages were lost in transit",
                where=self.where,
                retryable=True,
            )
        self._last_delivery = last_delivery
        seqs = parsed.seqs
        if int(seqs[0].as_py()) > self.max_seen and strictly_increasing(seqs):
            keep: list[int] | None = None
        else:
            keep = self._new_indices(seqs.to_pylist(), msgs)
            if not keep:
                return
        positions, stamps = parsed.positions, parsed.stamps
        if keep is not None:
            indices = pa.array(keep, pa.int64())
            msgs = [msgs[index] for index in keep]
            seqs = seqs.take(indices)
            positions = [positions[index] for index in keep]
            stamps = None if stamps is None else stamps.take(indices)
        chunk = Chunk(msgs, seqs, positions, stamps, since, self._gaps(seqs))
        self.max_seen = chunk.last
        self.ready.append(chunk)

    def _new_indices(self, seqs: list[int], msgs: list[Delivery]) -> list[int]:
        """Indices of the new messages; redeliveries of held (or acknowledged) ones are suppressed."""
        keep: list[int] = []
        highest = self.max_seen
        for index, seq in enumerate(seqs):
            if seq > highest:
                keep.append(index)
                highest = seq
                continue
            self.suppressed += 1
            if seq <= self.acked and (self._stale_reply is None or seq > self._stale_reply[0]):
                # Already certified and acknowledged, yet redelivered: acknowledged again by the
                # next ``acknowledge``, after its authority check.
                self._stale_reply = (seq, msgs[index][REPLY])
        return keep

    def _gaps(self, seqs: pa.Int64Array) -> list[tuple[int, int]]:
        first, last = int(seqs[0].as_py()), int(seqs[-1].as_py())
        if first == self.max_seen + 1 and last - first == len(seqs) - 1:
            return []
        gaps: list[tuple[int, int]] = []
        previous = self.max_seen
        for seq in seqs.to_pylist():
            if seq != previous + 1:
                gaps.append((previous, seq))
            previous = seq
        return gaps

    def _parse(self, msgs: list[Delivery], *, with_stamps: bool) -> Parsed:
        """The acknowledgement subjects' fields, in bulk. Touches no state but the prefix (the same for
        every call): safe on a worker thread."""
        replies = [msg[REPLY] for msg in msgs]
        if self._prefix is None:
            self._prefix = reply_prefix(replies[0], self.facts.name, self.where)
        return parse_replies(replies, self._prefix, with_stamps=with_stamps, where=self.where)

    def take(self, limit: int, *, upto: int | None = None) -> Chunk | None:
        """The next ready chunk: at most ``limit`` messages, none past stream sequence ``upto``.

        The rest stays ready. The chunk is tracked as reading until given back or covered.
        """
        if not self.ready:
            return None
        chunk = self.ready.popleft()
        if upto is not None and chunk.last > upto:
            limit = min(limit, pc.sum(pc.less_equal(chunk.seqs, upto)).as_py() or 0)
            if limit == 0:
                self.ready.appendleft(chunk)
                return None
        if len(chunk) > limit:
            chunk, rest = chunk.split(limit)
            self.ready.appendleft(rest)
        self.reading.append(chunk)
        return chunk

    def give_back(self, chunks: list[Chunk]) -> None:
        """Put chunks a read took but did not cover back, in order, before the ready ones."""
        for chunk in reversed(chunks):
            self.reading.remove(chunk)
            self.ready.appendleft(chunk)

    def mark_covered(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            self.reading.remove(chunk)
            self.covered.append(chunk)

    # -- proofs ----------------------------------------------------------------------------------

    async def prove(self, chunk: Chunk) -> None:
        """Prove the gaps of ``chunk`` (:meth:`GapProofs.prove`)."""
        await self._proofs.prove(chunk)

    async def prove_ahead(self) -> None:
        """While caught up, prove ahead of the highest sequence seen (:meth:`GapProofs.prove_ahead`)."""
        await self._proofs.prove_ahead(self.max_seen)

    async def nothing_until(self, end: int) -> bool:
        """Whether nothing is left to deliver up to ``end`` (:meth:`GapProofs.nothing_until`)."""
        return await self._proofs.nothing_until(self.max_seen, end)

    async def diagnose(self) -> FaucetError | None:
        """Why deliveries and heartbeats stopped: the stream was deleted or recreated, the consumer was
        deleted or taken over by another session. None when the stream and consumer are as this
        session left them (the API answered, so the link works): the silence is forgotten."""
        try:
            facts = await self._api.stream(self.facts.name)
        except FaucetError as exc:
            if stream_missing(exc):
                return IncarnationChanged(
                    "the stream was deleted while this session read it", where=self.where
                )
            return exc
        if facts.incarnation != self.facts.incarnation:
            return IncarnationChanged(
                f"the stream was recreated: incarnation {facts.incarnation}, this session read "
                f"{self.facts.incarnation}",
                where=self.where,
            )
        info = await self._api.consumer(self.facts.name, self.name)
        if info is None:
            return ConnectionFailed(f"the consumer {self.name} was deleted", where=self.where)
        if info.get("config", {}).get("deliver_subject") != self._inbox:
            return OwnershipLost(
                f"the consumer {self.name} now delivers to another session", where=self.where
            )
        self.activity = time.monotonic()
        return None

    # -- acknowledgement and keep-alive -----------------------------------------------------------

    async def acknowledge(self, end: int, authority: Callable[[], Awaitable[None]]) -> None:
        """Acknowledge every message up to stream sequence ``end`` (covered by a read) cumulatively.

        ``authority()`` is awaited before each acknowledgement sent, including the one for a
        suppressed redelivery of an already acknowledged message. Idempotent.
        """
        if end > self.acked:
            reply = self._reply_for(end)
            await authority()
            await self._ack_confirmed(reply)
            self.acked = end
            self._drop_acknowledged(end)
        stale, self._stale_reply = self._stale_reply, None
        if stale is not None:
            try:
                await authority()
                await self._ack_confirmed(stale[1])
            except BaseException:
                self._stale_reply = stale
                raise

    def _reply_for(self, seq: int) -> str:
        for chunk in self.covered:
            if chunk.first <= seq <= chunk.last:
                index = pc.index(chunk.seqs, seq).as_py()
                if index >= 0:
                    return chunk.msgs[int(index)][REPLY]
        raise IntegrityError(
            f"stream sequence {seq} is not the end of anything this session read", where=self.where
        )

    def stamp_of(self, seq: int) -> int | None:
        """The server timestamp (nanoseconds since 1970) of message ``seq``, read from the
        acknowledgement subject it came with, while a read holds it (covered, not yet acknowledged);
        None otherwise."""
        for chunk in self.covered:
            if chunk.first <= seq <= chunk.last and self._prefix is not None:
                index = pc.index(chunk.seqs, seq).as_py()
                if index >= 0:
                    # <delivered>.<stream seq>.<consumer seq>.<timestamp>.<pending>[.<token>]
                    fields = chunk.msgs[index][REPLY][len(self._prefix) :].split(".")
                    return int(fields[3]) if len(fields) > 3 and fields[3].isdigit() else None
        return None

    def _drop_acknowledged(self, end: int) -> None:
        while self.covered and self.covered[0].last <= end:
            self.covered.popleft()
        if self.covered and self.covered[0].first <= end:
            count = pc.sum(pc.less_equal(self.covered[0].seqs, end)).as_py()
            self.covered[0] = self.covered[0].split(count)[1]

    async def _ack_confirmed(self, reply: str) -> None:
        """The double ack: send ``+ACK`` as a request and wait for the server's answer."""
        try:
            await self._client.request(reply, _ACK, timeout=self._config.request_timeout)
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            raise ConnectionFailed(
                f"the acknowledgement was not confirmed: {type(exc).__name__}", where=self.where
            ) from exc

    async def _keep_alive(self) -> None:
        """Send ``+WPI`` for every delivered, unacknowledged message the server last heard of more
        than half an ``ack_wait`` ago, checking four times per ``ack_wait``."""
        ack_wait = self._config.ack_wait
        stale_after = ack_wait / 2
        try:
            while True:
                await asyncio.sleep(ack_wait / 4)
                now = time.monotonic()
                for chunk in [*self.covered, *self.reading, *self.ready]:
                    if now - chunk.touched >= stale_after:
                        chunk.touched = now
                        await self._progress(chunk.msgs)
                if self._parsing and now - self._parsing_since >= stale_after:
                    self._parsing_since = now
                    await self._progress(list(self._parsing))
                if self._incoming and now - self._incoming_since >= stale_after:
                    self._incoming_since = now
                    await self._progress(list(self._incoming))
        except (nats.errors.Error, OSError) as exc:
            self.failure = self.failure or ConnectionFailed(
                f"cannot keep delivered messages alive: {type(exc).__name__}", where=self.where
            )
        except Exception as exc:  # noqa: BLE001 - recorded: the next read or acknowledgement raises it
            self.failure = self.failure or IntegrityError(
                f"keeping delivered messages alive failed: {exc!r}", where=self.where
            )

    async def _progress(self, msgs: list[Delivery]) -> None:
        publish = self._client.publish
        for msg in msgs:
            await publish(msg[REPLY], _PROGRESS)
