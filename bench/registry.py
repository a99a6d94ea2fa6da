"""The scenario registry: a scenario is a named function that moves ``ctx.rows`` rows and times itself.

A scenario module registers its functions with :func:`scenario`::

    @scenario("faucet.kafka_to_pg", baseline="raw.kafka_to_pg")
    def kafka_to_pg(ctx: BenchContext) -> Measurement:
        '''One line saying what is measured.'''
        topic = data.kafka_source_topic(ctx)  # same data as the baseline
        ...setup, not timed...
        start = time.perf_counter()
        ...the measured work...
        seconds = time.perf_counter() - start
        ...check the result, not timed...
        return Measurement(ctx.rows, seconds)

and is picked up by :func:`bench.scenarios.load_all` (every module in ``bench/scenarios``). A scenario
with a ``baseline`` always runs together with it, and the report shows its rate as a ratio of the
baseline's rate.
"""

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.context import BenchContext


@dataclass(frozen=True)
class Measurement:
    """What a scenario reports: rows moved and the seconds the measured part took."""

    rows: int
    seconds: float
    details: Mapping[str, object] = field(default_factory=dict)


ScenarioFn = Callable[["BenchContext"], Measurement]


@dataclass(frozen=True)
class Scenario:
    name: str
    fn: ScenarioFn
    baseline: str | None
    description: str


_REGISTRY: dict[str, Scenario] = {}


def scenario(name: str, *, baseline: str | None = None) -> Callable[[ScenarioFn], ScenarioFn]:
    """Register the decorated function as scenario ``name`` (dotted, ``<module>.<what>``).

    ``baseline`` names the scenario it is compared with. The description is the docstring's first line.
    Raises ``ValueError`` on a duplicate name.
    """

    def register(fn: ScenarioFn) -> ScenarioFn:
        if name in _REGISTRY:
            raise ValueError(f"benchmark scenario {name!r} is registered twice")
        doc = (fn.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = Scenario(name, fn, baseline, doc[0] if doc else "")
        return fn

    return register


def all_scenarios() -> dict[str, Scenario]:
    """Every registered scenario, in registration order."""
    return dict(_REGISTRY)


def select(patterns: Iterable[str] | None) -> list[Scenario]:
    """Scenarios whose name matches any glob in ``patterns`` (all when None), plus their baselines.

    Each baseline comes before the first scenario that needs it; otherwise registration order is kept.
    Raises ``ValueError`` when a pattern matches nothing or a baseline is not registered.
    """
    names = list(_REGISTRY)
    if patterns is None:
        chosen = names
    else:
        chosen = []
        for pattern in patterns:
            matched = fnmatch.filter(names, pattern)
            if not matched:
                raise ValueError(f"no benchmark scenario matches {pattern!r}; known: {', '.join(names)}")
            chosen += [n for n in matched if n not in chosen]
        chosen.sort(key=names.index)
    ordered: list[Scenario] = []

    def add(name: str, needed_by: str | None) -> None:
        if name not in _REGISTRY:
            raise ValueError(f"scenario {needed_by!r} names an unknown baseline {name!r}")
        if any(s.name == name for s in ordered):
            return
        item = _REGISTRY[name]
        if item.baseline is not None:
            add(item.baseline, name)
        ordered.append(item)

    for name in chosen:
        add(name, None)
    return ordered
