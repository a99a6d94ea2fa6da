"""Named fault points: one line each where a crash matters, a no-op unless a fault worker armed one.

``fault_point(Point.AFTER_SINK_COMMIT)`` marks a place in the commit order (the continuous runner's
epoch, the PostgreSQL COPY of the fault worker's sinks). Nothing happens there unless this process
was started with the environment variable :data:`FAULT_POINT_ENV` holding a JSON arming, read once at
import::

    {"point": "after_sink_commit", "hit": 2, "action": "kill", "delay": 0.0, "report": "/tmp/x"}

The ``hit``-th time the named point is reached (1 = the first), the report file (if any) gets one
JSON line naming the point, the hit and the action, written and fsynced first, so the controller
knows the fault really happened there; then the action runs:

``kill``       SIGKILL this process at once: a crash at exactly this point.
``term``       SIGTERM this process: the fault worker's handler asks for a clean stop, which the worker
               carries out at its next await (the epoch in hand finishes or aborts, sessions close,
               the lease is given up).
``stop``       SIGSTOP this process (a zombie): it resumes where it stopped when the controller sends
               SIGCONT, possibly long after its lease expired.
``kill_soon``  SIGKILL this process from a timer thread ``delay`` seconds later, so the kill lands
               while whatever follows the point is in flight (an acknowledgement request, a close).
``fail``       raise :class:`InjectedFailure` at the point: the code around it turns it into the
               failure a destination would give there (the fault worker's sink: a refused commit).

Off, the cost is one global lookup and a comparison per call; an armed process pays a lock only at
the armed point. Only the standard library is imported.
"""

import json
import os
import signal
import threading
from dataclasses import asdict, dataclass
from enum import StrEnum

FAULT_POINT_ENV = "FAUCET_FAULT_POINT"


class Point(StrEnum):
    """The named places a fault can be injected at."""

    BEFORE_SINK_COMMIT = "before_sink_commit"
    """Continuous: the epoch is sealed, ``commit_epoch`` not called yet."""
    AFTER_SINK_COMMIT = "after_sink_commit"
    """Continuous: ``commit_epoch`` returned, the certificate is not persisted yet."""
    AFTER_CERTIFICATE = "after_certificate"
    """Continuous: the certificate is persisted, ``acknowledge`` not called yet."""
    DURING_ACK = "during_ack"
    """Continuous: the source checked the authority, its provider acknowledgement follows."""
    DURING_COPY = "during_copy"
    """PostgreSQL sinks: a COPY is open and its first chunk was sent."""
    AFTER_COPY = "after_copy"
    """PostgreSQL sinks: a COPY finished, its transaction is not committed."""
    AFTER_APPLY = "after_apply"
    """Streaming sinks: ``apply`` returned (NATS: publishes sent, acknowledgements outstanding)."""
    DURING_SINK_COMMIT = "during_sink_commit"
    """Streaming sinks: ``commit_epoch`` was called, nothing of it sent yet (a ``fail`` here is a
    refused commit, while the next epoch is read ahead)."""
    DURING_SINK_CLOSE = "during_sink_close"
    """Sinks: the close started and waits on the destination."""
    AFTER_PAGE = "after_page"
    """Bounded: a page was committed at the sink, the bookmark is not persisted yet."""
    AFTER_BOOKMARK = "after_bookmark"
    """Bounded: the bookmark and commit token of the finished sync are persisted."""


class Action(StrEnum):
    """What an armed point does when it is hit (see the module docstring)."""

    KILL = "kill"
    TERM = "term"
    STOP = "stop"
    KILL_SOON = "kill_soon"
    FAIL = "fail"


class InjectedFailure(Exception):
    """Raised by a point armed with ``fail``; the caller turns it into the failure it stands for."""


@dataclass(frozen=True)
class Arming:
    """One armed point: fire ``action`` on the ``hit``-th time ``point`` is reached."""

    point: Point
    hit: int = 1
    action: Action = Action.KILL
    delay: float = 0.0
    report: str | None = None

    def __post_init__(self) -> None:
        if self.hit < 1 or self.delay < 0:
            raise ValueError(f"a fault arming needs hit >= 1 and delay >= 0, got {self}")

    def to_env(self) -> str:
        """The value of :data:`FAULT_POINT_ENV` that arms this point in a child process."""
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> "Arming":
        raw = json.loads(text)
        return cls(
            point=Point(raw["point"]),
            hit=int(raw.get("hit", 1)),
            action=Action(raw.get("action", Action.KILL)),
            delay=float(raw.get("delay", 0.0)),
            report=raw.get("report"),
        )


def _armed_from_environment() -> Arming | None:
    text = os.environ.get(FAULT_POINT_ENV)
    return Arming.from_env(text) if text else None


_armed: Arming | None = _armed_from_environment()
_hits = 0
_lock = threading.Lock()


def fault_point(point: Point) -> None:
    """Mark ``point``; when this process armed it, fire on its ``hit``-th visit (see module doc)."""
    armed = _armed
    if armed is None or point is not armed.point:
        return
    global _hits
    with _lock:
        _hits += 1
        if _hits != armed.hit:
            return
    _fire(armed)


def _fire(armed: Arming) -> None:
    if armed.report is not None:
        with open(armed.report, "a", encoding="utf-8") as report:
            report.write(json.dumps({"point": armed.point.value, "hit": armed.hit, "action": armed.action}))
            report.write("\n")
            report.flush()
            os.fsync(report.fileno())
    pid = os.getpid()
    if armed.action is Action.KILL:
        os.kill(pid, signal.SIGKILL)
    elif armed.action is Action.TERM:
        os.kill(pid, signal.SIGTERM)
    elif armed.action is Action.STOP:
        os.kill(pid, signal.SIGSTOP)
    elif armed.action is Action.FAIL:
        raise InjectedFailure(f"injected at {armed.point.value} (hit {armed.hit})")
    else:
        timer = threading.Timer(armed.delay, os.kill, (pid, signal.SIGKILL))
        timer.daemon = True
        timer.start()


__all__ = ["FAULT_POINT_ENV", "Action", "Arming", "InjectedFailure", "Point", "fault_point"]
