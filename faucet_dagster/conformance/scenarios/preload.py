"""Imported once by the fork server that worker processes are forked from (:mod:`.workers`).

Everything imported here is already in memory in every worker: the protocol, the pipeline, the
worker's own code, and the connectors installed in the ``faucet.connectors`` group with the modules
their factories live in (a connector package keeps its entry module thin and imports its clients
where it builds: that import is done here once instead of in every worker). A connector that cannot
be imported is left for its worker to import, where the error is reported.
"""

import contextlib
import importlib

from faucet_dagster.protocol import load_connectors

_LAZY = ("sqlalchemy.dialects.sqlite", "sqlalchemy.dialects.postgresql", "psycopg.pq", "nats.js.kv")
"""Modules the shipped connectors import when they first connect."""

for _spec in load_connectors().values():
    for _role in _spec.roles.values():
        for _module in {getattr(_role.factory, "__module__", None), _role.config_model.__module__}:
            if _module:
                with contextlib.suppress(Exception):
                    importlib.import_module(_module)
for _module in _LAZY:
    with contextlib.suppress(Exception):
        importlib.import_module(_module)

__all__: list[str] = []
