"""The streaming checks: the interruptions of seed 000, "Test interruptions at the boundaries".

Stream sources (:mod:`.sources`, :mod:`.ownership`): a slow sink, cancellation during a read, a
partial source transaction, loss of ownership before the acknowledgement, a position whose rows were
not written, and an unavailable resume position. Streaming sinks (:mod:`.sinks`, and
:mod:`.shutdown`): failed writes, an uncertain commit, misordered lifecycle
calls, shutdown with outstanding work. Both (:mod:`.replay`): the replay after the destination
commit, before the certificate, which for a sink must match the duplicate handling the connector
documents (``ConformanceOptions.replay_duplicates``).

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
    OWNERSHIP_RULE,
    REPLAY_RULE,
    SHUTDOWN_RULE,
    SLOW_RULE,
    SPECULATIVE_RULE,
    TRANSACTION_RULE,
    UNAVAILABLE_RULE,
    UNCERTAIN_RULE,
    UNWRITTEN_RULE,
)
from faucet_dagster.conformance.streaming.ownership import ownership_lost_before_ack
from faucet_dagster.conformance.streaming.replay import replay_after_commit
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
    partial_transaction,
    slow_sink,
    speculative_acknowledgement,
    unavailable_position,
    unwritten_position,
)

__all__ = [
    "CANCEL_RULE",
    "ENDLESS",
    "FAILED_WRITE_RULE",
    "LIFECYCLE_RULE",
    "OWNERSHIP_RULE",
    "QUIET",
    "REPLAY_RULE",
    "SHUTDOWN_RULE",
    "SLOW_RULE",
    "SPECULATIVE_RULE",
    "TRANSACTION_RULE",
    "UNAVAILABLE_RULE",
    "UNCERTAIN_RULE",
    "UNWRITTEN_RULE",
    "cancel_during_read",
    "close_and_watch",
    "close_honestly",
    "failed_writes",
    "lifecycle_order",
    "ownership_lost_before_ack",
    "partial_transaction",
    "replay_after_commit",
    "shutdown_with_outstanding_work",
    "slow_sink",
    "speculative_acknowledgement",
    "unavailable_position",
    "uncertain_commit",
    "unwritten_position",
]
