"""The worker runs of a stream with ``workers: N``, as Dagster records them: slots, liveness, failures.

A stream on workers keeps ``N`` worker slots (``0 .. N-1``, run tag :data:`SLOT_TAG`); the sensor
requests a run for a slot without one. :func:`census` reads, without changing anything, what each
slot has (:class:`Slot`): a run whose member lease is live, a run still starting, a run whose lease
lapsed (its process died), or no run, with the slot's streak of consecutive failed runs and the last
one's error. The sensor acts on it (marks dead runs failed, requests runs, backs off) and the
``faucet_stream_health`` check reports it (:func:`workers_stall`).

A slot whose last :data:`MAX_FAILURES` runs failed in a row is not requested again until
:func:`backoff_seconds` passed since the last one ended (doubling with each further failure, at most
:data:`MAX_BACKOFF_SECONDS`): a worker that fails at once (a bad configuration, a destination that
refuses) is not relaunched on every tick. The run after the backoff is a probe: if it fails too the
wait doubles; a run that succeeded, or ran :data:`STEADY_SECONDS` before it failed, ends the streak.

:class:`SensorWatch` is what a worker run asks to learn whether the sensor that launched it still
runs: Dagster's own state of that sensor (its ``InstigatorState`` in the instance's schedule storage,
one indexed read), so stopping the sensor in the UI or with ``dagster sensor stop`` stops its workers.
"""

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum

import dagster as dg

# The sensor's identity in Dagster's schedule storage; dagster 1.13 exports neither type publicly.
from dagster._core.definitions.selector import InstigatorSelector
from dagster._core.remote_origin import RemoteInstigatorOrigin
from dagster._core.scheduler.instigation import InstigatorStatus

from faucet_dagster.state.members import LiveMember
from faucet_dagster.streams.health import Stall

STREAM_TAG = "faucet/stream"
SLOT_TAG = "faucet/worker"
"""The run tag holding a worker run's slot (``0 .. workers-1``)."""
RETIRE_TAG = "faucet/retired"
"""The run tag the sensor adds to a worker run whose slot no longer exists (``<time> <reason>``)."""
SENSOR_NAME_TAG = "dagster/sensor_name"
"""Dagster's tag naming the sensor that requested a run."""

START_GRACE_SECONDS = 120.0
"""How long a started worker run may take to join the membership before it is counted as dead."""
DEAD_AFTER_SECONDS = 20.0
"""How long (at least three leases) a worker run's member lease must have lapsed before the run is
counted as dead: a loaded worker that renews late, then joins again, is not replaced."""
MAX_FAILURES = 3
"""Consecutive failed runs of a slot after which the sensor backs off."""
BASE_BACKOFF_SECONDS = 300.0
MAX_BACKOFF_SECONDS = 3600.0
STEADY_SECONDS = 600.0
"""A failed run that ran this long first ends its slot's failure streak: it worked, then died."""
HISTORY = 10
"""How many recent runs of a slot are read to count its failures."""
IN_PROGRESS = (
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
)


def backoff_seconds(failures: int) -> float:
    """How long a slot waits after its last failed run: 0 below :data:`MAX_FAILURES` failures in a
    row, then :data:`BASE_BACKOFF_SECONDS` doubling per further failure, at most the maximum."""
    if failures < MAX_FAILURES:
        return 0.0
    return float(min(MAX_BACKOFF_SECONDS, BASE_BACKOFF_SECONDS * 2.0 ** (failures - MAX_FAILURES)))


class SlotState(Enum):
    LIVE = "live"
    """A run whose member lease is live."""
    STARTING = "starting"
    """A run queued or started that has not joined yet, within :data:`START_GRACE_SECONDS`."""
    LAPSED = "lapsed"
    """A started run whose member lease lapsed (or that never joined in time): its process is gone."""
    EMPTY = "empty"
    """No run in progress."""


