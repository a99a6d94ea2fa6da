"""The ``ddl`` fault class: the source table's columns change while a change stream replicates it.

For a change source (the CDC pair) only. Between runs of the stream, each over changes made after the
DDL, the source table:

1. gets a column with a constant default (``ADD COLUMN priority int DEFAULT 7``): PostgreSQL keeps
   the value once for the existing rows, whose change rows never carry it, so the replica must add
   the column with that value for them (the sink evolves its schema);
2. has a column's type changed (``ALTER COLUMN version TYPE bigint``): the rewrite of every row is not
   in the change stream, so the stream must halt with a SchemaError naming the column, and resume
   once the operator altered the replica's column the same way (the documented way out);
3. loses the column added in 1 (``DROP COLUMN priority``): the replica keeps it, and stays equal to
   the source in the source's columns.

The oracle then compares the replica with the source table row by row (:func:`.oracle.judge_state`,
which compares the source's columns), as for every change-source case.
"""

from dataclasses import dataclass, field

import psycopg

from faucet_dagster.testing.faults.case import Case
from faucet_dagster.testing.faults.pairs import CHANGES_TABLE
from faucet_dagster.testing.faults.spec import EXIT_DONE, EXIT_HALTED, Endpoint

ADD_COLUMN = f"ALTER TABLE {CHANGES_TABLE} ADD COLUMN priority int DEFAULT 7"
RETYPE_COLUMN = "ALTER TABLE {table} ALTER COLUMN version TYPE bigint"
DROP_COLUMN = f"ALTER TABLE {CHANGES_TABLE} DROP COLUMN priority"


@dataclass
class DdlOutcome:
    """What the DDL case established: ``halted_correctly`` when every step went as it must."""

    halted_correctly: bool = True
    notes: list[str] = field(default_factory=list)

    def failed(self, note: str) -> None:
        self.halted_correctly = False
        self.notes.append(note)


def run_source_ddl(case: "Case") -> DdlOutcome:
    """Run the three DDL steps on ``case`` (see the module docstring); the records produced before
    and after each are all expected in the replica at the end."""
    outcome = DdlOutcome()
    batch = max(100, case.params.records // 4)
    sink = case.sink.config()
    evolving = Endpoint(case.sink.connector, {**sink, "schema_evolution": True})
    source_url = str(case.source.config()["url"])
    workers = iter(range(1, 100))

    def run(expect: int) -> None:
        worker = case.start(case.spec(f"w{next(workers)}", sink=evolving))
        code = case.finish(worker)
        error = worker.error()
        if code != expect:
            outcome.failed(f"a run exited with {code}, expected {expect}: {error and error.data}")
        elif expect == EXIT_HALTED and (
            error is None or error.data.get("kind") != "schema" or "version" not in str(error.data)
        ):
            outcome.failed(
                f"the type change halted the stream with {error and error.data}, not a SchemaError"
            )

    run(EXIT_DONE)
    _execute(source_url, ADD_COLUMN)
    case.produce("p2", batch)
    run(EXIT_DONE)
    _execute(source_url, RETYPE_COLUMN.format(table=CHANGES_TABLE))
    case.produce("p3", batch)
    run(EXIT_HALTED)
    # The way out the error names: the replica's column altered as the source's was.
    _execute(str(sink["url"]), RETYPE_COLUMN.format(table=f'"{sink["table"]}"'))
    run(EXIT_DONE)
    _execute(source_url, DROP_COLUMN)
    case.produce("p4", batch)
    run(EXIT_DONE)
    return outcome


def _execute(url: str, statement: str) -> None:
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(statement)


__all__ = ["DdlOutcome", "run_source_ddl"]
