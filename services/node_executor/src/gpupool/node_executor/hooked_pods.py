"""Pods whose own processes ask for the GPU through the CUDA hook (Kubernetes mode).

A process's hook connects from inside its first ``cuInit`` (an :class:`AttachRequest`). The
executor identifies it by the kernel (``SO_PEERCRED`` → cgroup → pod UID in ``--identity
kernel``), opens a pidfd on it and keeps, per pod, the processes that registered. One task per
pod follows it through the log:

* a process of a **dormant** pod attaches: RequestGpu → PodReady (or PodRejected, answered as
  Rejected: the hook's ``cuInit`` fails with the core's reason);
* while the pod is **ready**, every waiting process is told its true wait and position each
  period; when every waiter has gone (hung up or exited) the pod leaves the queue
  (Released(cancelled));
* **Assigned**: every waiter gets :class:`Granted` (its GPU's UUID, the pod's memory limit and
  the pod's shared memory counter) and becomes a registered process; further processes of the
  running pod join at once;
* the **last registered process ends** (its pidfd): Released(completed). These processes are
  not the executor's children, so their exit status is not the kernel's to tell: completed;
* **Preempted**: SIGTERM to the registered processes only (through their pidfds), SIGKILL
  after the grace period, confirmed gone, then Released(preempted). The pod's other processes
  (a notebook server, a shell) live on; the pod is dormant and its next ``cuInit`` queues again;
* the pod is deleted (PodRemoved): its registered processes are ended the same way;
* the memory guard finds the pod over its limit (memory the hook cannot see): its registered
  processes are ended and the pod released as out-of-memory.

With a records directory, the registered processes of each running pod are recorded on disk
(pid and start time); an executor that crashed or restarted finds them again there and in the
kernel (the pid still names the same process), keeps following them, and releases the pod only
when they are gone. A pod running in the log with none of its processes left is released as
completed; recorded processes of a pod that no longer runs in the log are ended (fail closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import select
import signal
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from gpupool.core import PodState
from gpupool.events import GpuInfo, PodRef, ReleaseReason
from gpupool.node_executor.environment import memory_limit_bytes, memory_limit_mib
from gpupool.node_executor.peer_identity import IdentityMode, IdentityRefused, pod_of_peer
from gpupool.node_executor.processes import pidfd_exited, process_start_ticks
from gpupool.node_executor.workload_socket import Channel
from gpupool.workload import AttachRequest, Granted, Rejected, Waiting
from gpupool.workload import Preempted as PreemptedNotice

log = logging.getLogger(__name__)

DEFAULT_KILL_CONFIRM_SECONDS = 5.0
_NO_POD = PodRef(namespace="", name="")
"""Stands for "the pod the caller's cgroup names" when it names none we know."""
COUNTER = struct.Struct("=Q")
"""The pod's memory counter: one native unsigned 64-bit integer, as the hook's C struct."""


class RecordedProcess(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    start_ticks: int
    """Field 22 of /proc/<pid>/stat: tells the process from a later one that reused its pid."""


class HookedPodRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What survives an executor restart: the pod's registered processes."""

    pod: PodRef
    processes: tuple[RecordedProcess, ...]


class RegisteredProcess:
    """A process of a pod that was granted the pod's GPU, followed through a pidfd."""

    def __init__(self, pid: int, pidfd: int, start_ticks: int | None = None) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.start_ticks = start_ticks if start_ticks is not None else process_start_ticks(pid)
        self._exit: asyncio.Task[None] | None = None

    def exited(self) -> asyncio.Task[None]:
        if self._exit is None or self._exit.cancelled():
            self._exit = asyncio.create_task(pidfd_exited(self.pidfd))
        return self._exit

    @property
    def gone(self) -> bool:
        """Its exit was seen (a watcher cancelled on the way says nothing of the process)."""
        return self._exit is not None and self._exit.done() and not self._exit.cancelled()

    def signal(self, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signum)

    async def close(self) -> None:
        """Stop watching (awaited, so the loop no longer polls the fd) and close the pidfd."""
        if self._exit is not None:
            self._exit.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._exit
        with contextlib.suppress(OSError):
            os.close(self.pidfd)


