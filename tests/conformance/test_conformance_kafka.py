"""The conformance battery on the Kafka connector: the continuous and the bounded source."""

from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.targets import kafka_source

TestKafkaStreamSource = conformance_tests(stream_source="kafka", config=kafka_source)
TestKafkaSource = conformance_tests(source="kafka", config=kafka_source)
