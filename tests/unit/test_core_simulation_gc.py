"""The simulator suspends the cyclic garbage collector while it runs, and leaves it as it was.

``Simulator.run`` disables the collector for the run (the log and the state hold no
reference cycles, and a growing log made the collector traverse it again and again).
It restores the collector's state after a run, after a run that fails, and leaves a
disabled collector disabled; what it builds leaves no cyclic garbage behind.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool.cli.scenario_file import load_scenario
from gpupool.core.simulation import Scenario, ScenarioAction, ScenarioError, Simulator

SCENARIOS = sorted((Path(__file__).resolve().parents[2] / "scenarios").glob("*.yaml"))


@pytest.fixture
def collector_enabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


@pytest.mark.usefixtures("collector_enabled")
def test_the_collector_is_off_during_a_run_and_on_after() -> None:
    seen: list[bool] = []

    class Watching(Simulator):
        def _act(self, *args: object, **kwargs: object) -> None:
            seen.append(gc.isenabled())
            super()._act(*args, **kwargs)  # type: ignore[arg-type]

    Watching(load_scenario(SCENARIOS[0])).run()
    assert seen and not any(seen)
    assert gc.isenabled()


@pytest.mark.usefixtures("collector_enabled")
def test_a_run_that_fails_restores_the_collector() -> None:
    scenario = load_scenario(SCENARIOS[0])
    broken = Scenario(
        nodes=scenario.nodes,
        pods=scenario.pods,
        timeline=[ScenarioAction(at=1.0, action="set-policy", node="no-such-node")],
    )
    with pytest.raises(ScenarioError):
        Simulator(broken).run()
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled() -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        Simulator(load_scenario(SCENARIOS[0])).run()
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()


@pytest.mark.usefixtures("collector_enabled")
@pytest.mark.parametrize("path", SCENARIOS, ids=[path.stem for path in SCENARIOS])
def test_a_run_leaves_no_cyclic_garbage(path: Path) -> None:
    scenario = load_scenario(path)
    gc.collect()
    log = Simulator(scenario).run()
    assert log
    assert gc.collect() == 0, "the run made reference cycles: the collector had work to do"
