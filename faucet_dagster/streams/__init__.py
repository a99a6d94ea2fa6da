"""Continuous streams as Dagster sensors (the Dagster integration; these modules import ``dagster``).

:mod:`.declaration` a stream as declared; :mod:`.definitions` its asset, checks and sensor;
:mod:`.sensor` the tick; :mod:`.certificates` certificates as materializations and check evaluations;
:mod:`.health` the health check, lag and throughput; :mod:`.runner_cache` the runners kept open per
code-server process; :mod:`.workers` and :mod:`.worker_runs` a stream on several long-running runs.
"""
