"""Durable state of continuous streams (DESIGN.md section 5): certificates, leases, the uncertain flag.

See :mod:`.store` (and :mod:`.database`, how it reaches its database; :mod:`.certificates`, what
it checks of a certificate; :mod:`.status`, what it reports of a stream). No Dagster here: the CLI
and the sensor both use this store.
"""

from faucet_dagster.state.database import (
    STATE_FILE_NAME,
    STATE_TIMEOUT,
    STATE_URL_ENV,
    StateStoreUnavailable,
    default_state_url,
)
from faucet_dagster.state.status import StreamStatus
from faucet_dagster.state.store import Lease, LeaseBusy, StateStore

__all__ = [
    "STATE_FILE_NAME",
    "STATE_TIMEOUT",
    "STATE_URL_ENV",
    "Lease",
    "LeaseBusy",
    "StateStore",
    "StateStoreUnavailable",
    "StreamStatus",
    "default_state_url",
]