@dataclass(frozen=True)
class Failures:
    """A slot's consecutive failed runs, newest first: how many, the last one and its error."""

    count: int
    last_run: str
    last_error: str
    last_ended: float

    @property
    def retry_at(self) -> float:
        """When the sensor may request the slot again (seconds since 1970)."""
        return self.last_ended + backoff_seconds(self.count)


@dataclass(frozen=True)
class Slot:
    """What one worker slot has: its run in progress (if any), in what state, and its failure streak.

    ``lapsed_for`` is the seconds since a :attr:`SlotState.LAPSED` run's member lease lapsed (None: it
    never joined); ``dead``: a lapsed run the sensor marks failed and replaces (lapsed long enough,
    or never joined)."""

    slot: int
    state: SlotState
    run: dg.DagsterRun | None = None
    lapsed_for: float | None = None
    failures: Failures | None = None
    dead: bool = False

    def backing_off(self, now: float) -> bool:
        """True while the slot is not requested: its failure streak's backoff has not passed."""
        return self.failures is not None and now < self.failures.retry_at

    def describe(self, stream: str) -> str:
        who = f"worker {self.slot} of {stream}"
        if self.state is SlotState.LAPSED:
            run = self.run.run_id if self.run else "?"
            since = "never joined" if self.lapsed_for is None else f"lapsed {self.lapsed_for:.0f}s ago"
            return f"{who} (run {run}) has no live member lease: it {since}"
        if self.failures is not None and self.failures.count >= MAX_FAILURES:
            failures = self.failures
            return (
                f"{who} failed {failures.count} runs in a row (last: run {failures.last_run}: "
                f"{failures.last_error})"
            )
        return f"{who} has no live run ({self.state.value})"


def census(
    instance: dg.DagsterInstance,
    stream: str,
    job_name: str,
    workers: int,
    live: Sequence[LiveMember],
    lapsed: Mapping[str, float | None],
    *,
    lease_seconds: float,
    now: float | None = None,
) -> tuple[tuple[Slot, ...], tuple[dg.DagsterRun, ...]]:
    """Every slot of ``stream``'s worker runs, read from ``instance`` and the member leases (``live``,
    ``lapsed`` from :class:`~faucet_dagster.state.members.MemberRegistry`), and the runs in progress
    whose slot no longer exists (``workers`` was lowered: to retire). Changes nothing.

    A lapsed run is dead once its lease lapsed :data:`DEAD_AFTER_SECONDS` ago, and at least three
    leases (``lease_seconds``). A run in progress without a slot tag (launched by hand) fills the
    lowest free slot."""
    now = time.time() if now is None else now
    members = {member.member for member in live}
    running = instance.get_runs(
        filters=dg.RunsFilter(job_name=job_name, statuses=list(IN_PROGRESS), tags={STREAM_TAG: stream})
    )
    by_slot: dict[int, Slot] = {}
    untagged: list[Slot] = []
    extra: list[dg.DagsterRun] = []
    for run in running:
        if _beyond(run, workers):
            extra.append(run)
            continue
        slot = _slot_of(run, workers)
        state, since = _run_state(instance, run, members, lapsed, now)
        dead = state is SlotState.LAPSED and (
            since is None or since > max(DEAD_AFTER_SECONDS, 3 * lease_seconds)
        )
        found = Slot(-1 if slot is None else slot, state, run, since, dead=dead)
        if slot is None or slot in by_slot:
            untagged.append(found)
        else:
            by_slot[slot] = found
    free = [slot for slot in range(workers) if slot not in by_slot]
    for slot, found in zip(free, untagged, strict=False):
        by_slot[slot] = replace(found, slot=slot)
    slots = []
    for slot in range(workers):
        found = by_slot.get(slot, Slot(slot, SlotState.EMPTY))
        slots.append(replace(found, failures=_failures(instance, stream, job_name, slot)))
    return tuple(slots), tuple(extra)


