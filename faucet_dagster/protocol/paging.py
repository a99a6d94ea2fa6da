"""Cutting a stream of Arrow record batches of any sizes into pages of a fixed number of rows.

Readers hand out batches sized by their own blocks (a CSV block, a Parquet row group, a COPY chunk);
``Source.stream_pages`` promises pages of at most ``batch_size`` rows. :class:`PageBuilder` does the
cutting without copying more than the rows that straddle a page boundary, and holds at most one page
of rows between calls.
"""

import pyarrow as pa


class PageBuilder:
    """Accumulates record batches (one schema) and returns full pages of exactly ``size`` rows.

    ``size == 0`` means one page of everything: ``add`` never returns a page and ``finish`` returns
    all the rows. Pages keep the order of the rows added.
    """

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"a page size is >= 0, got {size}")
        self.size = size
        self._pending: list[pa.RecordBatch] = []
        self._rows = 0

    @property
    def pending_rows(self) -> int:
        """Rows added but not yet returned in a page."""
        return self._rows

    def add(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        """Add ``batch``; return the pages it completed (possibly none)."""
        pages = []
        while batch.num_rows:
            take = batch.num_rows if self.size == 0 else min(self.size - self._rows, batch.num_rows)
            self._pending.append(batch.slice(0, take))
            self._rows += take
            batch = batch.slice(take)
            if self._rows == self.size:
                pages.append(self._take())
        return pages

    def finish(self) -> pa.RecordBatch | None:
        """The last, possibly short, page; ``None`` when no rows are pending."""
        return self._take() if self._rows else None

    def _take(self) -> pa.RecordBatch:
        pending, self._pending, self._rows = self._pending, [], 0
        return pending[0] if len(pending) == 1 else pa.concat_batches(pending)
