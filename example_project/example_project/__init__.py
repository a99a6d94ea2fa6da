"""The faucet-dagster example: a shop's sample customers and orders synced into DuckDB by Dagster, and
order events streamed from NATS JetStream and Kafka into PostgreSQL where those servers are configured.
"""

POSTGRES_URL_ENV = "FAUCET_EXAMPLE_POSTGRES_URL"
NATS_URL_ENV = "FAUCET_EXAMPLE_NATS_URL"
KAFKA_BOOTSTRAP_ENV = "FAUCET_EXAMPLE_KAFKA_BOOTSTRAP"
"""The variables that enable the streams of ``defs/streams/defs.yaml`` (which spells them out)."""
