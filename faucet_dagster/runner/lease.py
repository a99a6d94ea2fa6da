"""A stream's lease in one worker: taken, renewed in the background, handed over, released.

The lease is short (``ttl`` seconds, 15 by default for a stream) and a keeper task on the event loop
that took it renews it every third of that while it is held, between epochs too, so a worker that
dies without releasing it (kill -9) holds the stream up for seconds only. The keeper also answers a
hand-over request (a newer worker found the lease live, :meth:`StateStore.try_acquire_lease`) through
the holder's ``on_handover`` callback, which stops at a certified position and passes the lease on
(:meth:`StreamLease.release` with ``hand_over``). A worker that
finds a live lease waits a few seconds for a hand-over it asked for, or for a lease about to expire;
a reader between sensor ticks waits on a holder it asked for as long as that holder's lease can last
(a killed holder cannot answer: its lease is taken the moment it expires, not a sensor interval later).
Fencing tokens only grow, so a holder that lost its lease can neither certify nor acknowledge.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from faucet_dagster.protocol import FaucetError, OwnershipLost
from faucet_dagster.state import Lease, StateStore

logger = logging.getLogger(__name__)

HANDOVER_WAIT_SECONDS = 5.0
"""How long taking a lease waits for a live holder to hand over, or for a lease about to expire."""
LEASE_POLL_SECONDS = 0.5
"""How often the keeper looks for a hand-over request (it renews every third of the lease)."""


class StreamLease:
    """``owner``'s lease on ``stream``, with its keeper task. Used from one event loop at a time.

    ``started`` (seconds since 1970) orders workers for hand-overs: a worker that started later takes
    a stream over from a live earlier one, never the other way round. ``on_handover(lease, requester)``
    is awaited by the keeper when a newer worker asks for the stream; ``on_lost()`` is called when a
    renewal is refused (the stream was taken over): it should interrupt the work in progress.
    """

    def __init__(
        self,
        store: StateStore,
        stream: str,
        owner: str,
        ttl: float,
        started: float,
        *,
        on_handover: Callable[[Lease, str], Awaitable[None]],
        on_lost: Callable[[], None],
    ) -> None:
        self._store = store
        self._stream = stream
        self._owner = owner
        self._ttl = ttl
        self._started = started
        self._on_handover = on_handover
        self._on_lost = on_lost
        self._lease: Lease | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._renewed = 0.0
        """``time.monotonic()`` before the store last took or renewed the lease for ``ttl`` seconds:
        it lives at least until ``_renewed + ttl`` unless the holder gives it up or an operator
        releases it."""
        self.waiting: str | None = None
        """While taking the lease waits on a live one: who holds it, for how long, whether asked."""

    @property
    def current(self) -> Lease | None:
        """The lease held, as last renewed (None: not held)."""
        return self._lease

    async def hold(self, deadline: float | None, *, patient: Callable[[], bool] | None = None) -> Lease:
        """The lease, newly taken or still held: renewed unless it was taken or renewed less than a
        third of ``ttl`` ago (the keeper renews it that often; it then lives at least two thirds of
        ``ttl`` more unless it is given up, which the certificate's append and every acknowledgement's
        authority check in the store). Taken from a free or expired lease, from a holder that hands
        over, or from one whose lease ends before ``deadline`` (on the loop's clock; at most
        ``HANDOVER_WAIT_SECONDS`` from now). While ``patient()`` is true (a reader between ticks,
        whose tick does not wait for it; false once it is stopped), a holder this worker asked to
        hand over is waited for as long as the lease it holds can last (its time left, at least
        ``ttl``), past ``deadline`` and ``HANDOVER_WAIT_SECONDS``, so the lease of a holder that died
        (it cannot answer) is taken the moment it expires; a holder that was not asked (it started
        later) is waited for only as without ``patient``. While it waits, :attr:`waiting` says on
        whom. Starts the keeper. Raises :class:`OwnershipLost`."""
        try:
            if self._lease is None:
                self._lease = await self._take(deadline, patient)
            elif time.monotonic() - self._renewed >= self._ttl / 3:
                await self._renew(self._lease)
        except OwnershipLost:
            self._lease = None
            raise
        lease = self._lease
        if lease is None:  # given up meanwhile (a hand-over or a close)
            raise OwnershipLost(f"{self._owner} gave the lease on {self._stream!r} up", where=self._stream)
        loop = asyncio.get_running_loop()
        if self._keeper is None or self._keeper.done() or self._keeper.get_loop() is not loop:
            self._keeper = loop.create_task(self._keep(), name=f"faucet-lease-{self._stream}")
        return lease

    async def check(self) -> None:
        """Raise :class:`OwnershipLost` unless the lease is still held (the acknowledgement's authority).

        Always asks the store (one read): the lease may have been released by an operator and taken
        by another worker since the certificate was appended, and that must refuse the acknowledgement.
        """
        lease = self._lease
        if lease is None:
            raise OwnershipLost(f"{self._owner} holds no lease on {self._stream!r}", where=self._stream)
        await asyncio.to_thread(self._store.check_lease, lease)

    async def release(self, *, hand_over: bool = False) -> None:
        """Stop the keeper and give the lease up; with ``hand_over``, to the worker that asked for
        it (released for anyone if that request is gone)."""
        lease = self.forget()
        if lease is None:
            return
        if hand_over and await asyncio.to_thread(self._store.hand_over, lease, self._ttl) is not None:
            return
        await asyncio.to_thread(self._store.release_lease, lease)

    def forget(self) -> Lease | None:
        """Stop the keeper and drop the lease without releasing it (it expires); returns it."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None and keeper is not asyncio.current_task():
            keeper.cancel()
        lease, self._lease = self._lease, None
        return lease

    async def _renew(self, lease: Lease) -> None:
        started = time.monotonic()
        renewed = await asyncio.to_thread(self._store.renew_lease, lease, self._ttl)
        if lease is self._lease:
            self._lease, self._renewed = renewed, started

    async def _take(self, deadline: float | None, patient: Callable[[], bool] | None) -> Lease:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + HANDOVER_WAIT_SECONDS
        if deadline is not None:
            give_up = min(give_up, deadline)
        asked_give_up: float | None = None
        try:
            while True:
                # Stamped per attempt: after a long wait on a dead holder, the lease taken lives from
                # the attempt that took it, not from the start of the wait.
                attempt = time.monotonic()
                result = await asyncio.to_thread(
                    self._store.try_acquire_lease, self._stream, self._owner, self._ttl, started=self._started
                )
                if isinstance(result, Lease):
                    self._renewed = attempt
                    return result
                now = loop.time()
                if asked_give_up is None:
                    # As long as the lease seen first can last (a dead holder renews it no more), and
                    # one poll more to see it free; a live holder that keeps renewing it and never
                    # answers is not waited for longer.
                    longest = max(self._ttl, result.seconds_left) + 2 * LEASE_POLL_SECONDS
                    asked_give_up = max(give_up, now + longest)
                waits = result.handover_requested and patient is not None and patient()
                ends = asked_give_up if waits else give_up
                if not (result.handover_requested or now + result.seconds_left <= ends) or now >= ends:
                    raise OwnershipLost(result.describe(), where=self._stream)
                self.waiting = result.describe()
                await asyncio.sleep(min(LEASE_POLL_SECONDS, max(0.0, ends - now)))
        finally:
            self.waiting = None

    async def _keep(self) -> None:
        """Renew every third of the lease while it is held; hand over when a newer worker asks.

        A renewal refused ends the keeper after ``on_lost()``; a store that cannot be reached is
        retried (fencing covers a lease that expires meanwhile).
        """
        renew_every = self._ttl / 3
        poll = min(LEASE_POLL_SECONDS, renew_every)
        while self._lease is not None:
            await asyncio.sleep(poll)
            lease = self._lease
            if lease is None:
                return
            try:
                requester = await asyncio.to_thread(self._store.handover_requested, lease)
                if requester is not None:
                    await self._on_handover(lease, requester)
                    return
                if time.monotonic() - self._renewed >= renew_every and lease is self._lease:
                    await self._renew(lease)
            except OwnershipLost as exc:
                logger.warning("stream %s: %s", self._stream, exc)
                self._on_lost()
                return
            except FaucetError as exc:
                logger.warning("stream %s: the lease could not be renewed, retrying: %s", self._stream, exc)
