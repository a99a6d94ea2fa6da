"""What every broken connector is built with: a shipped connector's spec with one role replaced
(the public seam of :mod:`faucet_dagster.conformance.seams`, re-exported here)."""

from faucet_dagster.conformance.seams import Wrap, real_role, spec_with, wrapping

__all__ = ["Wrap", "real_role", "spec_with", "wrapping"]