def _beyond(run: dg.DagsterRun, workers: int) -> bool:
    """Whether ``run`` holds a slot the stream no longer has (its ``workers`` lowered)."""
    raw = run.tags.get(SLOT_TAG)
    return raw is not None and raw.isdigit() and int(raw) >= workers


def _slot_of(run: dg.DagsterRun, workers: int) -> int | None:
    raw = run.tags.get(SLOT_TAG)
    if raw is None or not raw.isdigit() or int(raw) >= workers:
        return None
    return int(raw)


def _run_state(
    instance: dg.DagsterInstance,
    run: dg.DagsterRun,
    members: set[str],
    lapsed: Mapping[str, float | None],
    now: float,
) -> tuple[SlotState, float | None]:
    if run.run_id in members:
        return SlotState.LIVE, None
    if run.status is not dg.DagsterRunStatus.STARTED:
        return SlotState.STARTING, None
    if run.run_id in lapsed:
        return SlotState.LAPSED, lapsed[run.run_id]
    record = instance.get_run_record_by_id(run.run_id)
    started = None if record is None else record.start_time or record.create_timestamp.timestamp()
    if started is not None and now - started > START_GRACE_SECONDS:
        return SlotState.LAPSED, None
    return SlotState.STARTING, None


def _failures(instance: dg.DagsterInstance, stream: str, job_name: str, slot: int) -> Failures | None:
    """The slot's consecutive failed runs ending with its newest finished run (None: it did not fail)."""
    records = instance.get_run_records(
        filters=dg.RunsFilter(job_name=job_name, tags={STREAM_TAG: stream, SLOT_TAG: str(slot)}),
        limit=HISTORY,
    )
    streak = []
    for record in records:  # newest first
        status = record.dagster_run.status
        if status in IN_PROGRESS:
            continue  # the slot's current run: the streak is that of the runs before it
        started, ended = record.start_time, record.end_time
        ran = started is not None and ended is not None and ended - started > STEADY_SECONDS
        if status is not dg.DagsterRunStatus.FAILURE or ran:
            break
        streak.append(record)
    if not streak:
        return None
    last = streak[0]
    ended = last.end_time or last.update_timestamp.timestamp()
    return Failures(len(streak), last.dagster_run.run_id, run_error(instance, last.dagster_run.run_id), ended)


