"""The streaming checks: the interruptions of seed 000, "Test interruptions at the boundaries".

The ones the generated scenarios (:mod:`faucet_dagster.conformance.scenarios`) do not draw. Stream
sources (:mod:`.sources`): a slow sink, cancellation during a read. Streaming sinks (:mod:`.sinks`,
and :mod:`.shutdown`): failed writes, an uncertain commit given up by its caller, misordered
lifecycle calls, shutdown with outstanding work against a stalled destination. Partial
transactions, ownership, speculative acknowledgements, unwritten and unavailable positions and the
replay after the destination commit are explored by the scenarios.

Each check is a coroutine taking a :class:`~faucet_dagster.conformance.harness.Subject`; it returns an
:class:`Outcome` or raises :class:`ConformanceFailure` naming the rule broken. The rules and what the
checks share are in :mod:`.common`.
"""

from faucet_dagster.conformance.harness import QUIET
from faucet_dagster.conformance.streaming.common import (
    CANCEL_RULE,
    ENDLESS,
    FAILED_WRITE_RULE,
    LIFECYCLE_RULE,
    SHUTDOWN_RULE,
    SLOW_RULE,
    UNCERTAIN_RULE,
)
from faucet_dagster.conformance.streaming.shutdown import shutdown_with_outstanding_work
from faucet_dagster.conformance.streaming.sinks import (
    close_and_watch,
    close_honestly,
    failed_writes,
    lifecycle_order,
    uncertain_commit,
)
from faucet_dagster.conformance.streaming.sources import (
    cancel_during_read,
    slow_sink,
)

__all__ = [
    "CANCEL_RULE",
    "ENDLESS",
    "FAILED_WRITE_RULE",
    "LIFECYCLE_RULE",
    "QUIET",
    "SHUTDOWN_RULE",
    "SLOW_RULE",
    "UNCERTAIN_RULE",
    "cancel_during_read",
    "close_and_watch",
    "close_honestly",
    "failed_writes",
    "lifecycle_order",
    "shutdown_with_outstanding_work",
    "slow_sink",
    "uncertain_commit",
]