class PodMemoryCounter:
    """The memory the pod's processes hold through the hook: an anonymous shared file (memfd)."""

    def __init__(self, pod: PodRef) -> None:
        self.fd = os.memfd_create(f"gpupool-memory-{pod.namespace}.{pod.name}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, mmap.PAGESIZE)
        self._map = mmap.mmap(self.fd, mmap.PAGESIZE)

    @property
    def used_bytes(self) -> int:
        value: int = COUNTER.unpack_from(self._map, 0)[0]
        return value

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


@dataclass(eq=False)
class Waiter:
    """A process blocked in its first cuInit, on its open connection."""

    pid: int
    pidfd: int
    channel: Channel
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class HookedPod:
    pod: PodRef
    waiters: list[Waiter] = field(default_factory=list)
    processes: list[RegisteredProcess] = field(default_factory=list)
    counter: PodMemoryCounter | None = None
    change: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    out_of_memory: bool = False


class ExecutorView(Protocol):
    """What the hooked pods need of the node-executor (its log, its node, its periods)."""

    @property
    def identity(self) -> IdentityMode: ...

    def pod(self, ref: PodRef) -> PodState | None: ...

    def runs_command(self, ref: PodRef) -> bool:
        """Whether ``gpupool run`` runs a command for the pod here (then the hook may not)."""
        ...

    def pods_by_uid(self) -> dict[str, PodRef]: ...

    async def record_refusal(
        self, pod: PodRef | None, reason: str, message: str, channel: Channel | None = None
    ) -> None:
        """A refusal that is no core decision is still an event: PodRejected for a pod,
        MessageRejected when the caller could not be tied to any pod (under a flood, counted
        in the socket's summary of refusals, through ``channel``)."""
        ...

    async def request_gpu(self, pod: PodRef) -> Rejected | None:
        """RequestGpu; the core's refusal as the hook is told it, or None."""
        ...

    async def release(self, pod: PodRef, reason: ReleaseReason, exit_code: int | None) -> None: ...

    def waiting(self, state: PodState) -> Waiting: ...

    def message_period(self) -> float: ...

    def grace_seconds(self) -> float: ...

    def gpu(self, index: int) -> GpuInfo: ...


class HookedPods:
    """Every pod of this node whose processes came through the CUDA hook."""

    def __init__(
        self,
        executor: ExecutorView,
        *,
        records_dir: Path | None = None,
        kill_confirm_seconds: float = DEFAULT_KILL_CONFIRM_SECONDS,
    ) -> None:
        self._executor = executor
        self._records_dir = records_dir
        self._kill_confirm_seconds = kill_confirm_seconds
        self._pods: dict[PodRef, HookedPod] = {}
        if records_dir is not None:
            records_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ records

    def _record_path(self, pod: PodRef) -> Path | None:
        if self._records_dir is None:
            return None
        return self._records_dir / f"{pod.namespace}.{pod.name}.json"

    def _save(self, hooked: HookedPod) -> None:
        path = self._record_path(hooked.pod)
        if path is None:
            return
        live = tuple(
            RecordedProcess(pid=p.pid, start_ticks=p.start_ticks)
            for p in hooked.processes
            if p.start_ticks is not None
        )
        if not live:
            path.unlink(missing_ok=True)
            return
        temporary = path.with_suffix(".tmp")
        temporary.write_bytes(msgspec.json.encode(HookedPodRecord(pod=hooked.pod, processes=live)))
        os.replace(temporary, path)

    async def recover(self) -> set[PodRef]:
        """Take over the registered processes an earlier executor recorded; the pods it did."""
        if self._records_dir is None:
            return set()
        recovered: set[PodRef] = set()
        for path in sorted(self._records_dir.glob("*.json")):
            try:
                record = msgspec.json.decode(path.read_bytes(), type=HookedPodRecord)
            except (OSError, msgspec.DecodeError) as error:
                log.warning("node-executor: unreadable hooked-pod record %s: %s", path, error)
                path.unlink(missing_ok=True)
                continue
            processes = []
            for recorded in record.processes:
                if process_start_ticks(recorded.pid) != recorded.start_ticks:
                    continue  # gone, or its pid reused by another process
                try:
                    pidfd = os.pidfd_open(recorded.pid)
                except OSError:
                    continue
                if process_start_ticks(recorded.pid) != recorded.start_ticks:  # raced a reuse
                    os.close(pidfd)
                    continue
                processes.append(RegisteredProcess(recorded.pid, pidfd, recorded.start_ticks))
            hooked = HookedPod(pod=record.pod, processes=processes)
            state = self._executor.pod(record.pod)
            if state is None or state.phase != "running":
                if processes:
                    log.warning(
                        "node-executor: %s does not run in the log; ending its GPU processes %s",
                        record.pod,
                        [p.pid for p in processes],
                    )
                    await self._terminate(hooked)
                for process in hooked.processes:
                    await process.close()
                path.unlink(missing_ok=True)
                continue
            log.info(
                "node-executor: following %s's GPU processes %s again",
                record.pod,
                [p.pid for p in processes],
            )
            self._pods[record.pod] = hooked
            hooked.task = asyncio.create_task(self._follow(hooked), name=f"hooked-{record.pod}")
            recovered.add(record.pod)
        return recovered

    def __contains__(self, pod: PodRef) -> bool:
        return pod in self._pods

    def wake(self, pods: Iterable[PodRef] | None = None) -> None:
        """Something happened on the node: these pods re-read their state (None: every pod,
        for an event that names none; ``pods_touched``)."""
        if pods is None:
            for hooked in self._pods.values():
                hooked.change.set()
            return
        for pod in pods:
            named = self._pods.get(pod)
            if named is not None:
                named.change.set()

    def processes(self) -> dict[PodRef, list[int]]:
        """The live registered processes of each pod (memory guard, metrics)."""
        return {
            pod: [p.pid for p in hooked.processes if not p.gone]
            for pod, hooked in self._pods.items()
            if hooked.processes
        }

    def memory_used_bytes(self, pod: PodRef) -> int | None:
        hooked = self._pods.get(pod)
        return None if hooked is None or hooked.counter is None else hooked.counter.used_bytes

    async def out_of_memory(self, pod: PodRef) -> bool:
        """The memory guard found ``pod`` over its limit: end its registered processes."""
        hooked = self._pods.get(pod)
        if hooked is None or not hooked.processes:
            return False
        hooked.out_of_memory = True
        await self._terminate(hooked)
        hooked.change.set()
        return True

    async def close(self) -> None:
        for hooked in list(self._pods.values()):
            if hooked.task is not None:
                hooked.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await hooked.task

    # ------------------------------------------------------------------ a process attaches

    async def attach(self, request: AttachRequest, channel: Channel) -> None:
        executor = self._executor
        peer = channel.peer
        pods_by_uid = executor.pods_by_uid()
        claimed = request.pod
        if claimed is None:
            if executor.identity == "request":
                await channel.send(
                    Rejected(
                        reason="NoPodNamed",
                        message="the process names no pod: set GPUPOOL_POD_NAMESPACE and "
                        "GPUPOOL_POD_NAME (only the kernel can tell the pod in Kubernetes mode)",
                    )
                )
                return
            claimed = pods_by_uid.get(peer.pod_uid or "")
        identity = (
            pod_of_peer(executor.identity, claimed, peer, pods_by_uid)
            if claimed is not None
            else pod_of_peer(executor.identity, _NO_POD, peer, {})  # the kernel's refusal
        )
        if isinstance(identity, IdentityRefused):
            await executor.record_refusal(claimed, identity.reason, identity.message, channel)
            await channel.send(Rejected(reason=identity.reason, message=identity.message))
            return
        pod = identity
        state = executor.pod(pod)
        if state is None:  # the core's word (and its PodRejected event): not registered
            rejected = await executor.request_gpu(pod)
            await channel.send(
                rejected
                or Rejected(reason="UnknownPod", message=f"pod {pod} is not registered here")
            )
            return
        if state.policy != "share-pool":
            message = f"pod {pod} has policy {state.policy}, not share-pool: its GPU is not shared"
            await executor.record_refusal(pod, "NotSharePool", message, channel)
            await channel.send(Rejected(reason="NotSharePool", message=message))
            return
        if executor.runs_command(pod):
            await channel.send(
                Rejected(
                    reason="AlreadyAttached",
                    message=f"pod {pod} runs a command through `gpupool run` on this node",
                )
            )
            return
        try:
            pidfd = os.pidfd_open(peer.pid)
        except OSError as error:
            await channel.send(
                Rejected(reason="ProcessGone", message=f"cannot follow pid {peer.pid}: {error}")
            )
            return
        waiter = Waiter(pid=peer.pid, pidfd=pidfd, channel=channel)
        hooked = self._pods.get(pod)
        if hooked is None:
            hooked = HookedPod(pod=pod)
            self._pods[pod] = hooked
            hooked.task = asyncio.create_task(self._follow(hooked), name=f"hooked-{pod}")
        hooked.waiters.append(waiter)
        hooked.change.set()
        log.info("node-executor: pid %d of %s asks for its GPU", peer.pid, pod)
        # the connection stays open while the process waits; afterwards it is followed by pidfd
        await waiter.done.wait()

    # ------------------------------------------------------------------ a pod's life

    async def _follow(self, hooked: HookedPod) -> None:
        try:
            while await self._step(hooked):
                pass
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.exception("node-executor: hooked pod %s failed", hooked.pod)
            for waiter in list(hooked.waiters):
                await self._refuse(
                    hooked, waiter, Rejected(reason="internal-error", message=str(error))
                )
        finally:
            for waiter in hooked.waiters:
                waiter.done.set()
                with contextlib.suppress(OSError):
                    os.close(waiter.pidfd)
            for process in hooked.processes:
                await process.close()
            if hooked.counter is not None:
                hooked.counter.close()
            if self._pods.get(hooked.pod) is hooked:
                del self._pods[hooked.pod]

    async def _refuse(self, hooked: HookedPod, waiter: Waiter, message: Rejected) -> None:
        await waiter.channel.send(message)
        self._drop_waiter(hooked, waiter)

    def _drop_waiter(self, hooked: HookedPod, waiter: Waiter) -> None:
        if waiter in hooked.waiters:
            hooked.waiters.remove(waiter)
            with contextlib.suppress(OSError):
                os.close(waiter.pidfd)
        waiter.done.set()

    async def _drop_departed(self, hooked: HookedPod) -> None:
        """Waiters that hung up or exited leave; registered processes that exited are closed."""
        for waiter in list(hooked.waiters):
            if waiter.channel.client_gone or _has_exited(waiter.pidfd):
                log.info("node-executor: waiting pid %d of %s left", waiter.pid, hooked.pod)
                self._drop_waiter(hooked, waiter)
        for process in list(hooked.processes):
            if process.gone or _has_exited(process.pidfd):
                log.info("node-executor: GPU process %d of %s ended", process.pid, hooked.pod)
                hooked.processes.remove(process)
                await process.close()

    async def _step(self, hooked: HookedPod) -> bool:
        executor = self._executor
        hooked.change.clear()
        await self._drop_departed(hooked)
        state = executor.pod(hooked.pod)
        if (
            state is None or state.removed
        ):  # PodRemoved: it keeps its slot until its end is recorded
            if hooked.processes:
                await self._terminate(hooked)
            for waiter in list(hooked.waiters):
                await self._refuse(
                    hooked,
                    waiter,
                    Rejected(reason="UnknownPod", message=f"pod {hooked.pod} was removed"),
                )
            if state is not None and state.phase == "running":
                log.info("node-executor: %s was deleted; its GPU processes ended", hooked.pod)
                await executor.release(hooked.pod, "cancelled", None)
            return False
        if state.phase == "dormant":
            self._end_counter(hooked)
            if not hooked.waiters:
                if not hooked.processes:
                    return False  # nobody waits, nothing runs: nothing more to do here
                await self._wait_for_change(hooked, None)  # survivors of SIGKILL, stuck
                return True
            rejected = await executor.request_gpu(hooked.pod)
            if rejected is not None:
                for waiter in list(hooked.waiters):
                    await self._refuse(hooked, waiter, rejected)
                return False
            return True
        if state.phase == "ready":
            return await self._wait(hooked)
        return await self._run(hooked, state)

    async def _wait(self, hooked: HookedPod) -> bool:
        """Tell every waiter its true wait and position each period, until the pod runs."""
        executor = self._executor
        loop = asyncio.get_running_loop()
        next_message = loop.time() + executor.message_period()
        while (state := executor.pod(hooked.pod)) is not None and state.phase == "ready":
            await self._drop_departed(hooked)
            if not hooked.waiters:
                log.info(
                    "node-executor: nobody of %s waits any more; it leaves the queue", hooked.pod
                )
                await executor.release(hooked.pod, "cancelled", None)
                return True
            if loop.time() >= next_message:
                message = executor.waiting(state)
                for waiter in list(hooked.waiters):
                    await waiter.channel.send(message)
                next_message = loop.time() + executor.message_period()
            await self._wait_for_change(hooked, max(0.0, next_message - loop.time()))
        return True

    async def _wait_for_change(self, hooked: HookedPod, within: float | None) -> None:
        """Until the log changes, a waiter leaves or a registered process exits (or ``within``)."""
        watched: list[asyncio.Task[Any]] = [asyncio.create_task(hooked.change.wait())]
        watched += [asyncio.create_task(w.channel.wait_client_gone()) for w in hooked.waiters]
        watched += [asyncio.create_task(pidfd_exited(w.pidfd)) for w in hooked.waiters]
        exits: list[asyncio.Task[Any]] = [p.exited() for p in hooked.processes]
        try:
            await asyncio.wait(
                [*watched, *exits], timeout=within, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for future in watched:
                future.cancel()
            # awaited, so that no cancelled watcher still polls a pidfd
            await asyncio.gather(*watched, return_exceptions=True)
        hooked.change.clear()

    async def _run(self, hooked: HookedPod, state: PodState) -> bool:
        """The pod runs: grant its waiters, follow its processes, end them when preempted."""
        executor = self._executor
        assert state.gpu_index is not None
        if state.evicted_by is not None:
            return await self._preempt(hooked, state)
        if hooked.out_of_memory and not hooked.processes:
            hooked.out_of_memory = False
            await executor.release(hooked.pod, "out-of-memory", None)
            return True
        if hooked.waiters:
            gpu = executor.gpu(state.gpu_index)
            uuid = gpu.uuid
            if hooked.counter is None:
                hooked.counter = PodMemoryCounter(hooked.pod)
            granted = Granted(
                gpu_index=state.gpu_index,
                gpu_uuid=uuid,
                memory_limit_bytes=memory_limit_bytes(gpu, state.limits),
                core_percentage=state.limits.core,
                mps_pinned_device_mem_limit=f"0={memory_limit_mib(gpu, state.limits)}M",
            )
            for waiter in list(hooked.waiters):
                hooked.waiters.remove(waiter)
                # recorded before it is told: a crash right after the grant must find it
                process = RegisteredProcess(waiter.pid, waiter.pidfd)
                hooked.processes.append(process)
                self._save(hooked)
                if await waiter.channel.send_granted(granted, hooked.counter.fd):
                    log.info(
                        "node-executor: pid %d of %s runs on GPU %d (%s)",
                        waiter.pid,
                        hooked.pod,
                        state.gpu_index,
                        uuid,
                    )
                else:
                    hooked.processes.remove(process)
                    self._save(hooked)
                    await process.close()
                waiter.done.set()
        await self._drop_departed(hooked)
        self._save(hooked)
        if not hooked.processes:
            log.info("node-executor: the last GPU process of %s is gone; releasing", hooked.pod)
            await executor.release(hooked.pod, "completed", None)
            return True
        await self._wait_for_change(hooked, None)
        return True

    async def _preempt(self, hooked: HookedPod, state: PodState) -> bool:
        assert state.evicted_by is not None and state.gpu_index is not None
        notice = PreemptedNotice(by=state.evicted_by.name, gpu_index=state.gpu_index)
        for waiter in hooked.waiters:  # waiters of the pod stay: they queue again once dormant
            await waiter.channel.send(notice)
        survivors = await self._terminate(hooked)
        if survivors:
            log.error("node-executor: %s: processes survived SIGKILL: %s", hooked.pod, survivors)
        log.info("node-executor: %s preempted by %s", hooked.pod, state.evicted_by)
        await self._executor.release(hooked.pod, "preempted", None)
        return True

    async def _terminate(self, hooked: HookedPod) -> list[int]:
        """SIGTERM the registered processes, SIGKILL after the grace period; the survivors."""
        processes = [p for p in hooked.processes if not p.gone]
        for process in processes:
            process.signal(signal.SIGTERM)
        survivors = await _wait_gone(processes, self._executor.grace_seconds())
        if survivors:
            for process in survivors:
                process.signal(signal.SIGKILL)
            survivors = await _wait_gone(survivors, self._kill_confirm_seconds)
        for process in hooked.processes:
            if process not in survivors:
                await process.close()
        hooked.processes = list(survivors)
        self._save(hooked)
        self._end_counter(hooked)
        return [p.pid for p in survivors]

    def _end_counter(self, hooked: HookedPod) -> None:
        if hooked.counter is not None and not hooked.processes:
            hooked.counter.close()
            hooked.counter = None


def _has_exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


async def _wait_gone(processes: list[RegisteredProcess], within: float) -> list[RegisteredProcess]:
    if not processes:
        return []
    # asyncio.wait, not a timeout around gather: on expiry gather would cancel the processes'
    # exit watchers, and a cancelled watcher is done, so a survivor would pass for gone
    await asyncio.wait([p.exited() for p in processes], timeout=within)
    return [p for p in processes if not p.gone]
