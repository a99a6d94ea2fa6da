"""The example's sample data: a shop's customers (Parquet) and orders (CSV, one file a month).

Generated from a fixed seed the first time it is needed, into ``.faucet_data/samples`` (git-ignored),
so the repository carries no data files and every checkout gets the same rows. 50,000 customers and
12 x 20,000 orders: 290,000 rows. A file that exists is never rewritten (the files source bookmarks
files by size and modification time; rewriting one would make the next sync read it again).
"""

import contextlib
import os
import random
import uuid
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

SEED = 20240101
CUSTOMERS = 50_000
ORDERS_PER_MONTH = 20_000
MONTHS = 12

COUNTRIES = ("DE", "FR", "NL", "SE", "US", "GB", "ES", "IT", "PL", "JP")
STATUSES = ("placed", "paid", "shipped", "delivered", "returned")
FIRST = ("Ada", "Ben", "Chloe", "Dev", "Emil", "Fatou", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea")
LAST = ("Berg", "Cruz", "Dahl", "Evans", "Fog", "Gil", "Holm", "Ito", "Jaeger", "Klein", "Lund")


def samples_dir(project_root: Path) -> Path:
    return project_root / ".faucet_data" / "samples"


def ensure_sample_data(project_root: Path) -> Path:
    """Write the sample files that are missing under ``project_root``; return their directory."""
    root = samples_dir(project_root)
    (root / "orders").mkdir(parents=True, exist_ok=True)
    customers = root / "customers.parquet"
    if not customers.exists():
        _write_atomically(customers, _customers(), pq.write_table)
    for month in range(1, MONTHS + 1):
        orders = root / "orders" / f"2024-{month:02d}.csv"
        if not orders.exists():
            _write_atomically(orders, _orders(month), pa_csv.write_csv)
    return root


def _write_atomically(target: Path, table: pa.Table, write: Callable[[pa.Table, str], None]) -> None:
    """Write ``target`` once, whole, even when several processes start at once (``dg dev`` starts
    the webserver's and the daemon's code servers together): each writes a file of its own, then
    links it into place only if no other process did first, so nobody renames another's file away
    and a finished sample file is never replaced (its size and time are the files source's
    bookmark)."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")
    try:
        write(table, str(partial))
        with contextlib.suppress(FileExistsError):  # another process wrote the same rows first
            os.link(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _customers() -> pa.Table:
    rng = random.Random(SEED)
    ids = list(range(1, CUSTOMERS + 1))
    first = [rng.choice(FIRST) for _ in ids]
    last = [rng.choice(LAST) for _ in ids]
    signup = date(2020, 1, 1)
    return pa.table(
        {
            "customer_id": pa.array(ids, pa.int64()),
            "name": [f"{f} {la}" for f, la in zip(first, last, strict=True)],
            "email": [
                f"{f.lower()}.{la.lower()}.{i}@example.com" for i, f, la in zip(ids, first, last, strict=True)
            ],
            "country": [rng.choice(COUNTRIES) for _ in ids],
            "signup_date": pa.array([signup + timedelta(days=rng.randrange(1460)) for _ in ids], pa.date32()),
        }
    )


def _orders(month: int) -> pa.Table:
    rng = random.Random(SEED * 100 + month)
    start = datetime(2024, month, 1, tzinfo=UTC)
    first_id = (month - 1) * ORDERS_PER_MONTH + 1
    seconds = sorted(rng.randrange(28 * 24 * 3600) for _ in range(ORDERS_PER_MONTH))
    return pa.table(
        {
            "order_id": pa.array(range(first_id, first_id + ORDERS_PER_MONTH), pa.int64()),
            "customer_id": pa.array([rng.randint(1, CUSTOMERS) for _ in seconds], pa.int64()),
            "ordered_at": pa.array(
                [start + timedelta(seconds=s) for s in seconds], pa.timestamp("s", tz="UTC")
            ),
            "status": [rng.choice(STATUSES) for _ in seconds],
            "amount": [round(rng.uniform(3, 400), 2) for _ in seconds],
            "currency": ["EUR"] * ORDERS_PER_MONTH,
        }
    )
