"""A stream sensor's cursor: what Dagster received, the health it last reported, and a halt in progress.

Dagster stores a tick's cursor together with its events, so the cursor says exactly what Dagster has:

* ``reported_through``: per stream name (the stream's own, or each partition group's), the sequence
  of the last certificate Dagster received a report of. The state store keeps the same mark
  (:meth:`~faucet_dagster.state.StateStore.mark_reported`, which never goes back); a tick reports
  from the higher of the two, so a fresh cursor, an older one, or certificates a worker run reported
  itself (its sensor stopped) are never reported twice;
* ``health``: the key of the last ``faucet_stream_health`` evaluation reported (``passing``, or a
  stall's :attr:`~faucet_dagster.streams.health.Stall.key`): a tick reports the check again only when
  it changes;
* ``halt``: the error a stream is halted on, since when, for how many ticks, and when the process log
  last said so: a halted stream says it is halted on every tick until it makes progress again, and
  logs it once when it begins and then at most every :data:`HALT_LOG_SECONDS`.

Version 1 cursors (``{"version": 1, "reported_through": N}``, or a mapping per group) are read too.
"""

import json
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from faucet_dagster.protocol import ConfigError

CURSOR_VERSION = 2
HALT_LOG_SECONDS = 300.0
"""While a stream stays halted on one error, the process log repeats it at most this often."""
PASSING = "passing"


@dataclass(frozen=True)
class Halt:
    """The error a stream is halted on (one line), its remedy, since when (seconds since 1970), how
    many ticks found it, and when the process log last said so."""

    reason: str
    remedy: str
    since: float
    ticks: int = 1
    logged: float = 0.0

    def again(self) -> "Halt":
        return replace(self, ticks=self.ticks + 1)

    def log_due(self, now: float) -> bool:
        return now - self.logged >= HALT_LOG_SECONDS

    def describe(self, retrying: str | None = None) -> str:
        """For people: ``halted since 14:02:11 UTC (5 ticks): <error>. Remedy: ...``."""
        since = datetime.fromtimestamp(self.since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        ticks = "1 tick" if self.ticks == 1 else f"{self.ticks} ticks"
        retry = f"; {retrying}" if retrying else ""
        return f"halted since {since} ({ticks}): {self.reason}{retry}. Remedy: {self.remedy}"


@dataclass(frozen=True)
class StreamCursor:
    """A stream sensor's cursor (see the module docstring)."""

    reported_through: dict[str, int]
    health: str | None = None
    halt: Halt | None = None

    def format(self) -> str:
        raw: dict[str, Any] = {"version": CURSOR_VERSION, "reported_through": self.reported_through}
        if self.health is not None:
            raw["health"] = self.health
        if self.halt is not None:
            raw["halt"] = {
                "reason": self.halt.reason,
                "remedy": self.halt.remedy,
                "since": self.halt.since,
                "ticks": self.halt.ticks,
                "logged": self.halt.logged,
            }
        return json.dumps(raw, sort_keys=True)


def parse_cursor(cursor: str | None, stream: str) -> StreamCursor:
    """The cursor of a sensor of ``stream`` (an empty one when there is none); a ``ConfigError`` when
    it is not a faucet stream cursor."""
    if not cursor:
        return StreamCursor({})
    try:
        raw = json.loads(cursor)
        if raw.get("version") not in (1, CURSOR_VERSION):
            raise ValueError(cursor)
        marks = raw["reported_through"]
        if isinstance(marks, bool):
            raise ValueError(cursor)
        reported = {stream: marks} if isinstance(marks, int) else {str(k): int(v) for k, v in marks.items()}
        halt = raw.get("halt")
        return StreamCursor(
            reported,
            health=raw.get("health"),
            halt=None
            if halt is None
            else Halt(
                str(halt["reason"]),
                str(halt["remedy"]),
                float(halt["since"]),
                int(halt["ticks"]),
                float(halt.get("logged", 0.0)),
            ),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(
            f"the sensor cursor {cursor!r} is not a faucet stream cursor", where="sensor cursor"
        ) from None


__all__ = ["CURSOR_VERSION", "HALT_LOG_SECONDS", "PASSING", "Halt", "StreamCursor", "parse_cursor"]
