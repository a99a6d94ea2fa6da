"""Finding the rows a destination refuses, for ``Sink.write_batch_partial``.

A transactional sink applies a batch all or nothing. To report per-row outcomes it can apply the
batch under a savepoint and, when the destination refuses it for a row-level reason (a constraint, a
value that does not convert), split it in halves and try again, down to single rows. With ``k`` bad
rows among ``n`` this costs ``O(k log n)`` attempts instead of ``n``, and the rows that land are applied
in their original order (left half before right half).
"""

from collections.abc import Awaitable, Callable

from faucet_dagster.protocol.bounded import PartialResult, RejectedRow

Attempt = Callable[[int, int], Awaitable[str | None]]
"""``attempt(start, stop)`` applies rows ``start`` to ``stop`` (exclusive) atomically: all of them or
none. It returns ``None`` when they were applied, or the destination's reason when it refused them
for a row-level reason; any other failure it raises (it is not a bad row)."""


async def bisect_rejections(count: int, attempt: Attempt) -> PartialResult:
    """Apply rows ``0`` to ``count`` through ``attempt``; return how many landed and which were refused.

    Rejected rows are reported by index, in ascending order, each with the reason the destination
    gave for that row alone. Blocks until every row is applied or rejected; an error raised by
    ``attempt`` propagates and the caller rolls back.
    """
    rejected: list[RejectedRow] = []
    written = 0
    pending = [(0, count)] if count else []
    while pending:
        start, stop = pending.pop()
        reason = await attempt(start, stop)
        if reason is None:
            written += stop - start
        elif stop - start == 1:
            rejected.append(RejectedRow(start, reason))
        else:
            middle = (start + stop) // 2
            # Last in, first out: the left half is tried first, so rows land in their order.
            pending.extend([(middle, stop), (start, middle)])
    return PartialResult(written=written, rejected=tuple(rejected))
