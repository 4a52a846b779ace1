"""The openb bench's simulator on a hand-made cluster: exact placements and allocations."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_openb.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_openb", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


b = load_bench()

# a: 2 GPUs, b: 1 GPU; both 8 CPUs and 8 GiB.
NODES = [
    b.TraceNode(name="a", cpu_milli=8000, memory_mib=8192, gpus=2),
    b.TraceNode(name="b", cpu_milli=8000, memory_mib=8192, gpus=1),
]
A, B = 0, 1


def pod(name: str, gpu_milli: int, *, num_gpu: int = 1, cpu: int = 1000) -> object:
    return b.TracePod(
        name=name, cpu_milli=cpu, memory_mib=1024, num_gpu=num_gpu, gpu_milli=gpu_milli
    )


def test_gpupool_places_by_the_extender_then_the_core() -> None:
    # The cluster's workload is refreshed at 1, 2, 4, ... arrivals.
    pods = [
        pod("p1", 600),  # seen {60}: gradient 40 on a and on b; b has less GPU left: b
        pod("p2", 500),  # b has 40 left by requests: filtered; a, GPU 0 (lowest index)
        pod("p3", 300),  # seen {60, 50}: b takes its 40 sliver to 10 (gradient -30): b
        pod("p4", 1000, num_gpu=2),  # two empty GPUs nowhere (a's GPU 0 holds p2): fails
        pod("p5", 600),  # only a by requests; GPU 0 would be 110: GPU 1
        pod("p6", 550),  # a by requests (165/200), but 105 and 115 on its GPUs: waits
        pod("p7", 200),  # a (185/200); would fit GPU 0, but the queue is strict: waits behind p6
        pod("p8", 0, num_gpu=0, cpu=5000),  # CPU only: a has 4 CPUs left, b 6: b
        pod("p9", 100, cpu=7000),  # no node has 7 CPUs left: fails
    ]
    run = b.simulate(NODES, pods, b.GpupoolPlacement(), random.Random(0))

    assert run.outcomes == [
        b.Placed(node=B, gpus=(0,)),
        b.Placed(node=A, gpus=(0,)),
        b.Placed(node=B, gpus=(0,)),
        b.Failed(),
        b.Placed(node=A, gpus=(1,)),
        b.Waiting(node=A),
        b.Waiting(node=A),
        b.Placed(node=B, gpus=()),
        b.Failed(),
    ]
    assert run.capacity_milli == 3000
    # Running: p1 600 + p2 500 + p3 300 + p5 600 = 2000 milli of 3000.
    assert run.allocated_percent[-1] == pytest.approx(200 / 3)
    assert run.arrived_percent[-1] == pytest.approx(100 * 4850 / 3000)
    assert (run.count(b.Placed), run.count(b.Waiting), run.count(b.Failed)) == (5, 2, 2)


def test_gpupool_whole_gpu_pods_take_empty_gpus() -> None:
    pods = [pod("two", 1000, num_gpu=2), pod("one", 1000, num_gpu=2)]
    run = b.simulate(NODES, pods, b.GpupoolPlacement(), random.Random(0))
    assert run.outcomes == [b.Placed(node=A, gpus=(0, 1)), b.Failed()]
    assert run.allocated_percent == pytest.approx([200 / 3, 200 / 3])


@pytest.mark.parametrize("seed", range(5))
def test_random_baseline_places_only_where_the_pod_fits(seed: int) -> None:
    pods = [
        pod("two", 1000, num_gpu=2),  # only a has two GPUs
        pod("whole", 1000),  # only b's GPU is left
        pod("small", 100),  # no GPU left anywhere
        pod("cpu", 0, num_gpu=0, cpu=7500),  # a has 6 CPUs left, b 7: nowhere
    ]
    run = b.simulate(NODES, pods, b.random_placement, random.Random(seed))
    assert run.outcomes == [
        b.Placed(node=A, gpus=(0, 1)),
        b.Placed(node=B, gpus=(0,)),
        b.Failed(),
        b.Failed(),
    ]
    assert run.allocated_percent[-1] == pytest.approx(100.0)


def test_best_fit_baseline_packs_cpu_and_gpu() -> None:
    pods = [
        pod("p1", 500),  # CPU+GPU left after: a 0.121 (score 87), b 0.059 (94): b
        pod("p2", 600),  # b cannot take 60 more: a, GPU 0
        pod("p3", 400),  # b 0.030 (97), a 0.086 (91): b, beside p1
        pod("p4", 300),  # only a: GPU 0 (60 used) is fuller than GPU 1 and fits
    ]
    run = b.simulate(NODES, pods, b.best_fit_placement, random.Random(0))
    assert run.outcomes == [
        b.Placed(node=B, gpus=(0,)),
        b.Placed(node=A, gpus=(0,)),
        b.Placed(node=B, gpus=(0,)),
        b.Placed(node=A, gpus=(0,)),
    ]
    assert run.allocated_percent[-1] == pytest.approx(60.0)


def test_arrivals_shuffle_the_trace_then_sample_up_to_the_ratio() -> None:
    trace = [pod(f"p{i:02d}", 100 * (i % 10 + 1)) for i in range(20)]
    capacity = 10 * 1000  # trace demand: 11,000 milli
    order = b.arrivals(trace, capacity, seed=42, ratio=1.3)

    assert sorted(p.name for p in order[:20]) == [p.name for p in trace]
    assert [p.name for p in order[:20]] != [p.name for p in trace]
    assert len(order) > 20  # 11,000 < 13,000: draws were appended
    assert all(extra in trace for extra in order[20:])
    assert sum(p.gpu_demand_milli for p in order) <= 1.3 * capacity
    assert b.arrivals(trace, capacity, seed=42, ratio=1.3) == order
    assert b.arrivals(trace, capacity, seed=43, ratio=1.3) != order


def test_until_past_keeps_the_arrival_that_crosses() -> None:
    pods = [pod("p1", 500), pod("cpu", 0, num_gpu=0), pod("p2", 600), pod("p3", 100)]
    assert [p.name for p in b.until_past(pods, 1000, 100.5)] == ["p1", "cpu", "p2"]
    assert len(b.until_past(pods, 10_000, 100.5)) == 4


def test_unallocated_at_averages_the_arrivals_that_round_to_it() -> None:
    run = b.Run(
        capacity_milli=1000,
        outcomes=[],
        arrived_percent=[99.4, 99.6, 100.4, 100.6],
        allocated_percent=[90.0, 91.0, 92.0, 93.0],
    )
    assert run.unallocated_at(100) == pytest.approx(8.5)
    with pytest.raises(ValueError, match="no arrival rounds to 101"):
        b.Run(
            capacity_milli=1000, outcomes=[], arrived_percent=[99.0], allocated_percent=[90.0]
        ).unallocated_at(101)


def test_read_published_keeps_the_workload_and_converts_to_unallocated(tmp_path: Path) -> None:
    path = tmp_path / "published.csv"
    path.write_text(
        "workload,sc_policy,tune,seed,total_gpus,99,100,101\n"
        "openb_pod_list_default,01-Random,1.3,42,6212,86.0,86.25,86.5\n"
        "openb_pod_list_default,01-Random,1.3,43,6212,85.0,85.5,86.0\n"
        "openb_pod_list_default,06-FGD,1.3,42,6212,95.0,95.23,95.3\n"
        "openb_pod_list_cpu050,06-FGD,1.3,42,6212,1.0,2.0,3.0\n"
    )
    assert b.read_published(path) == {
        "Random": pytest.approx([13.75, 14.5]),
        "FGD": pytest.approx([4.77]),
    }


def test_fgd_reference_takes_the_lowest_gradient_then_the_smallest_name() -> None:
    pods = [pod("q1", 500), pod("q2", 500), pod("q3", 600)]
    workload = b.trace_workload([pod("w", 500), pod("v", 600)])
    run = b.simulate(NODES, pods, b.FgdPlacement(workload), random.Random(0))
    # q1: gradient 0 on a and on b (50 left fits a 50): a, by name
    # q2: filling a's GPU 0 removes its 50 sliver for the 60s (-25 expected): a, GPU 0
    # q3: on a's GPU 1 or on b it leaves a 40 that neither kind can use: +40 both: a, by name
    assert run.outcomes == [
        b.Placed(node=A, gpus=(0,)),
        b.Placed(node=A, gpus=(0,)),
        b.Placed(node=A, gpus=(1,)),
    ]
