"""The faucet-dagster example: a shop's sample customers and orders synced into SQLite by Dagster."""
