"""What the controller tells a fault worker, and what the worker answers: plain JSON both ways.

A :class:`WorkerSpec` travels to ``python -m faucet_dagster.testing.faults.worker`` on stdin; the
worker writes one JSON object per line on stdout (:class:`Event`) and ends with one of the exit
codes below. Only the standard library is imported, so the controller and the worker agree on the
format without either importing the other's machinery.
"""

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

EXIT_DONE = 0
"""The worker reached its targets (continuous), finished the sync (bounded), or stopped cleanly."""
EXIT_HALTED = 3
"""A FaucetError halted the stream; the last ``error`` event names its kind."""
EXIT_DEADLINE = 4
"""The deadline passed before the targets were reached."""


@dataclass(frozen=True)
class Endpoint:
    """A connector by its registered name, with its config as plain data."""

    connector: str
    config: dict[str, Any]


@dataclass(frozen=True)
class Target:
    """A position the certified coverage must reach in one domain (``resource``/``partition``)."""

    resource: str
    partition: str
    position: int


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process: which pipeline it runs and when it stops.

    ``mode`` continuous runs :class:`~faucet_dagster.runner.continuous.StreamRunner` epochs (the
    runner the sensor uses) until the certified positions reach every target; bounded runs
    :func:`~faucet_dagster.runner.bounded.run_bounded_sync` once, from the bookmark and commit token in
    ``bookmark_file`` (the stand-in for Dagster's run storage), and writes the new ones there.
    ``policy`` is the continuous stream's write policy (a ``WritePolicy`` value: ``apply_changes``
    for a change source); a bounded sync takes the sink's own.

    Retryable failures (``FaucetError.retryable``; ``OwnershipLost`` while ``retry_ownership``: a
    live lease of another worker, or its own expired one) are retried every ``retry_pause`` seconds,
    as sensor ticks would; anything else halts (:data:`EXIT_HALTED`). ``stop_after_epochs`` asks for
    a clean stop ``stop_delay`` seconds after that many certified epochs (so the next epoch's read is
    cancelled part-way). SIGTERM asks for the same clean stop at once.
    """

    mode: Literal["continuous", "bounded"]
    stream: str
    worker_id: str
    source: Endpoint
    sink: Endpoint
    resources: tuple[str, ...] = ()
    policy: str = "append"
    state_url: str = ""
    epoch_records: int = 500
    epoch_idle: float = 0.3
    epoch_age: float = 5.0
    batch_rows: int = 500
    lease_seconds: float = 2.0
    targets: tuple[Target, ...] = ()
    stop_after_epochs: int | None = None
    stop_delay: float = 0.05
    retry_ownership: bool = True
    retry_pause: float = 0.2
    deadline_seconds: float = 60.0
    bookmark_file: str = ""
    batch_size: int = 500
    pipelined: bool = True
    """Continuous: epochs pipelined as under a sensor (``run_epochs``: the next read while the last
    commits); False runs one epoch at a time (``run_epoch``), for cases whose premise is an order of
    events across epochs."""
    groups: int = 0
    """Continuous: 0 runs the stream as one runner; above 0, as one member of a stream divided into
    that many partition groups (:class:`~faucet_dagster.runner.members.MemberWorker`), until a clean
    stop or the deadline (targets are not checked: the controller decides when all is certified)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        raw = json.loads(text)
        raw["source"] = Endpoint(**raw["source"])
        raw["sink"] = Endpoint(**raw["sink"])
        raw["resources"] = tuple(raw.get("resources", ()))
        raw["targets"] = tuple(Target(**item) for item in raw.get("targets", ()))
        return cls(**raw)


EventName = Literal[
    "started", "certified", "page", "synced", "retry", "error", "stopping", "stopped", "done", "deadline"
]


@dataclass(frozen=True)
class Event:
    """One line a worker wrote: ``started`` (its pid), ``certified`` (sequence, rows, fencing token),
    ``page`` (a bounded page committed), ``synced`` (the bounded bookmark persisted), ``retry`` and
    ``error`` (kind, type, message), ``stopping``/``stopped`` (a clean stop), ``done``, ``deadline``."""

    event: EventName
    data: dict[str, Any] = field(default_factory=dict)

    def to_line(self) -> str:
        return json.dumps({"event": self.event, **self.data}, default=str)

    @classmethod
    def from_line(cls, line: str) -> "Event":
        raw = json.loads(line)
        name = raw.pop("event")
        return cls(name, raw)


__all__ = [
    "EXIT_DEADLINE",
    "EXIT_DONE",
    "EXIT_HALTED",
    "Endpoint",
    "Event",
    "EventName",
    "Target",
    "WorkerSpec",
]
