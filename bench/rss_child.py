"""One bounded sync of a CSV file into a PostgreSQL table in this fresh process; prints its peak RSS.

``python -m bench.rss_child FILE.csv POSTGRES_URL TABLE`` prints one JSON line:
``{"rows_written": N, "seconds": S, "peak_rss_mb": M}``, where M is this process's peak resident set
size: ``VmHWM`` of ``/proc/self/status``, the high-water mark of this program's own memory.
(``getrusage``'s ``ru_maxrss`` would not do: Linux carries it across ``exec``, so it reports the
benchmark parent's size when that is larger.)
"""

import asyncio
import json
import sys
import time

from faucet_dagster.protocol import get_connector
from faucet_dagster.runner.bounded import run_bounded_sync
from faucet_dagster.runner.bounded_values import SyncSettings


async def sync(path: str, url: str, table: str) -> tuple[int, float]:
    source = get_connector("files").source({"paths": [path], "column_types": {"id": "int64"}})
    sink = get_connector("postgres").sink({"url": url, "table": table})
    try:
        start = time.perf_counter()
        result = await run_bounded_sync(source, sink, SyncSettings())
        return result.rows_written, time.perf_counter() - start
    finally:
        await sink.close()
        await source.close()


def main() -> None:
    path, url, table = sys.argv[1:4]
    written, seconds = asyncio.run(sync(path, url, table))
    print(
        json.dumps({"rows_written": written, "seconds": round(seconds, 3), "peak_rss_mb": peak_kb() / 1024})
    )


def peak_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no VmHWM line")


if __name__ == "__main__":
    main()
