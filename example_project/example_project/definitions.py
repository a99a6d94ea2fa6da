"""The example's Dagster code location: the components under ``defs/``, with their sample data.

``dagster dev`` (or ``dg dev``) loads this module. The sample files are generated first when missing
(once, whole, however many code servers start together), so the first run finds them; the orders
sync's partitions, one a file, are added by its partitions sensor (or ``python -m example_project``).
"""

from pathlib import Path

import dagster as dg

from example_project.sample_data import ensure_sample_data

PROJECT_ROOT = Path(__file__).resolve().parent.parent

ensure_sample_data(PROJECT_ROOT)

defs = dg.load_from_defs_folder(path_within_project=Path(__file__).parent / "defs")
