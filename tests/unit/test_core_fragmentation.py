"""The fragmentation measure on hand-computed cases, and the in-node GPU choice's limits rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.core.fragmentation import (
    NodeFree,
    Task,
    Workload,
    fragmentation,
    gradient,
    place,
    stranded,
    task_fragment,
)
from gpupool.core.placement import GpuUsage, add, choose_gpu, fits
from gpupool.events import Share


def s(core: int, memory: int | None = None) -> Share:
    return Share(core=core, memory=core if memory is None else memory)


def node(*free: Share, cpu: int = 8000, memory: int = 8192) -> NodeFree:
    return NodeFree(cpu_milli=cpu, memory_mib=memory, gpus=free)


def share_task(core: int, memory: int | None = None, *, cpu: int = 1000, mib: int = 1024) -> Task:
    return Task(cpu_milli=cpu, memory_mib=mib, gpus=1, share=s(core, memory))


WHOLE_TASK = Task(cpu_milli=1000, memory_mib=1024, gpus=1, share=s(100))


# --------------------------------------------------------------------------- one task


@pytest.mark.parametrize(
    ("free", "task", "expected"),
    [
        pytest.param((s(100), s(30)), share_task(50), 30, id="the-30-left-cannot-take-a-50"),
        pytest.param((s(100), s(30)), share_task(20), 0, id="every-gpu-takes-a-20"),
        pytest.param((s(100), s(30)), WHOLE_TASK, 30, id="a-whole-gpu-task-cannot-use-a-part"),
        pytest.param((s(40), s(30)), share_task(50), 70, id="no-gpu-fits-all-is-fragment"),
        pytest.param((s(80, 20),), share_task(30), 80, id="memory-too-small-makes-it-fragment"),
        pytest.param(
            (s(100), s(60), s(0)),
            Task(cpu_milli=1000, memory_mib=1024, gpus=2),
            160,
            id="two-gpu-task-needs-two-whole-gpus",
        ),
        pytest.param(
            (s(100), s(100), s(60)),
            Task(cpu_milli=1000, memory_mib=1024, gpus=2),
            60,
            id="two-gpu-task-fits-the-part-is-fragment",
        ),
        pytest.param((s(100), s(30)), Task(cpu_milli=1000, gpus=0), 0, id="cpu-only-task-fits"),
        pytest.param(
            (s(100), s(30)), Task(cpu_milli=9000, gpus=0), 130, id="cpu-only-task-does-not-fit"
        ),
        pytest.param(
            (s(100), s(30)), share_task(10, cpu=9000), 130, id="not-enough-cpu-all-is-fragment"
        ),
        pytest.param(
            (s(100), s(30)), share_task(10, mib=9000), 130, id="not-enough-memory-all-fragment"
        ),
    ],
)
def test_task_fragment_on_hand_computed_nodes(
    free: tuple[Share, ...], task: Task, expected: int
) -> None:
    assert task_fragment(node(*free), task) == expected


# --------------------------------------------------------------------------- a distribution


def test_fragmentation_is_the_fragment_expected_over_the_workload() -> None:
    # free 100 and 30; half the pods ask 50 % (fragment 30), half a whole GPU (fragment 30)
    workload = Workload.of([share_task(50), WHOLE_TASK])
    assert fragmentation(node(s(100), s(30)), workload) == pytest.approx(30)


def test_a_cpu_starved_task_makes_all_free_gpu_a_fragment_with_its_probability() -> None:
    # 1 in 4 pods needs 16 CPUs (the node has 8): fragment 130; the others ask 10 %: 0
    workload = Workload.of({share_task(10, cpu=16000): 1, share_task(10): 3})
    assert fragmentation(node(s(100), s(30)), workload) == pytest.approx(0.25 * 130)


def test_fragmentation_weights_three_tasks() -> None:
    # free 100, 60, 20. Tasks: 50 % ×2 (fragment 20), 70 % ×1 (fragment 80), 2 GPUs ×1 (180)
    workload = Workload.of(
        {share_task(50): 2, share_task(70): 1, Task(cpu_milli=1000, memory_mib=1024, gpus=2): 1}
    )
    expected = (2 * 20 + 1 * 80 + 1 * 180) / 4
    assert fragmentation(node(s(100), s(60), s(20)), workload) == pytest.approx(expected)


def test_a_full_node_and_an_empty_workload_have_no_fragmentation() -> None:
    assert fragmentation(node(s(0), s(0)), Workload.of([share_task(50)])) == 0
    assert fragmentation(node(s(100), s(30)), Workload.of([])) == 0


def test_the_gradient_prices_the_sliver_a_placement_leaves() -> None:
    workload = Workload.of([share_task(50)])
    empty = node(s(100), s(100))
    # a 60 % pod leaves 40 on its GPU: a 50 % pod cannot use it
    assert gradient(empty, share_task(60), [0], workload) == pytest.approx(40)
    # a 50 % pod leaves 50: still usable
    assert gradient(empty, share_task(50), [0], workload) == pytest.approx(0)
    # filling the 40 left removes that fragment
    assert gradient(node(s(40), s(100)), share_task(40), [0], workload) == pytest.approx(-40)


def test_place_takes_the_share_cpu_and_memory() -> None:
    after = place(node(s(100), s(100)), share_task(30, 20, cpu=500, mib=256), [1])
    assert after == NodeFree(cpu_milli=7500, memory_mib=7936, gpus=(s(100), s(70, 80)))
    whole = place(node(s(100), s(100), s(100)), Task(gpus=2), [0, 2])
    assert whole.gpus == (s(0), s(100), s(0))


def test_workload_counts_pods_of_the_same_kind_together() -> None:
    workload = Workload.of([share_task(50), share_task(50), WHOLE_TASK])
    assert dict(workload.weights) == {share_task(50): 2.0, WHOLE_TASK: 1.0}
    assert workload.total == 3
    assert dict(workload.gpu_only().weights) == {Task(share=s(50)): 2.0, Task(share=s(100)): 1.0}


def test_stranded_is_the_free_gpu_the_cpu_and_memory_left_could_not_serve() -> None:
    # GPU pods: a 50 % pod with 2 CPUs and 1 GiB, a whole-GPU pod with 4 CPUs and 2 GiB;
    # the CPU-only pod does not count. Per percent of GPU: 6000 / 150 = 40 milli CPU,
    # 3072 / 150 = 20.48 MiB.
    workload = Workload.of(
        [
            share_task(50, cpu=2000, mib=1024),
            Task(cpu_milli=4000, memory_mib=2048, gpus=1, share=s(100)),
            Task(cpu_milli=8000, memory_mib=65536, gpus=0),
        ]
    )
    assert workload.cpu_per_percent == pytest.approx(40)
    assert workload.memory_per_percent == pytest.approx(20.48)
    # 160 free; 4 CPUs carry 100 of it: 60 stranded; 8 GiB carry 400: none
    assert stranded(node(s(100), s(60), cpu=4000, memory=8192), workload) == pytest.approx(60)
    # 2 GiB carry 100 as well: 60 more, by memory
    assert stranded(node(s(100), s(60), cpu=4000, memory=2048), workload) == pytest.approx(120)
    # CPU and memory to spare, or no free GPU: nothing stranded
    assert stranded(node(s(100), s(60), cpu=64000, memory=8192), workload) == 0
    assert stranded(node(s(0), s(0), cpu=0, memory=0), workload) == 0
    # a workload without GPU pods strands nothing
    assert stranded(node(s(100), cpu=0), Workload.of([Task(cpu_milli=8000, gpus=0)])) == 0


# --------------------------------------------------------------------------- the GPU choice


def test_choose_gpu_avoids_the_gpu_where_the_pod_would_leave_an_unusable_sliver() -> None:
    # GPU 0 has 40 used, GPU 1 is empty; the node has seen only 50 % pods.
    usage = {0: s(40), 1: s(0)}
    fifties = Workload.of([Task(share=s(50))])
    # best fit puts the 50 beside the 40, leaving 10 no 50 can use (gradient +10);
    # on GPU 1 it leaves 60 and 50, both still usable (gradient 0)
    assert choose_gpu(usage, s(50)) == 0
    assert choose_gpu(usage, s(50), workload=fifties) == 1
    # with 60 % pods seen too, GPU 1 would leave 50 that the 60s cannot use
    # (expected 25) against 10 on GPU 0 (expected 10): GPU 0
    mixed = Workload.of([Task(share=s(50)), Task(share=s(60))])
    assert choose_gpu(usage, s(50), workload=mixed) == 0
    # a 60 fills GPU 0 exactly: no sliver, and it is the fullest
    assert choose_gpu(usage, s(60), workload=mixed) == 0


usages = st.dictionaries(
    st.integers(min_value=0, max_value=15),
    st.builds(Share, core=st.integers(0, 100), memory=st.integers(0, 100)),
    min_size=1,
    max_size=16,
)
wants = st.builds(Share, core=st.integers(1, 100), memory=st.integers(1, 100))
workloads = st.lists(wants, max_size=12).map(
    lambda shares: Workload.of(Task(share=share) for share in shares)
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(usage=usages, want=wants, workload=workloads, exclude=st.none() | st.integers(0, 15))
def test_choose_gpu_only_picks_a_gpu_where_the_limits_fit(
    usage: GpuUsage, want: Share, workload: Workload, exclude: int | None
) -> None:
    chosen = choose_gpu(usage, want, exclude=exclude, workload=workload)
    fitting = [g for g in usage if g != exclude and fits(usage[g], want)]
    if chosen is None:
        assert fitting == []
    else:
        assert chosen in fitting


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    gpus=st.integers(1, 8),
    pods=st.lists(wants, min_size=1, max_size=40),
    seen=st.booleans(),
)
def test_placing_pods_one_by_one_never_takes_a_gpu_past_100(
    gpus: int, pods: list[Share], seen: bool
) -> None:
    usage: GpuUsage = {index: s(0) for index in range(gpus)}
    workload = Workload.of(Task(share=want) for want in pods) if seen else None
    for want in pods:
        chosen = choose_gpu(usage, want, workload=workload)
        if chosen is not None:
            usage[chosen] = add(usage[chosen], want)
    for used in usage.values():
        assert used.core <= 100 and used.memory <= 100


# --------------------------------------------------------------------------- the definition


free_gpus = st.lists(
    st.builds(Share, core=st.integers(0, 100), memory=st.integers(0, 100)), min_size=1, max_size=8
)
tasks = st.one_of(
    st.builds(
        Task,
        cpu_milli=st.integers(0, 16000),
        memory_mib=st.integers(0, 16384),
        gpus=st.just(1),
        share=wants,
    ),
    st.builds(
        Task,
        cpu_milli=st.integers(0, 16000),
        memory_mib=st.integers(0, 16384),
        gpus=st.integers(0, 4),
    ),
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    gpus=free_gpus,
    cpu=st.integers(0, 16000),
    memory=st.integers(0, 16384),
    weighted=st.dictionaries(tasks, st.integers(1, 5), min_size=1, max_size=10),
)
def test_fragmentation_is_the_weighted_mean_of_the_task_fragments(
    gpus: list[Share], cpu: int, memory: int, weighted: dict[Task, int]
) -> None:
    # the grouped computation against the definition, task by task
    free = NodeFree(cpu_milli=cpu, memory_mib=memory, gpus=tuple(gpus))
    workload = Workload.of(weighted)
    total = sum(weighted.values())
    expected = sum(n * task_fragment(free, task) for task, n in weighted.items()) / total
    assert fragmentation(free, workload) == pytest.approx(expected)
