"""``faucet verify``: a certificate anyone can check again later, against the source and the destination.

Engine code (no Dagster): :func:`verify_stream` checks a range of a continuous stream's certificates
(:mod:`.streams`); :func:`verify_sync` a bounded sync's runs (:mod:`.syncs`). Each yields a
:class:`Report` of :class:`Verification` values, one per certificate or run: verified, diverged (what
and where) or not verifiable (why). The checks are in :mod:`.chain` (the state store), :mod:`.replay`
(the source) and :mod:`.destination` (the sink); docs/verification.md says how to read one.
"""

from faucet_dagster.verify.results import (
    Aspect,
    Finding,
    Outcome,
    Report,
    Verification,
    render_table,
    rows_json,
    table_rows,
)
from faucet_dagster.verify.streams import VerifyOptions, verify_stream
from faucet_dagster.verify.syncs import SyncRun, verify_sync

__all__ = [
    "Aspect",
    "Finding",
    "Outcome",
    "Report",
    "SyncRun",
    "Verification",
    "VerifyOptions",
    "render_table",
    "rows_json",
    "table_rows",
    "verify_stream",
    "verify_sync",
]
