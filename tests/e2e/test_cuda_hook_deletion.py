"""A deleted pod whose own processes hold its GPU through the CUDA hook keeps its slot until
those processes are gone: the executor ends them (SIGTERM, SIGKILL after the grace period) and
only then records Released, so the next pod's cuInit gets the GPU no earlier.

Real parts: nats-server and the four services as processes, real C programs under the real
hook against the fake driver. The holder ignores SIGTERM, so only the executor's SIGKILL after
the one-second grace period ends it: a slot freed at the deletion would hand the GPU to the
waiter while the holder still runs. The deletion is the policy's RemovePod, decided here
against the stack's log (local mode has no API server to delete the pod from).
"""

from __future__ import annotations

import signal
from pathlib import Path

from cuda_hook_harness import start_hooked, visible_devices_at_init
from stack_harness import envelopes, of_type, read_log, running_stack, wait_for_log

from gpupool.core import RemovePod
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.events import Assigned, PodRef, PodRemoved, Released
from gpupool.runtime.decider import DeciderLoop

NODE = "node-1"
GPU = "GPU-SIMULATED-node-1-0"
CLUSTER = """
nodes:
  - name: node-1
    gpus: 1
    qos: '{"preemptEnabled": true, "preemptGracePeriodSeconds": 1}'
pods:
  - {name: holder, node: node-1, requests: {core: 25, memory: 25}, limits: {core: 100, memory: 100}}
  - {name: next, node: node-1, requests: {core: 25, memory: 25}, limits: {core: 100, memory: 100}}
"""


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie not yet reaped has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


async def test_a_deleted_hooked_pod_keeps_its_gpu_until_its_processes_are_gone(
    tmp_path: Path,
) -> None:
    driver_log = tmp_path / "driver.log"
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=1) as stack:
        socket = stack.socket_path
        holder = await start_hooked(
            socket, "holder", ["init", "wait"], driver_log=driver_log, preexec_fn=ignore_sigterm
        )
        await holder.until_stdout("cuInit 0")
        waiter = await start_hooked(socket, "next", ["init", "wait"], driver_log=driver_log)
        await waiter.until(lambda: bool(waiter.waiting()), "next's waiting line")

        log = await JetStreamEventLog.connect(stack.nats_url)
        try:
            policy = DeciderLoop(log, service="policy")
            await policy.rebuild()
            await policy.execute(
                RemovePod(pod=PodRef(namespace="default", name="holder"), node=NODE), node=NODE
            )
        finally:
            await log.close()

        await waiter.until_stdout("cuInit 0")
        # the waiter reached the GPU only after the holder was gone
        assert not alive(holder.pid), "the GPU was handed on while the deleted pod's process ran"
        assert await holder.exit_code() == -signal.SIGKILL  # SIGTERM ignored: killed after grace
        await waiter.go_on()
        assert await waiter.exit_code() == 0
        await wait_for_log(stack, lambda log: len(of_type(log, Released)) >= 2)
        entries = envelopes(await read_log(stack))

    kinds = [
        (type(e.event).__name__, e.event.pod.name)
        for e in entries
        if isinstance(e.event, Assigned | Released | PodRemoved)
    ]
    assert kinds == [
        ("Assigned", "holder"),
        ("PodRemoved", "holder"),
        ("Released", "holder"),
        ("Assigned", "next"),
        ("Released", "next"),
    ]
    assert [e.event.reason for e in of_type(entries, Released, "holder")] == ["cancelled"]
    assert visible_devices_at_init(driver_log, waiter.pid) == [GPU]
