"""Fault injection: real pipelines in worker processes, broken at named points, checked by an oracle.

* :mod:`.points` - ``fault_point(Point.X)``, one line where a crash matters; armed only through the
  environment of a worker process, a no-op everywhere else;
* :mod:`.spec` - the JSON a worker is given and the events it writes back;
* :mod:`.worker` - ``python -m faucet_dagster.testing.faults.worker``: one pipeline (the continuous
  runner the sensor uses, or a bounded sync) in a process the controller can kill, stop and signal;
* :mod:`.pairs` - the source/sink pairs: creating, producing (every record carries its producer id
  and sequence), reading the destination back, deleting, recreating and purging sources;
* :mod:`.scenarios` - the faults and how each runs, and the oracle that checks every record;
* :mod:`.harness` - running named or randomized schedules and the pair x fault table;
  ``python -m faucet_dagster.testing.faults --pairs all --iterations 200 --seed 7``.

This package never imports dagster. Importing it imports :mod:`.points` only (the runners import it).
"""

from faucet_dagster.runner.faults import FAULT_POINT_ENV, Action, Arming, Point, fault_point

__all__ = ["FAULT_POINT_ENV", "Action", "Arming", "Point", "fault_point"]
