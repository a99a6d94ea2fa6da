"""The FCP checks, numbered as the FCP numbers them (seed 004, section 7), one module each.

1. :func:`config_schema` (:mod:`.schema`): the config schema is a valid JSON Schema that the setup's
   config satisfies;
2. :func:`bounded_memory` (:mod:`.memory`): pages never exceed ``batch_size``, ``batch_size == 0`` is
   one page, and a paging source holds far less than the dataset at once;
3. and 4. (resume from the bookmark, idempotent replay) are the generated scenarios of bounded
   sources and sinks (:mod:`faucet_dagster.conformance.scenarios`), which resume from every page's
   bookmark while the dataset changes and crash writes at every effect;
5. :func:`capabilities` (:mod:`.capabilities`): each capability claimed works, each one denied is
   refused by the planner (planning the capabilities of the connector built from the spec under test);
6. :func:`no_panic` (:mod:`.panic`): bad config, an unreachable endpoint, a malformed record and an
   empty dataset end in a FaucetError (an empty result for the empty dataset) within the timeout.

Each check is a coroutine taking a :class:`~faucet_dagster.conformance.harness.Subject`; it returns an
:class:`Outcome` or raises :class:`ConformanceFailure` naming the rule broken. The rules and what the
checks share are in :mod:`.common`.
"""

from faucet_dagster.conformance.bounded.capabilities import capabilities
from faucet_dagster.conformance.bounded.common import (
    ANY_SINK,
    ANY_SOURCE,
    CAPABILITY_RULE,
    MEMORY_RULE,
    PANIC_RULE,
    SCHEMA_RULE,
    read_all,
)
from faucet_dagster.conformance.bounded.memory import bounded_memory
from faucet_dagster.conformance.bounded.panic import no_panic
from faucet_dagster.conformance.bounded.schema import config_schema
from faucet_dagster.conformance.harness import QUIET

__all__ = [
    "ANY_SINK",
    "ANY_SOURCE",
    "CAPABILITY_RULE",
    "MEMORY_RULE",
    "PANIC_RULE",
    "QUIET",
    "SCHEMA_RULE",
    "bounded_memory",
    "capabilities",
    "config_schema",
    "no_panic",
    "read_all",
]
