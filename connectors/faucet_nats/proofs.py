"""The proofs a push consumer's reads rest on, asked of the stream itself: that stream sequences it
did not deliver never held a message of its subject filter, and were not removed before they could
be proven so (see :mod:`faucet_nats.consumer` for why and in which order).
"""

import asyncio
import time

from faucet_dagster.protocol import IntegrityError, PositionUnavailable
from faucet_nats.chunks import Chunk
from faucet_nats.config import NatsSourceConfig
from faucet_nats.jetstream import JetStreamApi, Removed

_PROOF_CONCURRENCY = 256


class GapProofs:
    """The gap and end proofs of one consumer of one stream, and how far it is proven ahead."""

    def __init__(
        self, api: JetStreamApi, config: NatsSourceConfig, stream: str, *, proven: int, where: str
    ) -> None:
        self._api = api
        self._config = config
        self._stream = stream
        self.where = where
        # Filtered: every sequence up to here is proven to never have held a message of the filter
        # (proven ahead while idle, before retention can remove the other subjects' messages).
        self.proven = proven
        self._proven_at = 0.0

    async def prove(self, chunk: Chunk) -> None:
        """Prove every gap of ``chunk`` never held a message the consumer should have delivered.

        Raises :class:`IntegrityError` when a stored matching message is inside a gap (it was not
        delivered) and :class:`PositionUnavailable` when a gap holds removed sequences.
        """
        if not chunk.gaps:
            return
        limiter = asyncio.Semaphore(_PROOF_CONCURRENCY)

        async def check(after: int, before: int) -> None:
            async with limiter:
                found = await self._api.next_sequence(self._stream, after, self._config.subject)
            if found is not None and found < before:
                raise IntegrityError(
                    f"stream sequence {found} matches this consumer but was not delivered between "
                    f"{after} and {before}",
                    where=self.where,
                )

        # What the idle proof covered already needs no proof (and may have been removed since).
        gaps = [(max(after, self.proven), before) for after, before in chunk.gaps]
        gaps = [(after, before) for after, before in gaps if before - after > 1]
        if gaps:
            await asyncio.gather(*(check(after, before) for after, before in gaps))
            removed = await self._api.removed(self._stream)
            for after, before in gaps:
                self._check_kept(removed, after + 1, before - 1)
        chunk.gaps = []

    async def prove_ahead(self, max_seen: int) -> None:
        """While caught up, prove the stored sequences after the highest seen (``max_seen``) hold no
        message of the filter, so later removal of those (other subjects') messages is not mistaken
        for loss.

        At most once per ``idle_heartbeat``, and only with a subject filter (without one every
        message is delivered: there is nothing to prove ahead). The stream's last sequence is read
        before the ``next_by_subj`` answer and the removals after it, as :meth:`prove` does.
        """
        now = time.monotonic()
        if not self._config.subject or now - self._proven_at < self._config.idle_heartbeat:
            return
        self._proven_at = now
        start = max(max_seen, self.proven)
        last = (await self._api.stream(self._stream)).last_seq
        if last <= start:
            return
        found = await self._api.next_sequence(self._stream, start, self._config.subject)
        upto = last if found is None else min(last, found - 1)
        if upto > start and not (await self._api.removed(self._stream)).count_within(start + 1, upto):
            self.proven = upto

    async def nothing_until(self, max_seen: int, end: int) -> bool:
        """True when the sequences after the highest seen (``max_seen``), up to ``end``, are proven to
        hold no message of the filter (as :meth:`prove` proves a gap); False while a matching one is
        stored there.

        Raises :class:`PositionUnavailable` when one of them was removed before it was delivered.
        """
        if max_seen >= end:
            return True
        found = await self._api.next_sequence(self._stream, max_seen, self._config.subject)
        if found is not None and found <= end:
            return False
        self._check_kept(await self._api.removed(self._stream), max_seen + 1, end)
        return True

    def _check_kept(self, removed: Removed, low: int, high: int) -> None:
        count = removed.count_within(low, high)
        if count:
            raise self._lost(low, high, count)

    def _lost(self, low: int, high: int, count: int) -> PositionUnavailable:
        span = f"sequence {low}" if low == high else f"sequences {low} to {high}"
        return PositionUnavailable(
            f"stream {self._stream}: {count} of the undelivered {span} "
            f"{'was' if count == 1 else 'were'} removed (purged, expired by max_age, limited away by "
            "max_msgs or max_bytes, or deleted) while this consumer lagged: a removed message cannot "
            f"be proven absent, so nothing past sequence {low - 1} is read",
            where=self.where,
        )
