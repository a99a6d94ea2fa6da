"""The conformance battery on the Delta Lake sink: local tables, and tables on S3 (moto's server).

On S3 the generated scenarios are left out: they take about 36 s there (against 11 s locally), and what
they check of the store (a crash at each effect, replays, the watermark read by another process) is
covered on S3 by the fault tests of ``tests/connectors/test_delta_sink.py``, run on both stores.
"""

from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.options import ConformanceOptions
from faucet_dagster.conformance.targets import delta_s3_sink, delta_sink

TestDeltaSink = conformance_tests(sink="delta", config=delta_sink)
TestDeltaSinkOnS3 = conformance_tests(
    sink="delta",
    config=delta_s3_sink,
    options=ConformanceOptions(checks=frozenset({"config_schema", "capabilities", "no_panic"})),
)
