"""A stream divided among several workers: fixed partition groups, leased one by one.

A stream run by several workers (``workers: N``) is split into ``groups`` partition groups, fixed for
the life of its certificates. Group ``g`` is the protocol's ``Membership(g, groups)``: the source
reads the partitions (ordering domains) with ``crc32(resource/partition) % groups == g``. Each group
is run by an ordinary :class:`~faucet_dagster.runner.continuous.StreamRunner` under the stream name
``"<stream>[g/groups]"`` (:func:`group_stream`), so each group has, unchanged from a single-owner
stream:

* its own lease with its own monotonic fencing token: a group is read by one fenced owner at a time;
  a new owner resumes at the group's certified positions; a zombie's certificate and acknowledgement
  are refused by the store, and its commit by a destination with owner fencing (the destination's
  fence is claimed per group stream name);
* its own certificate chain, so the certificates of an ordering domain chain across owners (a domain
  never changes group, so its chain is the group's).

Who runs which group: every worker holds a member lease (:mod:`faucet_dagster.state.members`); the
live members sorted by when they joined are ``m_0 .. m_{n-1}``, and group ``g`` belongs to
``m_{g mod n}`` (:func:`assign`). Every worker computes the same answer from the store; while two of
them briefly disagree (one has not seen a member join or lapse yet), the group lease decides: the
worker that does not get it retries on its next round. A worker whose assignment no longer includes a
group it runs closes that group's runner at a certified position and releases the group lease.

Why ``g mod n`` over sorted members and not rendezvous hashing of groups: with as many groups as
workers (the default), ``g mod n`` gives every worker exactly one group, while hashing leaves some
idle and others with two; the price is that a change of ``n`` moves more groups, which costs each
moved group one close and one open, never correctness. The partitions' split into groups is the
protocol's hashing (:class:`~faucet_dagster.protocol.Membership`), which a source applies itself.

The number of groups cannot change under existing certificates (the partitions would move between
certificate chains): :func:`check_groups` refuses it, as it refuses groups for a stream certified by a
single owner.
"""

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from faucet_dagster.pipeline import DeadLetterRoute
from faucet_dagster.protocol import (
    ConfigError,
    EpochCertificate,
    FaucetError,
    Membership,
    OwnershipLost,
    ReadLimits,
)
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec, default_worker_id
from faucet_dagster.state import StateStore
from faucet_dagster.state.members import MemberLease, MemberRegistry, group_stream, parse_group_stream

logger = logging.getLogger(__name__)

IDLE_ROUND_SECONDS = 0.5
"""How long a worker that runs no group waits before it looks at the membership again."""
ROUND_SECONDS = 5.0
"""How long a round runs each group's epochs (pipelined: the next read while the last commits) before
the worker looks at the membership again."""


def assign(members: Sequence[str], groups: int, member: str) -> tuple[int, ...]:
    """The groups ``member`` runs: ``g`` with ``members[g % len(members)] == member`` (``members`` in
    the order they joined). Empty when ``member`` is not among them."""
    if member not in members:
        return ()
    index, count = members.index(member), len(members)
    return tuple(group for group in range(groups) if group % count == index)


def check_groups(store: StateStore, stream: str, groups: int) -> None:
    """Refuse (:class:`ConfigError`) ``groups`` partition groups for ``stream`` when its certificates
    were made under another division (another number of groups, or a single owner)."""
    if groups < 1:
        raise ConfigError(f"a stream needs at least one partition group, not {groups}", where=stream)
    for status in store.status():
        if status.last_sequence == 0:
            continue
        found = parse_group_stream(status.stream)
        if status.stream == stream or (found is not None and found[0] == stream and found[2] != groups):
            other = "a single owner" if found is None else f"{found[2]} partition groups"
            raise ConfigError(
                f"stream {stream!r} was certified by {other}; it cannot run as {groups} partition groups "
                "(its partitions would move between certificate chains). Keep the earlier number, or "
                "start the stream under a new name",
                where=stream,
            )


