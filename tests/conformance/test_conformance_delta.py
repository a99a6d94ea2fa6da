"""The conformance battery on the Delta Lake sinks, bounded and streaming: local tables, and tables on
S3 (moto's server).

On S3 the generated scenarios are left out: they take about 36 s there (against 11 s locally), and what
they check of the store (a crash at each effect, replays, the watermark read by another process) is
covered on S3 by the fault tests of ``tests/connectors/test_delta_sink.py``, run on both stores.
"""

from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.options import ConformanceOptions
from faucet_dagster.conformance.targets import (
    DELTA_STREAMING_OPTIONS,
    delta_s3_sink,
    delta_s3_streaming_sink,
    delta_sink,
    delta_streaming_sink,
)

_CHEAP_CHECKS = ConformanceOptions(checks=frozenset({"config_schema", "capabilities", "no_panic"}))

TestDeltaSink = conformance_tests(sink="delta", config=delta_sink)
TestDeltaSinkOnS3 = conformance_tests(sink="delta", config=delta_s3_sink, options=_CHEAP_CHECKS)
TestDeltaStreamingSink = conformance_tests(
    streaming_sink="delta", config=delta_streaming_sink, options=DELTA_STREAMING_OPTIONS
)
TestDeltaStreamingSinkOnS3 = conformance_tests(
    streaming_sink="delta", config=delta_s3_streaming_sink, options=_CHEAP_CHECKS
)
