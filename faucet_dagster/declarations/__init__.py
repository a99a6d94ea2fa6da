"""What syncs and streams share in the Dagster integration: connections as resources
(:mod:`.resources`), the check of every pair when definitions load (:mod:`.preflight`), where a
declaration was made (:mod:`.code_location`) and what a process declared (:mod:`.declared`).
"""