class MemberWorker:
    """One worker of a stream divided into ``groups`` partition groups (see the module docstring).

    Each :meth:`run_round` renews the member lease, reads the live members, closes the groups no
    longer assigned to this worker, and runs the epochs of every group assigned to it for about
    ``ROUND_SECONDS``, concurrently, each group's pipelined (``StreamRunner.run_epochs``: an epoch is
    read while the one before it commits). Used from one event loop.
    """

    def __init__(
        self,
        spec: StreamSpec,
        store: StateStore,
        *,
        groups: int,
        worker_id: str | None = None,
        dead_letters: DeadLetterRoute | None = None,
    ) -> None:
        if groups < 1:
            raise ConfigError(f"a stream needs at least one partition group, not {groups}", where=spec.name)
        self.spec = spec
        self.store = store
        self.groups = groups
        self.worker_id = worker_id or default_worker_id()
        self.started = time.time()
        self._registry = MemberRegistry(store)
        self._dead_letters = dead_letters
        self._member: MemberLease | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._runners: dict[int, StreamRunner] = {}
        self._checked = False

    @property
    def running(self) -> tuple[int, ...]:
        """The groups this worker has a runner for (it may still be waiting for a group's lease)."""
        return tuple(sorted(self._runners))

    async def run_round(self, limits: ReadLimits | None = None) -> list[EpochCertificate]:
        """Follow the membership, then run the epochs of each group assigned here for about
        ``ROUND_SECONDS`` (a group whose source has nothing new ends its part of the round early); the
        certificates.

        A group whose lease another worker still holds (it is handing it over, or its lease has not
        lapsed yet) is skipped for this round. A failure of one group that is retryable is logged and
        that group tried again next round; any other failure is raised after the others finished.
        """
        if not self._checked:
            await asyncio.to_thread(check_groups, self.store, self.spec.name, self.groups)
            self._checked = True
        await self._hold_membership()
        live = await asyncio.to_thread(self._registry.live, self.spec.name)
        mine = assign([member.member for member in live], self.groups, self.worker_id)
        for group in [group for group in self._runners if group not in mine]:
            logger.info("stream %s: group %s moves to another member", self.spec.name, group)
            await self._runners.pop(group).close()
        for group in mine:
            if group not in self._runners:
                self._runners[group] = StreamRunner(
                    replace(
                        self.spec,
                        name=group_stream(self.spec.name, group, self.groups),
                        membership=Membership(group, self.groups),
                    ),
                    self.store,
                    worker_id=self.worker_id,
                    dead_letters=self._dead_letters,
                    started=self.started,
                )
        if not self._runners:
            await asyncio.sleep(IDLE_ROUND_SECONDS)
            return []
        outcomes = await asyncio.gather(
            *(self._epochs(runner, limits) for runner in self._runners.values()), return_exceptions=True
        )
        certificates: list[EpochCertificate] = []
        failure: BaseException | None = None
        for outcome in outcomes:
            if isinstance(outcome, list):
                certificates.extend(outcome)
            elif isinstance(outcome, BaseException) and failure is None:
                failure = outcome
        if failure is not None:
            raise failure
        return certificates

    async def run(self, stop: asyncio.Event, limits: ReadLimits | None = None) -> None:
        """Run rounds until ``stop`` is set, then :meth:`close`."""
        try:
            while not stop.is_set():
                await self.run_round(limits)
        finally:
            await self.close()

    def cancel(self) -> None:
        """Interrupt the reads in progress (see :meth:`StreamRunner.cancel`: their epochs are aborted,
        except for a sink whose writes cannot be taken back, where each ends at its next boundary)."""
        for runner in self._runners.values():
            runner.cancel()

    async def close(self, *, release: bool = True) -> None:
        """Close every group's runner (at certified positions) and leave the membership. Without
        ``release`` the leases are kept to lapse, as a worker that died would leave them."""
        runners, self._runners = list(self._runners.values()), {}
        failures = await asyncio.gather(
            *(runner.close(release=release) for runner in runners), return_exceptions=True
        )
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.cancel()
        member, self._member = self._member, None
        if member is not None and release:
            await asyncio.to_thread(self._registry.leave, member)
        for failure in failures:
            if isinstance(failure, BaseException):
                raise failure

    async def _epochs(self, runner: StreamRunner, limits: ReadLimits | None) -> list[EpochCertificate]:
        try:
            return await runner.run_epochs(ROUND_SECONDS, limits)
        except OwnershipLost as exc:
            logger.info("stream %s: %s; trying again next round", runner.spec.name, exc)
            return []
        except FaucetError as exc:
            if not exc.retryable:
                raise
            logger.warning("stream %s: %s; trying again next round", runner.spec.name, exc)
            return []

    async def _hold_membership(self) -> None:
        """Join, or renew, the member lease; start its keeper. A lease that lapsed is joined again
        (a new incarnation, last in the order)."""
        ttl = self.spec.lease_seconds
        member = self._member
        if member is not None:
            try:
                self._member = await asyncio.to_thread(self._registry.renew, member, ttl)
            except OwnershipLost as exc:
                logger.warning("stream %s: %s; joining again", self.spec.name, exc)
                member = None
        if member is None:
            self._member = await asyncio.to_thread(self._registry.join, self.spec.name, self.worker_id, ttl)
        loop = asyncio.get_running_loop()
        if self._keeper is None or self._keeper.done() or self._keeper.get_loop() is not loop:
            self._keeper = loop.create_task(self._keep(), name=f"faucet-member-{self.spec.name}")

    async def _keep(self) -> None:
        """Renew the member lease every third of its life between rounds; a lapsed one is joined again
        by the next round."""
        ttl = self.spec.lease_seconds
        while True:
            await asyncio.sleep(ttl / 3)
            member = self._member
            if member is None:
                return
            try:
                self._member = await asyncio.to_thread(self._registry.renew, member, ttl)
            except OwnershipLost as exc:
                logger.warning("stream %s: %s", self.spec.name, exc)
                self._member = None
                return
            except FaucetError as exc:
                logger.warning("stream %s: the member lease could not be renewed: %s", self.spec.name, exc)


__all__ = ["MemberWorker", "assign", "check_groups", "group_stream"]
