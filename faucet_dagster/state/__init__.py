"""Durable state of continuous streams (DESIGN.md section 5): certificates, leases, the uncertain flag.

See :mod:`.store`. No Dagster here: the CLI and the sensor both use this store.
"""

from faucet_dagster.state.store import (
    STATE_FILE_NAME,
    STATE_URL_ENV,
    Lease,
    LeaseBusy,
    StateStore,
    StreamStatus,
    default_state_url,
)

__all__ = [
    "STATE_FILE_NAME",
    "STATE_URL_ENV",
    "Lease",
    "LeaseBusy",
    "StateStore",
    "StreamStatus",
    "default_state_url",
]
