"""The pipeline between a source session and a sink session: Arrow batches, integrity, epoch completion.

See :mod:`.epoch` for what the pipeline guarantees, :mod:`.schema` for how rows become Arrow, and
:mod:`.integrity` for the checks and the digest of every batch handed to a sink. The epoch's parts:
:mod:`.domain` (the position checks of one ordering domain), :mod:`.builder` (rows waiting to become
a batch) and :mod:`.writer` (batches handed to the sink, one ``apply`` in flight).
"""

from faucet_dagster.pipeline.epoch import (
    DeadLetterRoute,
    EpochPipeline,
    Pipeline,
    PipelineOptions,
    SealedEpoch,
)
from faucet_dagster.pipeline.integrity import (
    DIGEST_ALGORITHM,
    ROW_DIGEST_ALGORITHM,
    EpochDigest,
    RowDigests,
    check_batch,
)
from faucet_dagster.pipeline.schema import BadRow, BadRowPolicy, Converted, ResourceSchema, RowConverter

__all__ = [
    "DIGEST_ALGORITHM",
    "ROW_DIGEST_ALGORITHM",
    "BadRow",
    "BadRowPolicy",
    "Converted",
    "DeadLetterRoute",
    "EpochDigest",
    "EpochPipeline",
    "Pipeline",
    "PipelineOptions",
    "ResourceSchema",
    "RowConverter",
    "RowDigests",
    "SealedEpoch",
    "check_batch",
]
