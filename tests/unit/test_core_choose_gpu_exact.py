"""choose_gpu's gradients, computed by moving one GPU's terms, are fragmentation()'s own floats.

``choose_gpu`` no longer measures the whole node once per candidate GPU: the per-group
fragments are integers, so the node after a placement is the node before with one GPU's
terms moved (``expected_fragment_after``), and ``expected_fragment`` adds the same products in the
same order as ``fragmentation``. On seeded random nodes and workloads (1-GPU shares,
whole multi-GPU tasks, CPU-only tasks, CPU and memory asks) the pieces equal
``fragmentation`` bit for bit, and ``choose_gpu`` picks what the measure-the-whole-node
definition below picks, GPU for GPU.
"""

from __future__ import annotations

import random

import pytest

from gpupool.core.fragmentation import (
    NodeFree,
    Task,
    Workload,
    expected_fragment,
    expected_fragment_after,
    fragmentation,
    group_fragments,
    place,
)
from gpupool.core.placement import UNBOUNDED, WHOLE_GPU, choose_gpu, fits, subtract
from gpupool.events import Share


def reference_choose_gpu(
    usage: dict[int, Share], want: Share, *, exclude: int | None, workload: Workload | None
) -> int | None:
    """The definition: each candidate's gradient from two whole fragmentation() measures."""
    candidates = [index for index in sorted(usage) if index != exclude and fits(usage[index], want)]
    if not candidates:
        return None
    if not workload:
        return min(
            candidates, key=lambda index: (-(usage[index].core + usage[index].memory), index)
        )
    order = sorted(usage)
    free = tuple(subtract(WHOLE_GPU, usage[index]) for index in order)
    node = NodeFree(cpu_milli=UNBOUNDED, memory_mib=UNBOUNDED, gpus=free)
    before = fragmentation(node, workload)

    def key(index: int) -> tuple[float, int, int]:
        used = usage[index]
        task = Task(gpus=1, share=want)
        after = place(node, task, [order.index(index)])
        gradient = round(fragmentation(after, workload) - before, 9)
        return (gradient, -(used.core + used.memory), index)

    return min(candidates, key=key)


def random_share(rng: random.Random) -> Share:
    core = rng.choice([0, 5, 10, 20, 25, 30, 33, 40, 50, 60, 75, 100])
    memory = rng.choice([core, rng.randint(0, 100)])
    return Share(core=core, memory=memory)


def random_workload(rng: random.Random) -> Workload:
    tasks: dict[Task, float] = {}
    for _ in range(rng.randint(1, 9)):
        gpus = rng.choice([0, 1, 1, 1, 1, 2, 4])
        share = random_share(rng) if gpus == 1 else Share(core=100, memory=100)
        task = Task(
            gpus=gpus,
            share=share,
            cpu_milli=rng.choice([0, 0, 500, 4000, 64000]),
            memory_mib=rng.choice([0, 0, 1024, 262144]),
        )
        tasks[task] = tasks.get(task, 0.0) + rng.choice([1, 1, 2, 3, 7, 0.5])
    return Workload.of(tasks)


def random_usage(rng: random.Random) -> dict[int, Share]:
    gpus = rng.choice([1, 2, 4, 8, 16])
    usage = {}
    for index in rng.sample(range(gpus + 3), gpus):  # indexes need not be 0..n-1
        used = rng.choice([0, 0, 10, 25, 40, 50, 60, 75, 90, 100])
        usage[index] = Share(core=used, memory=rng.choice([used, rng.randint(0, 100)]))
    return usage


@pytest.mark.parametrize("seed", range(40))
def test_the_fragments_weighed_before_and_after_a_placement_are_fragmentations_floats(
    seed: int,
) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        workload = random_workload(rng)
        free = [subtract(WHOLE_GPU, used) for used in random_usage(rng).values()]
        cpu = rng.choice([UNBOUNDED, 0, 1000, 64000, 200000])
        memory = rng.choice([UNBOUNDED, 0, 2048, 300000])
        node = NodeFree(cpu_milli=cpu, memory_mib=memory, gpus=tuple(free))
        parts = group_fragments(free, workload)
        assert expected_fragment(parts, workload, cpu, memory) == fragmentation(node, workload)
        gpu = rng.randrange(len(free))
        want = random_share(rng)
        after = place(node, Task(gpus=1, share=want), [gpu])
        moved = expected_fragment_after(parts, workload, free[gpu], want, cpu, memory)
        assert moved == fragmentation(after, workload)


@pytest.mark.parametrize("seed", range(40))
def test_choose_gpu_picks_what_measuring_the_whole_node_picks(seed: int) -> None:
    rng = random.Random(1000 + seed)
    chosen = 0
    for _ in range(100):
        usage = random_usage(rng)
        want = random_share(rng)
        workload = rng.choice([None, Workload(), random_workload(rng), random_workload(rng)])
        exclude = rng.choice([None, None, *usage])
        expected = reference_choose_gpu(usage, want, exclude=exclude, workload=workload)
        assert choose_gpu(usage, want, exclude=exclude, workload=workload) == expected
        chosen += expected is not None
    assert chosen > 20  # the random nodes leave room often enough to compare choices


@pytest.mark.parametrize("seed", range(20))
def test_a_workload_of_shares_equals_the_general_one_field_for_field(seed: int) -> None:
    rng = random.Random(2000 + seed)
    for _ in range(50):
        shares = {random_share(rng): rng.randint(1, 40) for _ in range(rng.randint(0, 12))}
        general = Workload.of({Task(gpus=1, share=share): n for share, n in shares.items()})
        assert Workload.of_shares(shares.items()) == general
        assert Workload.of_shares(shares.items()).groups == general.groups
