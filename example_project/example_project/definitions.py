"""The example's Dagster code location: the components under ``defs/``, with their sample data.

``dagster dev`` (or ``dg dev``) loads this module. The sample files are generated first when missing,
because the orders sync lists its files (one partition each) when the definitions load.
"""

from pathlib import Path

import dagster as dg

from example_project.sample_data import ensure_sample_data

PROJECT_ROOT = Path(__file__).resolve().parent.parent

ensure_sample_data(PROJECT_ROOT)

defs = dg.load_from_defs_folder(path_within_project=Path(__file__).parent / "defs")
