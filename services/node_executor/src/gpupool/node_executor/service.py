"""The node-executor service: the only part of gpupool that touches processes and GPUs.

It publishes the node's GPU inventory, serves workloads on a Unix socket, and
turns the log's decisions into actions on real processes:

* a workload connects (``gpupool run``): RequestGpu → PodReady (or PodRejected,
  answered as Rejected); while the pod waits, the true seconds waited (from the
  log's PodReady time) and its position are sent every period;
* Assigned for it: the command starts with its one GPU and its limits;
* the command exits: ReportRelease → Released(completed | failed, exit code);
* Preempted for it: SIGTERM to the process group, SIGKILL after the grace
  period, the group confirmed gone, then Released(preempted); the client is told
  who preempted it and either exits or, with ``--requeue``, queues again;
* the client hangs up: Released(cancelled) (the command is ended if it runs);
* the pod is deleted (PodRemoved): the command is ended;
* with NVML, a pod whose processes hold more GPU memory than its limit is ended
  and released as out-of-memory.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack, suppress
from pathlib import Path

from gpupool.core import (
    PodState,
    ReportInventory,
    ReportRelease,
    RequestGpu,
    queue_positions,
)
from gpupool.eventlog.port import StoredEvent
from gpupool.events import (
    PodRef,
    PodRejected,
    Preempted,
    ReleaseReason,
    event_pod,
)
from gpupool.gpus import GpuSampler, Inventory
from gpupool.node_executor.environment import memory_limit_bytes, workload_environment
from gpupool.node_executor.memory_guard import GuardedWorkload, MemoryOverrun, guard_memory
from gpupool.node_executor.processes import (
    ProcessSupervisor,
    Workload,
    WorkloadStartFailed,
    group_members,
)
from gpupool.node_executor.workload_socket import Channel, WorkloadSocketServer
from gpupool.runtime.decider import DeciderLoop
from gpupool.workload import Exited, Rejected, RunRequest, Started, StdioFds, Waiting
from gpupool.workload import Preempted as PreemptedNotice

log = logging.getLogger(__name__)

DEFAULT_MEMORY_GUARD_PERIOD_SECONDS = 1.0


class NodeExecutor:
    name = "node-executor"

    def __init__(
        self,
        *,
        node: str,
        inventory: Inventory,
        socket_path: Path,
        sampler: GpuSampler,
        supervisor: ProcessSupervisor | None = None,
        message_period_seconds: float | None = None,
        memory_guard_period_seconds: float = DEFAULT_MEMORY_GUARD_PERIOD_SECONDS,
    ) -> None:
        self.node = node
        self.inventory = inventory
        self.socket_path = socket_path
        self.sampler = sampler
        self.supervisor = supervisor if supervisor is not None else ProcessSupervisor()
        self.message_period_override = message_period_seconds
        self.memory_guard_period = memory_guard_period_seconds
        self._loop: DeciderLoop | None = None
        self._changes: dict[PodRef, asyncio.Event] = {}
        self._workloads: dict[PodRef, Workload] = {}
        self._attached: set[PodRef] = set()
        self._oom: dict[PodRef, MemoryOverrun] = {}

    # ------------------------------------------------------------------ service

    @property
    def loop(self) -> DeciderLoop:
        assert self._loop is not None, "the executor has not started"
        return self._loop

    async def start(self, loop: DeciderLoop, stack: AsyncExitStack) -> None:
        self._loop = loop
        await loop.execute(
            ReportInventory(node=self.node, gpus=self.inventory.gpus, source=self.inventory.source),
            node=self.node,
        )
        await self._release_orphans()
        server = WorkloadSocketServer(self.socket_path, self)
        await server.start()
        stack.push_async_callback(server.close)
        stop_guarding = asyncio.Event()
        guard = asyncio.create_task(
            guard_memory(
                self.sampler,
                self._guarded_workloads,
                self._on_memory_overrun,
                period_seconds=self.memory_guard_period,
                stop=stop_guarding,
            ),
            name="memory-guard",
        )

        async def stop_guard() -> None:
            stop_guarding.set()
            with suppress(asyncio.CancelledError):
                await guard

        stack.push_async_callback(stop_guard)
        stack.push_async_callback(self._end_all_workloads)

    async def react(self, entry: StoredEvent) -> None:
        event = entry.envelope.event
        if event.node != self.node:
            return
        pod = event_pod(event)
        if pod is not None:
            self._notify(pod)
        if isinstance(event, Preempted):
            self._notify(event.preemptor)
        # positions of every waiter may have changed
        for waiter in list(self._changes):
            if waiter != pod:
                self._changes[waiter].set()

    def _notify(self, pod: PodRef) -> None:
        change = self._changes.get(pod)
        if change is not None:
            change.set()

    async def _release_orphans(self) -> None:
        """Pods the log says run here, but no process of this executor runs: an earlier
        executor died with them. Their clients are gone; record them as failed."""
        for pod in self.loop.projection.state.pods_on(self.node):
            if pod.policy == "share-pool" and pod.phase in ("running", "ready"):
                reason: ReleaseReason = "failed" if pod.phase == "running" else "cancelled"
                log.warning(
                    "node-executor: %s was %s under an earlier executor; releasing (%s)",
                    pod.ref,
                    pod.phase,
                    reason,
                )
                await self._release(pod.ref, reason, None)

    async def _end_all_workloads(self) -> None:
        for pod, workload in list(self._workloads.items()):
            log.info("node-executor: stopping, ending %s", pod)
            await self.supervisor.terminate(workload, self._grace_seconds())

    # ------------------------------------------------------------------ workloads

    def _pod(self, ref: PodRef) -> PodState | None:
        return self.loop.projection.state.pods.get(ref)

    def _grace_seconds(self) -> float:
        node = self.loop.projection.state.nodes.get(self.node)
        return float(node.qos.preempt_grace_seconds) if node is not None else 10.0

    def _message_period(self) -> float:
        if self.message_period_override is not None:
            return self.message_period_override
        node = self.loop.projection.state.nodes.get(self.node)
        return float(node.qos.waiting_message_period_seconds) if node is not None else 10.0

    async def _release(self, pod: PodRef, reason: ReleaseReason, exit_code: int | None) -> None:
        await self.loop.execute(
            ReportRelease(pod=pod, node=self.node, reason=reason, exit_code=exit_code),
            node=self.node,
        )

    async def handle(self, request: RunRequest, fds: StdioFds, channel: Channel) -> None:
        pod = request.pod
        if pod in self._attached:
            await channel.send(
                Rejected(reason="AlreadyAttached", message=f"pod {pod} already has a workload here")
            )
            return
        self._attached.add(pod)
        change = self._changes.setdefault(pod, asyncio.Event())
        try:
            while True:
                outcome = await self._one_run(request, fds, channel, change)
                if outcome != "requeue":
                    return
        finally:
            self._attached.discard(pod)
            self._changes.pop(pod, None)

    async def _one_run(
        self, request: RunRequest, fds: StdioFds, channel: Channel, change: asyncio.Event
    ) -> str:
        pod = request.pod
        events = await self.loop.execute(RequestGpu(pod=pod, node=self.node), node=self.node)
        rejected = next((e for e in events if isinstance(e, PodRejected)), None)
        if rejected is not None:
            await channel.send(Rejected(reason=rejected.reason, message=rejected.message))
            return "done"
        state = self._pod(pod)
        if state is None:
            await channel.send(
                Rejected(reason="UnknownPod", message=f"pod {pod} is not registered")
            )
            return "done"
        if state.phase != "running" and not await self._wait_for_gpu(pod, channel, change):
            return "done"
        return await self._run_command(request, fds, channel, change)

    async def _wait_for_gpu(self, pod: PodRef, channel: Channel, change: asyncio.Event) -> bool:
        """Tell the client its true wait and position every period until the pod runs."""
        gone = asyncio.create_task(channel.wait_client_gone())
        try:
            loop = asyncio.get_running_loop()
            next_message = loop.time() + self._message_period()  # the first after one period
            while True:
                state = self._pod(pod)
                if state is None:
                    await channel.send(Exited(exit_code=0, reason="cancelled"))
                    return False
                if state.phase == "running":
                    return True
                if state.phase == "dormant":  # released while waiting (e.g. cancelled elsewhere)
                    await channel.send(Exited(exit_code=0, reason="cancelled"))
                    return False
                if loop.time() >= next_message:
                    await channel.send(self._waiting(state))
                    next_message = loop.time() + self._message_period()
                change.clear()
                changed = asyncio.create_task(change.wait())
                done, _ = await asyncio.wait(
                    {changed, gone},
                    timeout=max(0.0, next_message - loop.time()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                changed.cancel()
                if gone in done:
                    log.info("node-executor: client of %s left while waiting", pod)
                    current = self._pod(pod)
                    if (current is not None and current.phase == "ready") or (
                        current is not None and current.phase == "running"
                    ):
                        await self._release(pod, "cancelled", None)
                    return False
        finally:
            gone.cancel()

    def _waiting(self, state: PodState) -> Waiting:
        assert state.ready_since is not None
        seconds = int((self.loop.clock() - state.ready_since).total_seconds())
        position = queue_positions(self.loop.projection.state, self.node).get(state.ref, 0)
        return Waiting(seconds=max(0, seconds), position=position)

    async def _run_command(
        self, request: RunRequest, fds: StdioFds, channel: Channel, change: asyncio.Event
    ) -> str:
        pod = request.pod
        state = self._pod(pod)
        assert state is not None and state.gpu_index is not None
        gpu = self.inventory.by_index(state.gpu_index)
        env = workload_environment(request.env, gpu, state.limits, pod=pod)
        try:
            workload = await self.supervisor.start(
                pod,
                request.argv,
                env,
                request.cwd,
                fds,
                run_as=(channel.peer.uid, channel.peer.gid),
            )
        except WorkloadStartFailed as error:
            await self._release(pod, "failed", 127)
            await channel.send(Rejected(reason="StartFailed", message=str(error)))
            return "done"
        self._workloads[pod] = workload
        await channel.send(Started(gpu_index=gpu.index, gpu_uuid=gpu.uuid, pid=workload.pid))
        exited = asyncio.create_task(self.supervisor.wait(workload))
        gone = asyncio.create_task(channel.wait_client_gone())
        try:
            while True:
                change.clear()
                changed = asyncio.create_task(change.wait())
                done, _ = await asyncio.wait(
                    {exited, gone, changed}, return_when=asyncio.FIRST_COMPLETED
                )
                changed.cancel()
                if exited in done:
                    code = exited.result()
                    if pod in self._oom:
                        self._oom.pop(pod)
                        await self._release(pod, "out-of-memory", code)
                        await channel.send(Exited(exit_code=code, reason="out-of-memory"))
                        return "done"
                    reason: ReleaseReason = "completed" if code == 0 else "failed"
                    await self._release(pod, reason, code)
                    await channel.send(Exited(exit_code=code, reason=reason))
                    return "done"
                current = self._pod(pod)
                if current is None:  # PodRemoved
                    await self.supervisor.terminate(workload, self._grace_seconds())
                    await channel.send(Exited(exit_code=0, reason="cancelled"))
                    return "done"
                if current.evicted_by is not None:
                    return await self._preempt(request, workload, channel, current)
                if gone in done:
                    log.info("node-executor: client of %s left; ending its command", pod)
                    termination = await self.supervisor.terminate(workload, self._grace_seconds())
                    await self._release(pod, "cancelled", termination.exit_code)
                    return "done"
        finally:
            self._workloads.pop(pod, None)
            exited.cancel()
            gone.cancel()

    async def _preempt(
        self, request: RunRequest, workload: Workload, channel: Channel, state: PodState
    ) -> str:
        assert state.evicted_by is not None and state.gpu_index is not None
        by = state.evicted_by
        gpu_index = state.gpu_index
        termination = await self.supervisor.terminate(workload, self._grace_seconds())
        if not termination.confirmed:
            log.error(
                "node-executor: %s survivors after SIGKILL: %s", state.ref, termination.survivors
            )
        log.info(
            "node-executor: %s preempted by %s, ended by %s", state.ref, by, termination.ended_by
        )
        await self._release(state.ref, "preempted", termination.exit_code)
        await channel.send(PreemptedNotice(by=by.name, gpu_index=gpu_index))
        if request.requeue and not channel.client_gone:
            return "requeue"
        await channel.send(Exited(exit_code=termination.exit_code, reason="preempted"))
        return "done"

    # ------------------------------------------------------------------ memory guard

    def _guarded_workloads(self) -> list[GuardedWorkload]:
        guarded = []
        for pod, workload in self._workloads.items():
            state = self._pod(pod)
            if state is None or state.gpu_index is None:
                continue
            gpu = self.inventory.by_index(state.gpu_index)
            guarded.append(
                GuardedWorkload(
                    pod=pod,
                    gpu_uuid=gpu.uuid,
                    memory_limit_bytes=memory_limit_bytes(gpu, state.limits),
                    pids=frozenset(group_members(workload.pid)),
                )
            )
        return guarded

    async def _on_memory_overrun(self, overrun: MemoryOverrun) -> None:
        workload = self._workloads.get(overrun.pod)
        if workload is None:
            return
        log.warning(
            "node-executor: %s holds %d bytes on %s, over its limit of %d: ending it (out-of-memory)",
            overrun.pod,
            overrun.used_bytes,
            overrun.gpu_uuid,
            overrun.limit_bytes,
        )
        self._oom[overrun.pod] = overrun
        await self.supervisor.terminate(workload, 0)
