"""``python -m bench``: run the benchmark scenarios (see ``bench/README.md``)."""

from bench.cli import main

raise SystemExit(main())
