"""The machinery of the generated scenarios: seeds, crash points, shrinking, replay, the seam.

The broken connectors of the self-test show that the scenarios catch what they should; these tests
pin what the scenarios rest on: a seed draws the same scenario everywhere, effects are counted the
same on every run, shrinking finds the minimal sequence, the pytest one-liner replays a seed, and a
streaming sink that builds its session inside ``open()`` is checked through the seam.
"""

import asyncio
import random
import sqlite3
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pytest

from faucet_dagster.conformance import broken
from faucet_dagster.conformance.harness import Subject
from faucet_dagster.conformance.options import DEFAULT_OPTIONS
from faucet_dagster.conformance.scenarios import bounded_sink_steps, sink_steps
from faucet_dagster.conformance.scenarios.agent import AgentPlan
from faucet_dagster.conformance.scenarios.effects import EFFECTS
from faucet_dagster.conformance.scenarios.engine import Divergence, Step, Trace, scenario_random, shrink
from faucet_dagster.conformance.scenarios.workers import Crashed, Worker
from faucet_dagster.conformance.seams import WrappedSinkSession, wrap_sessions
from faucet_dagster.conformance.suites import CHECKS_BY_ID, run_check
from faucet_dagster.conformance.targets import postgres_streaming_sink, sql_sink
from faucet_dagster.protocol import (
    CommitToken,
    ConnectorSpec,
    Coverage,
    EpochId,
    Receipt,
    Role,
    get_connector,
)


def test_a_seed_draws_the_same_scenario_every_time_and_another_seed_another() -> None:
    caps = get_connector("postgres").streaming_sink({"url": "postgresql://h/db"}).capabilities()
    declared = sink_steps.SinkDeclaration(caps, per_resource=True, replay_duplicates="none")

    def drawn(seed: int) -> list[Step]:
        return sink_steps.generate(scenario_random(seed, 0, "streaming_sink"), declared)

    assert drawn(3) == drawn(3)
    assert drawn(3) != drawn(4)
    assert (
        random.Random("faucet-conformance/streaming_sink/3/0").random()
        == scenario_random(3, 0, "streaming_sink").random()
    )


def _idempotent_write(
    url: str, token: int, crash_at: int | None, spec: ConnectorSpec | None = None
) -> tuple[str, ...]:
    """One write_batch_idempotent of the SQL sink (or ``spec``'s) in a worker; the effects it made."""

    async def write() -> tuple[str, ...]:
        worker = Worker(AgentPlan(spec or get_connector("sql"), Role.SINK, EFFECTS), timeout=60)
        try:
            sink = await worker.build({"url": url, "table": "items", "mode": "append"})
            batch = pa.RecordBatch.from_pylist([{"id": token, "name": "a"}])
            await worker.call(sink, "write_batch_idempotent", batch, CommitToken(token), crash_at=crash_at)
            return worker.effects
        finally:
            await worker.stop()

    return asyncio.run(write())


def test_effects_are_counted_the_same_on_every_run_and_a_crash_falls_right_before_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sink.db'}"
    _idempotent_write(url, 1, None)  # the table and the watermark exist from here on
    first, second = _idempotent_write(url, 2, None), _idempotent_write(url, 3, None)
    assert first == second
    assert first[-1] == "sqlite3:Connection.commit", first  # rows and token: one transaction
    commit = len(first) - 1
    with pytest.raises(Crashed):
        _idempotent_write(url, 4, commit)
    with sqlite3.connect(tmp_path / "sink.db") as conn:
        assert conn.execute("SELECT count(*) FROM items WHERE id = 4").fetchone() == (0,)
        tokens = conn.execute("SELECT token FROM _faucet_watermarks").fetchall()
    assert tokens == [(str(CommitToken(3)),)]


@pytest.mark.parametrize("split", [True, False])
def test_a_crash_point_splits_two_commits_made_inside_one_synchronous_call(
    tmp_path: Path, split: bool
) -> None:
    """OneCallTwoCommitsSink commits its rows and its token in one worker-thread call: a crash point
    between the two leaves rows without their token, which only a crash between synchronous calls
    (never one at an await) can show."""
    url = f"sqlite:///{tmp_path / 'sink.db'}"
    spec = broken.spec_with("sql", Role.SINK, broken.OneCallTwoCommitsSink)
    _idempotent_write(url, 1, None, spec)
    effects = _idempotent_write(url, 2, None, spec)
    commits = [index for index, effect in enumerate(effects) if effect == "sqlite3:Connection.commit"]
    assert len(commits) == 2, effects
    point = commits[1] if split else commits[0]
    with pytest.raises(Crashed):
        _idempotent_write(url, 3, point, spec)
    with sqlite3.connect(tmp_path / "sink.db") as conn:
        rows = conn.execute("SELECT count(*) FROM items WHERE id = 3").fetchone()
        token = conn.execute("SELECT token FROM _faucet_watermarks").fetchone()
    assert token == (str(CommitToken(2)),)
    assert rows == ((1,) if split else (0,)), "the crash point did not fall between the two commits"


