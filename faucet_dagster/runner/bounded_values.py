"""What a bounded sync is given and what it reports: its settings, each page's report and the result of a
sync that completed (:mod:`.bounded` runs it)."""

from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from faucet_dagster.planner import Plan
from faucet_dagster.protocol import CommitToken, Delivery, JsonValue

DEFAULT_BATCH_SIZE = 50_000
"""Rows per page when the caller does not say: large enough to amortise a COPY, small enough to
keep a few pages of wide rows well under a hundred megabytes."""


@dataclass(frozen=True)
class SyncSettings:
    """How one bounded sync runs; the write mode and key are the sink's (``Sink.write_mode``).

    ``delivery`` is the guarantee asked for (``None``: the best the pair reaches). ``durable_state``
    says whether the caller persists the returned bookmark and token durably (Dagster run storage
    does). ``evolve_schema`` adds columns the destination lacks instead of refusing them.
    """

    delivery: Delivery | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    evolve_schema: bool = False
    durable_state: bool = True


@dataclass(frozen=True)
class PageReport:
    """What happened to one page, reported to ``on_page`` once its rows are committed or routed."""

    number: int
    rows_read: int
    rows_written: int
    rows_dead_lettered: int
    rows_skipped: int
    bookmark: JsonValue | None
    commit_token: CommitToken | None


@dataclass(frozen=True)
class BoundedSyncResult:
    """The outcome of a sync that completed: every page was written, flushed and finished.

    ``rows_skipped`` counts rows re-read after a crash that the sink had already committed (atomic
    watermark). ``bookmark`` is where the next run resumes; ``commit_token`` the token the next run
    continues from (``None`` when no watermark was ever used). ``schema`` is the destination's schema
    after the run (or the last batch's when the sink cannot tell). ``missing_fields`` counts, per
    field, the rows read whose record lacked it: a field that stops arriving shows here.
    """

    plan: Plan
    rows_read: int
    rows_written: int
    rows_dead_lettered: int
    rows_skipped: int
    pages: int
    bookmark: JsonValue | None
    commit_token: CommitToken | None
    schema: pa.Schema | None
    seconds: float
    evolved_columns: tuple[str, ...] = ()
    missing_fields: Mapping[str, int] = field(default_factory=dict)

    @property
    def rows_per_second(self) -> float:
        """Rows read per second of wall time (0 for an instant, empty run)."""
        return self.rows_read / self.seconds if self.seconds > 0 else 0.0


__all__ = ["DEFAULT_BATCH_SIZE", "BoundedSyncResult", "PageReport", "SyncSettings"]