def run_error(instance: dg.DagsterInstance, run_id: str, limit: int = 400) -> str:
    """The error a failed run ended with, for people: its step's error, else the run failure's message."""
    entries = instance.all_logs(
        run_id, of_type={dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.RUN_FAILURE}
    )
    message = ""
    for entry in entries:
        event = entry.dagster_event
        if event is None:
            continue
        error = getattr(event.event_specific_data, "error", None)
        while getattr(error, "cause", None) is not None:  # Dagster wraps the op's error: say the op's
            error = error.cause  # type: ignore[union-attr]
        text = (getattr(error, "message", None) or event.message or "").strip()
        if text and (not message or event.event_type is dg.DagsterEventType.STEP_FAILURE):
            message = text
    if not message:
        return "no error recorded"
    line = " ".join(message.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def describe_stalls(
    stream: str, slots: Sequence[Slot], now: float, requested: Collection[int] = ()
) -> list[str]:
    """What keeps slots from a live worker, one line per slot (empty: every slot is live or starting,
    or in ``requested``, the slots a run is requested for now)."""
    lines = []
    for slot in slots:
        if slot.state in (SlotState.LIVE, SlotState.STARTING) or slot.slot in requested:
            continue
        line = slot.describe(stream)
        if slot.backing_off(now) and slot.failures is not None:
            line += f"; not requested again for {slot.failures.retry_at - now:.0f}s"
        lines.append(line)
    return lines


class SensorWatch:
    """Whether the sensor that requested a worker run still runs, from Dagster's state of it.

    Only a run the sensor requested (tag ``dagster/sensor_name``, and a code location origin, as every
    run launched through a daemon or the UI has) is watched; another run (``execute_in_process``, a
    run launched by hand) runs until it is terminated. The sensor's effective status is Dagster's: a
    stored state of ``RUNNING`` (or declared in code, when the default is running), else the
    definition's ``default_status``.
    """

    def __init__(
        self, instance: dg.DagsterInstance, run: dg.DagsterRun, default_status: dg.DefaultSensorStatus
    ) -> None:
        self._instance = instance
        self._default_running = default_status is dg.DefaultSensorStatus.RUNNING
        self.sensor = run.tags.get(SENSOR_NAME_TAG)
        self._run_id = run.run_id
        origin = run.remote_job_origin
        self._ids: tuple[str, str] | None = None
        if self.sensor is not None and origin is not None:
            repository = origin.repository_origin
            self._ids = (
                RemoteInstigatorOrigin(repository, self.sensor).get_id(),
                InstigatorSelector(
                    location_name=origin.location_name,
                    repository_name=repository.repository_name,
                    name=self.sensor,
                ).get_id(),
            )

    @property
    def watching(self) -> bool:
        return self._ids is not None

    def retired(self) -> str | None:
        """Why the sensor retired this run (its slot no longer exists), or None (one read of the run)."""
        run = self._instance.get_run_by_id(self._run_id)
        raw = None if run is None else run.tags.get(RETIRE_TAG)
        return None if raw is None else raw.split(" ", 1)[-1]

    def cursor(self) -> str | None:
        """The sensor's cursor as Dagster stored it at its last tick (None without one)."""
        if self._ids is None:
            return None
        state = self._instance.get_instigator_state(*self._ids)
        data = None if state is None else state.instigator_data
        return getattr(data, "cursor", None)

    def stopped(self) -> bool:
        """True when the sensor is stopped (one read of the schedule storage; blocks for it)."""
        if self._ids is None:
            return False
        state = self._instance.get_instigator_state(*self._ids)
        if state is None:
            return not self._default_running
        if state.status is InstigatorStatus.DECLARED_IN_CODE:
            return not self._default_running
        return state.status is InstigatorStatus.STOPPED


def workers_stall(
    stream: str, slots: Sequence[Slot], now: float | None = None, requested: Collection[int] = ()
) -> Stall | None:
    """The health stall of a stream on workers whose slots lack a live worker (None: every slot has
    a live or starting run, or is in ``requested``): the reason names each such slot."""
    now = time.time() if now is None else now
    lines = describe_stalls(stream, slots, now, requested)
    if not lines:
        return None
    remedies = []
    if any(slot.backing_off(now) for slot in slots):
        remedies.append(
            "fix what the last error names (the failed run's logs show it), then reload the code location; "
            "the sensor requests the worker again when its backoff passed"
        )
    if any(slot.state is SlotState.LAPSED for slot in slots):
        remedies.append(
            f"none for a lapsed lease: the sensor marks that run failed once its lease lapsed "
            f"{DEAD_AFTER_SECONDS:.0f}s ago and requests a replacement; if it recurs, read that run's logs "
            "and its host's"
        )
    if any(
        slot.state is SlotState.EMPTY and not slot.backing_off(now)
        for slot in slots
        if slot.slot not in requested
    ):
        remedies.append("start the stream's sensor: it requests a run for every worker without one")
    severe = any(
        slot.backing_off(now) or slot.dead or slot.state is SlotState.EMPTY
        for slot in slots
        if slot.slot not in requested
    )
    stalled = [slot for slot in slots if slot.state not in (SlotState.LIVE, SlotState.STARTING)]
    return Stall(
        "; ".join(lines),
        "; ".join(remedies) or "none: the sensor requests the missing worker",
        dg.AssetCheckSeverity.ERROR if severe else dg.AssetCheckSeverity.WARN,
        "workers:" + ",".join(f"{slot.slot}={slot.state.value}" for slot in stalled),
    )
