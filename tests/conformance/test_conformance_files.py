"""The conformance battery on the files connector."""

from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.targets import files_source

TestFilesSource = conformance_tests(source="files", config=files_source)
