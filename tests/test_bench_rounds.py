"""The bench's rounds: each scenario's ratio is taken against a run of its baseline made just before it."""

from collections.abc import Callable

from bench.cli import run_scenarios
from bench.context import BenchContext
from bench.registry import Measurement, Scenario


def test_a_baseline_runs_again_before_each_scenario_that_did_not_follow_it_directly() -> None:
    order: list[str] = []
    seconds = {"raw": [1.0, 2.0] * 2, "a": [2.0] * 4, "b": [2.0, 2.0], "peer": [8.0, 8.0]}

    def timed(name: str) -> Callable[[BenchContext], Measurement]:
        def fn(ctx: BenchContext) -> Measurement:
            order.append(name)
            return Measurement(100, seconds[name].pop(0))

        return fn

    scenarios = [
        Scenario("raw", timed("raw"), None, ""),
        Scenario("a", timed("a"), "raw", ""),
        Scenario("b", timed("b"), "raw", ""),
        Scenario("peer", timed("peer"), "a", ""),
    ]
    results = {r.name: r for r in run_scenarios(scenarios, BenchContext(100), repeat=2)}

    # "b" follows "a", so "raw" runs again first; "peer" follows "b", so "a" runs again first.
    assert order == ["raw", "a", "raw", "b", "a", "peer"] * 2
    # Each ratio against the baseline's run just before: a (50/s) over raw's first (100/s), b (50/s)
    # over raw's second (50/s), peer (12.5/s) over a's second run (50/s).
    assert results["a"].ratios == [0.5, 0.5]
    assert results["b"].ratios == [1.0, 1.0]
    assert results["peer"].ratios == [0.25, 0.25]
    assert len(results["raw"].runs) == 4 and len(results["a"].runs) == 4


def test_data_made_per_round_is_shared_by_a_scenario_and_its_baseline_and_made_again_next_round() -> None:
    """What a CDC pair reads (a slot and the WAL after it) is made once per round: a slot of round 1
    would have round 5's copies decode everything the rounds before wrote; the slot of the round before
    is released (dropped: the server has slots for a few rounds only)."""
    made: list[int] = []
    released: list[int] = []
    seen: dict[str, list[int]] = {"raw": [], "a": []}

    def reading(name: str) -> Callable[[BenchContext], Measurement]:
        def fn(ctx: BenchContext) -> Measurement:
            seen[name].append(
                ctx.per_round("slot", lambda: made.append(ctx.round) or len(made), released.append)
            )
            return Measurement(100, 1.0)

        return fn

    scenarios = [Scenario("raw", reading("raw"), None, ""), Scenario("a", reading("a"), "raw", "")]
    run_scenarios(scenarios, BenchContext(100), repeat=3)
    assert made == [1, 2, 3]
    assert released == [1, 2]  # each round's value released when the next round's was made
    assert seen == {"raw": [1, 2, 3], "a": [1, 2, 3]}