def test_shrinking_keeps_the_smallest_sequence_that_still_breaks_the_rule() -> None:
    class Named(Step):
        def __init__(self, name: str) -> None:
            self.name = name

        def describe(self) -> str:
            return self.name

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Named) and other.name == self.name

        def __hash__(self) -> int:
            return hash(self.name)

    steps: list[Step] = [Named(f"s{number}") for number in range(30)]
    runs: list[int] = []

    async def run_once(candidate: Sequence[Step]) -> Trace:
        runs.append(len(candidate))
        trace = Trace(ran=[step.describe() for step in candidate])
        names = [step.describe() for step in candidate]
        if "s7" in names and "s21" in names:
            trace.diverged_at = names.index("s21")
            failure = Divergence("the rule", "s7 then s21")
            failure.trace = trace
            raise failure
        return trace

    async def first() -> Divergence:
        try:
            await run_once(steps)
        except Divergence as divergence:
            return divergence
        raise AssertionError("the whole scenario does not fail")

    divergence = asyncio.run(first())
    minimal, final, used = asyncio.run(shrink(steps, divergence, run_once, 60))
    assert [step.describe() for step in minimal] == ["s7", "s21"]
    assert final.rule == "the rule" and used == len(runs) - 1 and used <= 60


class CountingSession(WrappedSinkSession):
    """A variant of the PostgreSQL sink's session (built inside ``open()``): counts its commits."""

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        receipts = await super().commit_epoch(epoch, coverage)
        self.commits = getattr(self, "commits", 0) + 1
        return receipts


def test_a_streaming_sink_that_builds_its_session_in_open_is_checked_through_the_seam(
    request: pytest.FixtureRequest,
) -> None:
    from faucet_dagster.conformance.fixtures import Fixtures

    spec = wrap_sessions("postgres", Role.STREAMING_SINK, CountingSession)
    fixtures = Fixtures(
        lambda kind: request.getfixturevalue(f"{kind}_server").start(), hint=request.node.name
    )
    try:
        setup = fixtures.setup(postgres_streaming_sink)
        subject = Subject(
            spec, Role.STREAMING_SINK, setup, DEFAULT_OPTIONS, fresh=fixtures.fresh(postgres_streaming_sink)
        )
        outcome = asyncio.run(run_check(CHECKS_BY_ID["scenarios"], subject))
    finally:
        fixtures.close()
    assert outcome.status.value == "pass", outcome.detail
    assert "owner_fencing" in outcome.exercised and "continuous policy upsert" in outcome.exercised


def test_the_bounded_sink_declaration_runs_a_lane_per_declared_policy(tmp_path: Path) -> None:
    subject = Subject(get_connector("sql"), Role.SINK, sql_sink(tmp_path), DEFAULT_OPTIONS)
    lanes = bounded_sink_steps.declaration(subject).lanes
    assert sorted(lane.policy.value for lane in lanes) == ["append", "replace", "upsert"]
    assert len({lane.resource for lane in lanes}) == len(lanes)


def test_faucet_conformance_tells_a_missing_connector_from_one_without_a_setup(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from faucet_dagster.cli.main import main
    from faucet_dagster.conformance.registry import conformance_setups

    assert main(["conformance", "no_such_connector"]) != 0
    assert "no connector named 'no_such_connector' is installed" in capsys.readouterr().err
    setups = conformance_setups()
    monkeypatch.setattr(
        "faucet_dagster.cli.conformance.conformance_setups",
        lambda: {name: setup for name, setup in setups.items() if name != "kafka"},
    )
    assert main(["conformance", "kafka"]) != 0
    assert "connector 'kafka' is installed, but has no conformance setup" in capsys.readouterr().err


def test_the_pytest_one_liner_replays_a_seed(tmp_path: Path) -> None:
    """The documented one-liner, run with the options a failure prints, runs those scenarios."""
    module = tmp_path / "test_files_conformance.py"
    module.write_text(
        "from faucet_dagster.conformance import conformance_tests\n"
        "from faucet_dagster.conformance.targets import files_source\n\n"
        'TestFiles = conformance_tests(source="files", config=files_source)\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(module), "-q", "-p", "no:cacheprovider", "-k", "scenarios",
         "--conformance-seed", "11", "--conformance-examples", "2", "--rootdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 scenario(s) of seed 11" in result.stdout, result.stdout
