"""The node-executor service: the only part of gpupool that touches processes and GPUs.

It publishes the node's GPU inventory, serves workloads on a Unix socket, and
turns the log's decisions into actions on real processes. One *session* per pod
on this node follows the pod through its life here:

* a workload connects (``gpupool run``): RequestGpu → PodReady (or PodRejected,
  answered as Rejected); while the pod waits, the true seconds waited (from the
  log's PodReady time) and its position are sent every period;
* Assigned for it: the command starts (through the shim) with its one GPU and
  its limits;
* the command exits: ReportRelease → Released(completed | failed, exit code);
* Preempted for it: SIGTERM to the process group, SIGKILL after the grace
  period, the group confirmed gone, then Released(preempted); the client is told
  who preempted it and either exits or, with ``--requeue``, queues again;
* the client hangs up: Released(cancelled) (the command is ended if it runs);
* the pod is deleted (PodRemoved): the command is ended, then Released is
  recorded; until then the pod keeps its slot (releasing), so no other pod gets
  a GPU its processes may still use;
* with NVML, a pod whose processes hold more GPU memory than its limit is ended
  and released as out-of-memory.

Pods whose own processes come through the CUDA hook (an AttachRequest on the same
socket, Kubernetes mode) are followed by :mod:`gpupool.node_executor.hooked_pods`:
there the executor starts nothing, it grants the pod's GPU to the processes that ask
and ends only those when the pod is preempted.

A crash of the executor loses nothing: sessions live in the log and the
workload records; a restarted executor adopts running commands (their shims
keep them alive and record their exit status), keeps waiting pods in place for
``reattach_seconds`` while their clients reconnect, and releases what nobody
comes back for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Collection
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType

import msgspec

from gpupool.core import (
    Command,
    PodState,
    ReportInventory,
    ReportRelease,
    RequestGpu,
    pods_touched,
    queue_positions,
)
from gpupool.eventlog.port import REJECTED_PAYLOAD_LIMIT, StoredEvent
from gpupool.events import (
    Envelope,
    Event,
    GpuInfo,
    MessageRejected,
    PodRef,
    PodRejected,
    PodRemoved,
    ReleaseReason,
)
from gpupool.gpus import GpuSampler, Inventory
from gpupool.node_executor.environment import memory_limit_bytes, workload_environment
from gpupool.node_executor.hooked_pods import HookedPods
from gpupool.node_executor.memory_guard import GuardedWorkload, MemoryOverrun, guard_memory
from gpupool.node_executor.outcomes import OutcomeBook
from gpupool.node_executor.peer_identity import (
    IdentityMode,
    IdentityRefused,
    PeerIdentity,
    pod_of_peer,
)
from gpupool.node_executor.pod_owners import PodOwners
from gpupool.node_executor.processes import (
    ProcessSupervisor,
    Termination,
    Workload,
    WorkloadStartFailed,
    credentials_of,
    group_members,
    leader_exited,
    process_groups,
)
from gpupool.node_executor.socket_refusals import RefusalSummary
from gpupool.node_executor.workload_socket import Channel, SocketLimits, WorkloadSocketServer
from gpupool.runtime.decider import DeciderLoop
from gpupool.workload import (
    AttachRequest,
    ExecutorMessage,
    Exited,
    Rejected,
    RunRequest,
    Started,
    StdioFds,
    Waiting,
)
from gpupool.workload import Preempted as PreemptedNotice

log = logging.getLogger(__name__)

DEFAULT_MEMORY_GUARD_PERIOD_SECONDS = 1.0
DEFAULT_REATTACH_SECONDS = 60.0
"""How long a restarted executor keeps a pod's place for its client to reconnect."""
MAX_KEPT_OUTCOMES = 1024
"""Last words kept for clients that may still reattach; the oldest are forgotten first."""
RECORD_RETRY_FIRST_SECONDS = 0.1
RECORD_RETRY_MAX_SECONDS = 2.0
"""Back-off between attempts to record an event while the log cannot be reached."""
REFUSAL_RECORD_SECONDS = 30.0
"""How long recording a refusal is retried while the log cannot be reached."""
STOP_RECORD_SECONDS = 15.0
"""On a graceful stop, how long recording the sessions' ends keeps being retried."""


@dataclass(eq=False)
class PodSession:
    """One pod's life on this node; outlives connections (clients may reconnect)."""

    pod: PodRef
    request: RunRequest | None = None
    channel: Channel | None = None
    fds: StdioFds | None = None
    workload: Workload | None = None
    change: asyncio.Event = field(default_factory=asyncio.Event)
    attached: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    @property
    def client_left(self) -> bool:
        """The client connected and then went away (not: has not reconnected yet)."""
        return self.channel is not None and self.channel.client_gone

    last_word: ExecutorMessage | None = None

    @property
    def finished_word(self) -> bool:
        """Whether its last word (Exited or Rejected) was said."""
        return self.last_word is not None

    async def send(self, message: ExecutorMessage) -> None:
        if isinstance(message, Exited | Rejected):
            self.last_word = message
        if self.channel is not None and not self.channel.client_gone:
            await self.channel.send(message)


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
        reattach_seconds: float = DEFAULT_REATTACH_SECONDS,
        identity: IdentityMode = "request",
        run_in_caller_namespaces: bool = False,
        socket_limits: SocketLimits | None = None,
        pod_owners: PodOwners | None = None,
    ) -> None:
        self.pod_owners = pod_owners if pod_owners is not None else PodOwners(None)
        """Local mode: whose uid may act for which pod (pod_owners.py)."""
        self.outcomes = OutcomeBook(node)
        """Each pod's last release as the log has it, for clients that reattach late."""
        self.socket_limits = socket_limits
        self.socket_server: WorkloadSocketServer | None = None
        self.node = node
        self.inventory = inventory
        self.socket_path = socket_path
        self.sampler = sampler
        self.supervisor = supervisor if supervisor is not None else ProcessSupervisor()
        self.message_period_override = message_period_seconds
        self.memory_guard_period = memory_guard_period_seconds
        self.reattach_seconds = reattach_seconds
        self.identity: IdentityMode = identity
        self.run_in_caller_namespaces = run_in_caller_namespaces
        self._loop: DeciderLoop | None = None
        self._sessions: dict[PodRef, PodSession] = {}
        self._sessions_stopped = False
        self._stop_deadline: float | None = None
        self.record_retries = 0
        """How often recording an event was retried because the log could not be reached."""
        self._oom: dict[PodRef, MemoryOverrun] = {}
        self.serving = asyncio.Event()
        """Set once workloads can connect to the socket."""
        self._outcomes: dict[PodRef, ExecutorMessage] = {}
        """Last words of sessions that ended while their client was away, for when it reattaches."""
        records = self.supervisor.records_dir
        self.hooked = HookedPods(
            _HookedExecutorView(self),
            records_dir=records.parent / "hooked-pods" if records is not None else None,
        )
        """Pods whose own processes asked for the GPU through the CUDA hook."""

    # ------------------------------------------------------------------ service

    @property
    def loop(self) -> DeciderLoop:
        assert self._loop is not None, "the executor has not started"
        return self._loop

    @property
    def sessions(self) -> dict[PodRef, PodSession]:
        return self._sessions

    async def start(self, loop: DeciderLoop, stack: AsyncExitStack) -> None:
        self._loop = loop
        self.outcomes.attach(loop.projection.observers, loop.projection.last_seq)
        await loop.execute(
            ReportInventory(node=self.node, gpus=self.inventory.gpus, source=self.inventory.source),
            node=self.node,
        )
        stack.push_async_exit(self._on_exit)
        stack.push_async_callback(self.hooked.close)
        await self._recover()
        server = WorkloadSocketServer(
            self.socket_path,
            self,
            limits=self.socket_limits,
            on_rejected=self._record_bad_request,
            on_summary=self._record_refusal_summary,
        )
        self.socket_server = server
        await server.start()
        stack.push_async_callback(server.close)
        # on stop, end the sessions (and tell their clients) while the socket still serves them
        stack.push_async_exit(self._on_exit)
        self.serving.set()
        stop_guarding = asyncio.Event()
        guard = loop.background(
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

    async def react(self, entry: StoredEvent) -> None:
        event = entry.envelope.event
        if event.node != self.node:
            return
        if isinstance(event, PodRemoved) and event.pod not in self._sessions:
            await self._release_if_nothing_runs(event.pod)
        # a session waits on its own pod's state: wake those the event names (a node-wide
        # one, every session); a waiter's position is read when it is told, not waited on
        touched = pods_touched(event)
        if touched is None:
            for session in self._sessions.values():
                session.change.set()
        else:
            for pod in touched:
                named = self._sessions.get(pod)
                if named is not None:
                    named.change.set()
        self.hooked.wake(touched)

    async def _recover(self) -> None:
        """Take over what an earlier executor left: adopt its workloads, keep waiters' places."""
        state = self.loop.projection.state
        hooked = await self.hooked.recover()
        for workload in self.supervisor.adopt():
            pod = state.pods.get(workload.pod)
            if pod is None or pod.phase != "running":
                log.warning(
                    "node-executor: %s's recorded workload is not running in the log; ending it",
                    workload.pod,
                )
                await self.supervisor.terminate(workload, self._grace_seconds())
                workload.forget()
                continue
            log.info(
                "node-executor: adopting %s (pid %d) from an earlier executor",
                workload.pod,
                workload.pid,
            )
            self._spawn(PodSession(pod=workload.pod, workload=workload))
        for pod in list(state.pods_on(self.node)):
            if pod.ref in self._sessions or pod.ref in hooked:  # hooked: followed by them
                continue
            if pod.removed:  # deleted while this executor was away, and nothing of it runs
                await self._release_if_nothing_runs(pod.ref)
                continue
            if pod.policy != "share-pool":
                continue
            if pod.phase == "ready":
                log.info(
                    "node-executor: keeping %s's place for %.0fs while its client reconnects",
                    pod.ref,
                    self.reattach_seconds,
                )
                self._spawn(PodSession(pod=pod.ref))
            elif pod.phase == "running" and self.supervisor.records_dir is not None:
                # every command is recorded before it starts: with no record, it never started
                log.info(
                    "node-executor: %s was assigned but its command never started here; "
                    "keeping its GPU for %.0fs while its client reconnects",
                    pod.ref,
                    self.reattach_seconds,
                )
                self._spawn(PodSession(pod=pod.ref))
            elif pod.phase == "running":
                log.warning(
                    "node-executor: %s runs in the log but no workload of it is known here; "
                    "recording it as failed",
                    pod.ref,
                )
                await self._release(pod.ref, "failed", None)

    async def _release_if_nothing_runs(self, ref: PodRef) -> None:
        """A deleted pod holding a slot with no process of it here: record that it has ended."""
        pod = self._pod(ref)
        if pod is None or not pod.removed or ref in self._sessions or ref in self.hooked:
            return  # a session or the hooked pods' follower ends its processes and releases it
        log.info("node-executor: %s was deleted and runs nothing here; releasing its slot", ref)
        await self._release(ref, "cancelled", None)

    async def _on_exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        """Leaving the service's stack: a graceful stop ends the sessions; a failure does not.

        A stop (SIGTERM, or the service task cancelled) ends every workload, records it and
        tells its client. A failure (an exception such as a NATS timeout escaping the consumer)
        is treated like a crash: the commands keep running under their shims and a restarted
        executor adopts them; clients reconnect and reattach.
        """
        if exc_type is None or issubclass(exc_type, asyncio.CancelledError):
            await self._stop_sessions()
        else:
            await self._let_go(exc)
        return False

    async def _let_go(self, error: BaseException | None) -> None:
        """Stop following the sessions without ending anything (like a SIGKILL would)."""
        if self._sessions_stopped:
            return
        self._sessions_stopped = True
        log.error(
            "node-executor: failing (%s); leaving %d workload(s) running for the next executor",
            error,
            sum(1 for s in self._sessions.values() if s.workload is not None),
        )
        for session in list(self._sessions.values()):
            if session.task is not None:
                session.task.cancel()
        for session in list(self._sessions.values()):
            if session.task is not None:
                with suppress(asyncio.CancelledError):
                    await session.task
            session.finished.set()  # the connection closes without a last word: it reattaches

    async def _stop_sessions(self) -> None:
        """Graceful stop: end every workload, record it, tell every client its last word."""
        if self._sessions_stopped:
            return
        self._sessions_stopped = True
        self._stop_deadline = asyncio.get_running_loop().time() + STOP_RECORD_SECONDS
        for session in list(self._sessions.values()):
            if session.task is not None:
                session.task.cancel()
        for session in list(self._sessions.values()):
            if session.task is not None:
                with suppress(asyncio.CancelledError):
                    await session.task
            try:
                await self._stop_session(session)
            except Exception:
                log.exception("node-executor: could not record the end of %s", session.pod)
                if not session.finished_word:
                    await session.send(
                        Rejected(
                            reason="internal-error",
                            message="the node-executor stopped and could not record the end",
                        )
                    )
            session.finished.set()  # the client has its last word: its connection may close

    async def _stop_session(self, session: PodSession) -> None:
        workload = session.workload
        if workload is not None:
            log.info("node-executor: stopping, ending %s", session.pod)
            termination = await self.supervisor.terminate(workload, self._grace_seconds())
            reason = ended_reason(termination, "cancelled")
            await self._release(session.pod, reason, termination.exit_code)
            workload.forget()
            session.workload = None
            await session.send(Exited(exit_code=termination.exit_code, reason=reason))
            return
        if session.finished_word:
            return
        pod = self._pod(session.pod)
        if pod is not None and pod.phase in ("ready", "running"):  # queued, or assigned: unstarted
            await self._release(session.pod, "cancelled", None)
        await session.send(Exited(exit_code=0, reason="cancelled"))

    def _spawn(self, session: PodSession) -> None:
        self._sessions[session.pod] = session
        session.task = asyncio.create_task(self._lifecycle(session), name=f"pod-{session.pod}")

    # ------------------------------------------------------------------ connections

    async def _record(self, event: PodRejected | MessageRejected) -> None:
        """A rejection that is no core decision (bad bytes, a refused caller) is still an event.

        Retried (one envelope id: an append that landed is not repeated) while the log cannot
        be reached, for up to ``REFUSAL_RECORD_SECONDS``.
        """
        envelope = Envelope(id=uuid.uuid4().hex, time=self.loop.clock(), event=event)
        clock = asyncio.get_running_loop()
        give_up = clock.time() + REFUSAL_RECORD_SECONDS
        delay = RECORD_RETRY_FIRST_SECONDS
        while True:
            try:
                await self.loop.log.append(envelope)
                return
            except Exception as error:
                if clock.time() + delay >= give_up:
                    raise
                self.record_retries += 1
                log.warning("node-executor: could not record a refusal (%s); retrying", error)
                await asyncio.sleep(delay)  # a back-off between attempts, not a wait for a state
                delay = min(delay * 2, RECORD_RETRY_MAX_SECONDS)

    async def _record_bad_request(
        self, peer: PeerIdentity, data: bytes, reason: str, message: str
    ) -> None:
        await self._record(
            MessageRejected(
                subject=f"socket:{self.socket_path}",
                reason=f"{reason}: {message} (pid {peer.pid}, uid {peer.uid})",
                payload=data.decode("utf-8", errors="replace")[:REJECTED_PAYLOAD_LIMIT],
            )
        )

    async def _record_refusal_summary(self, summary: RefusalSummary) -> None:
        await self._record(
            MessageRejected(
                subject=f"socket:{self.socket_path}",
                reason=summary.describe(),
                payload=msgspec.json.encode(summary).decode()[:REJECTED_PAYLOAD_LIMIT],
            )
        )

    async def handle(self, request: RunRequest, fds: StdioFds, channel: Channel) -> None:
        if self._sessions_stopped:  # no last word: the client reconnects to the next executor
            log.info("node-executor: stopping; not taking %s's request", request.pod)
            return
        pods_by_uid = (  # only the kernel's answer is looked up (request mode: the claim)
            {pod.uid: pod.ref for pod in self.loop.projection.state.pods_on(self.node) if pod.uid}
            if self.identity != "request"
            else {}
        )
        identity = pod_of_peer(self.identity, request.pod, channel.peer, pods_by_uid)
        if isinstance(identity, IdentityRefused):
            log.warning("node-executor: refused a caller: %s", identity.message)
            if channel.claim_refusal(identity.reason, identity.message):  # else: in the summary
                await self._record(
                    PodRejected(
                        pod=request.pod,
                        node=self.node,
                        reason=identity.reason,
                        message=identity.message,
                    )
                )
            await channel.send(Rejected(reason=identity.reason, message=identity.message))
            return
        pod = identity
        if self.identity == "request" and not await self._may_act_for(pod, channel):
            return
        if pod in self.hooked:
            await channel.send(
                Rejected(
                    reason="AlreadyAttached",
                    message=f"pod {pod}'s own processes use its GPU through the CUDA hook",
                )
            )
            return
        session = self._sessions.get(pod)
        if session is not None:
            if session.channel is not None and not session.channel.client_gone:
                await channel.send(
                    Rejected(
                        reason="AlreadyAttached", message=f"pod {pod} already has a client here"
                    )
                )
                return
            log.info("node-executor: client of %s reattached", pod)
            if session.request is None:
                session.request = request
            session.channel, session.fds = channel, fds
            session.attached.set()
            session.change.set()
            state = self._pod(pod)
            if session.workload is not None and state is not None and state.gpu_index is not None:
                await channel.send(
                    Started(
                        gpu_index=state.gpu_index,
                        gpu_uuid=state.gpu_uuid,
                        pid=session.workload.pid,
                    )
                )
        elif request.reattach and (outcome := await self._outcome_of(pod, request)) is not None:
            await channel.send(outcome)
            return
        else:  # a new request (or a reattach whose request never reached the log: nothing ran)
            self._outcomes.pop(pod, None)
            session = PodSession(pod=pod, request=request, channel=channel, fds=fds)
            session.attached.set()
            self._spawn(session)
        await self._serve_until_done(session, channel)

    async def attach(self, request: AttachRequest, channel: Channel) -> None:
        """A process's CUDA hook asks for its pod's GPU (see hooked_pods)."""
        if (
            self.identity == "request"
            and request.pod is not None
            and not await self._may_act_for(request.pod, channel)
        ):
            return
        await self.hooked.attach(request, channel)

    async def _may_act_for(self, pod: PodRef, channel: Channel) -> bool:
        """Local mode: the caller's uid must own ``pod``; refused (answered, recorded) if not."""
        refused = self.pod_owners.authorise(channel.peer.uid, pod)
        if refused is None:
            return True
        log.warning("node-executor: refused a caller: %s", refused.message)
        channel.refuse(refused.reason, refused.message)
        await channel.send(Rejected(reason=refused.reason, message=refused.message))
        return False

    async def _outcome_of(self, pod: PodRef, request: RunRequest) -> ExecutorMessage | None:
        """A reattaching client with no run here: its last word, or None to serve it as new.

        The last word is this executor's memory of it, else the log's: the pod's last release
        after the client first sent its request. With neither a release nor a PodReady of the
        pod since then, the executor never acted on the request (it went away first): nothing
        ran, so it is served as a new request (None).
        """
        outcome = self._outcomes.pop(pod, None)
        if outcome is not None:
            return outcome
        if request.sent_at > 0:
            await self.outcomes.backfill(self.loop.log)
            since = datetime.fromtimestamp(request.sent_at, UTC)
            release = self.outcomes.release_since(pod, since)
            if release is not None:
                log.info("node-executor: %s reattached after its end: %s", pod, release.reason)
                exit_code = release.exit_code if release.exit_code is not None else 0
                return Exited(exit_code=exit_code, reason=release.reason)
            state = self._pod(pod)
            if not self.outcomes.ready_since(pod, since) and (
                state is None or state.phase == "dormant"
            ):
                log.info("node-executor: %s's request never reached the log; serving it", pod)
                return None
        return Rejected(
            reason="NothingToReattach",
            message=f"pod {pod} has no run on this node to reattach to",
        )

    async def _serve_until_done(self, session: PodSession, channel: Channel) -> None:
        """Keep the connection (and its fds) while the session runs; report the client leaving."""
        gone = asyncio.create_task(channel.wait_client_gone())
        finished = asyncio.create_task(session.finished.wait())
        try:
            await asyncio.wait({gone, finished}, return_when=asyncio.FIRST_COMPLETED)
            if gone.done():
                session.change.set()
                # the lifecycle decides what the departure means; wait for it to act on it
                await session.finished.wait()
        finally:
            gone.cancel()
            finished.cancel()

    # ------------------------------------------------------------------ a pod's life

    def _pod(self, ref: PodRef) -> PodState | None:
        """The pod as this node's entries have it (None: not a pod of this node)."""
        pod = self.loop.projection.state.pods.get(ref)
        return pod if pod is not None and pod.node == self.node else None

    def _grace_seconds(self) -> float:
        node = self.loop.projection.state.nodes.get(self.node)
        return float(node.qos.preempt_grace_seconds) if node is not None else 10.0

    def _message_period(self) -> float:
        if self.message_period_override is not None:
            return self.message_period_override
        node = self.loop.projection.state.nodes.get(self.node)
        return float(node.qos.waiting_message_period_seconds) if node is not None else 10.0

    async def _release(self, pod: PodRef, reason: ReleaseReason, exit_code: int | None) -> None:
        await self._execute(
            ReportRelease(pod=pod, node=self.node, reason=reason, exit_code=exit_code)
        )

    async def _execute(self, command: Command) -> list[Event]:
        """``loop.execute``, retried while the log cannot be reached (NATS down or timing out).

        An outcome that could not be recorded must not be lost, nor told as an internal error:
        the retry is safe because an append that did land makes the next decision a no-op (the
        node's sequence has moved on: the loop catches up and decides again). While stopping
        gracefully it gives up after ``STOP_RECORD_SECONDS``.
        """
        clock = asyncio.get_running_loop()
        delay = RECORD_RETRY_FIRST_SECONDS
        while True:
            try:
                return await self.loop.execute(command, node=self.node)
            except (ValueError, TypeError, AssertionError):
                raise  # a fault in the command itself: retrying cannot help
            except Exception as error:
                if self._stop_deadline is not None and clock.time() >= self._stop_deadline:
                    raise
                self.record_retries += 1
                log.warning(
                    "node-executor: could not record %s (%s: %s); retrying in %.1fs",
                    type(command).__name__,
                    type(error).__name__,
                    error,
                    delay,
                )
                await asyncio.sleep(delay)  # a back-off between attempts, not a wait for a state
                delay = min(delay * 2, RECORD_RETRY_MAX_SECONDS)

    async def _lifecycle(self, session: PodSession) -> None:
        try:
            while await self._step(session):
                pass
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.exception("node-executor: session of %s failed", session.pod)
            await session.send(Rejected(reason="internal-error", message=str(error)))
        finally:
            if not self._sessions_stopped:
                # (when the executor stops, _stop_sessions says the last word, then lets go)
                session.finished.set()
            if self._sessions.get(session.pod) is session:
                del self._sessions[session.pod]
            if session.last_word is not None and (session.channel is None or session.client_left):
                self._outcomes[session.pod] = session.last_word
                while len(self._outcomes) > MAX_KEPT_OUTCOMES:  # oldest first: a dict keeps order
                    del self._outcomes[next(iter(self._outcomes))]

    async def _step(self, session: PodSession) -> bool:
        """Advance the session by one stage; False when it is over."""
        state = self._pod(session.pod)
        if state is None:
            if session.workload is not None:
                await self._end(session, "cancelled", tell_client=True)
                return False
            await session.send(
                Rejected(reason="UnknownPod", message=f"pod {session.pod} is not registered here")
            )
            return False
        if session.workload is not None:
            return await self._supervise(session)
        if state.removed:  # deleted before its command started: nothing of it runs
            await self._release(session.pod, "cancelled", None)
            await session.send(Exited(exit_code=0, reason="cancelled"))
            return False
        if state.phase == "dormant":
            if session.channel is None or session.client_left:
                return False
            events = await self._execute(RequestGpu(pod=session.pod, node=self.node))
            rejected = next((e for e in events if isinstance(e, PodRejected)), None)
            if rejected is not None:
                await session.send(Rejected(reason=rejected.reason, message=rejected.message))
                return False
            after = self._pod(session.pod)
            if not events and after is not None and after.phase == "dormant":
                # nothing was decided and nothing changed: asking again would spin for ever
                await session.send(
                    Rejected(
                        reason="NotQueued",
                        message=f"pod {session.pod} cannot be queued for a GPU here",
                    )
                )
                return False
            return True
        if state.phase == "ready":
            return await self._wait_for_gpu(session)
        return await self._start(session, state)

    async def _wait_for_change(self, session: PodSession, within: float | None) -> None:
        """Wait for a change set since the caller last cleared ``session.change`` (or one to come)."""
        with suppress(TimeoutError):
            async with asyncio.timeout(within):
                await session.change.wait()

    async def _wait_for_gpu(self, session: PodSession) -> bool:
        """Tell the client its true wait and position every period until the pod runs."""
        loop = asyncio.get_running_loop()
        next_message = loop.time() + self._message_period()  # the first after one period
        reattach_deadline = loop.time() + self.reattach_seconds
        # cleared before the state is read: a change while sending below still wakes the wait
        session.change.clear()
        while (state := self._pod(session.pod)) is not None and state.phase == "ready":
            if session.client_left or (
                session.channel is None and loop.time() >= reattach_deadline
            ):
                log.info("node-executor: %s's client is gone; it leaves the queue", session.pod)
                await self._release(session.pod, "cancelled", None)
                return False
            if loop.time() >= next_message:
                await session.send(self._waiting(state))
                next_message = loop.time() + self._message_period()
            until = (
                next_message
                if session.channel is not None
                else min(next_message, reattach_deadline)
            )
            await self._wait_for_change(session, max(0.0, until - loop.time()))
            session.change.clear()
        if state is None or state.phase == "dormant":
            await session.send(Exited(exit_code=0, reason="cancelled"))
            return False
        return True

    def _waiting(self, state: PodState) -> Waiting:
        assert state.ready_since is not None
        seconds = int((self.loop.clock() - state.ready_since).total_seconds())
        position = queue_positions(self.loop.projection.state, self.node).get(state.ref, 0)
        return Waiting(seconds=max(0, seconds), position=position)

    async def _start(self, session: PodSession, state: PodState) -> bool:
        """The pod runs in the log: start its command (once a client with stdio is attached)."""
        if session.request is None or session.fds is None or session.client_left:
            if not session.client_left:
                with suppress(TimeoutError):
                    async with asyncio.timeout(self.reattach_seconds):
                        await session.attached.wait()
                if session.attached.is_set():
                    return True
            log.info(
                "node-executor: %s was assigned but its client is gone; releasing", session.pod
            )
            await self._release(session.pod, "cancelled", None)
            return False
        assert state.gpu_index is not None
        if state.evicted_by is not None:  # preempted before its command even started
            # read before the release: folding the Released clears them from ``state``
            by, gpu_index = state.evicted_by, state.gpu_index
            await self._release(session.pod, "preempted", None)
            await session.send(PreemptedNotice(by=by.name, gpu_index=gpu_index))
            if session.request.requeue and not session.client_left:
                return True
            await session.send(Exited(exit_code=0, reason="preempted"))
            return False
        gpu = self.inventory.by_index(state.gpu_index)
        request = session.request
        env = workload_environment(request.env, gpu, state.limits, pod=session.pod)
        peer = session.channel.peer if session.channel is not None else None
        try:
            session.workload = await self.supervisor.start(
                session.pod,
                request.argv,
                env,
                request.cwd,
                session.fds,
                run_as=(peer.uid, peer.gid) if peer is not None else None,
                namespaces_of=peer.pid
                if peer is not None and self.run_in_caller_namespaces
                else None,
                # the caller's groups and capabilities, no more (only a root executor has more
                # to give away, and only it can drop them)
                credentials=credentials_of(peer.pid, peer.uid, peer.gid)
                if peer is not None and os.geteuid() == 0
                else None,
            )
        except WorkloadStartFailed as error:
            await self._release(session.pod, "failed", error.exit_code)
            await session.send(Rejected(reason="StartFailed", message=str(error)))
            return False
        await session.send(
            Started(gpu_index=gpu.index, gpu_uuid=gpu.uuid, pid=session.workload.pid)
        )
        return True

    async def _supervise(self, session: PodSession) -> bool:
        workload = session.workload
        assert workload is not None
        exited = asyncio.create_task(workload.wait_exit())

        def on_exit(task: asyncio.Task[int]) -> None:
            if not task.cancelled():
                session.change.set()  # its end is a change: one wait below, no task per wake

        exited.add_done_callback(on_exit)
        try:
            while True:
                if exited.done():
                    return await self._exited(session, exited.result())
                state = self._pod(session.pod)
                if state is None or state.removed:  # deleted: end it, then record the end
                    await self._end(session, "cancelled", tell_client=True)
                    return False
                if state.phase != "running":  # released elsewhere (not by this executor)
                    await self._end(session, None, tell_client=True)
                    return False
                if state.evicted_by is not None:
                    return await self._preempt(session, state)
                if session.client_left:
                    log.info("node-executor: client of %s left; ending its command", session.pod)
                    await self._end(session, "cancelled", tell_client=False)
                    return False
                session.change.clear()
                await session.change.wait()
        finally:
            exited.cancel()

    async def _exited(self, session: PodSession, code: int) -> bool:
        workload = session.workload
        assert workload is not None
        reason: ReleaseReason = "completed" if code == 0 else "failed"
        if self._oom.pop(session.pod, None) is not None:
            reason = "out-of-memory"
        await self._release(session.pod, reason, code)
        workload.forget()
        session.workload = None
        await session.send(Exited(exit_code=code, reason=reason))
        return False

    async def _end(
        self, session: PodSession, reason: ReleaseReason | None, *, tell_client: bool
    ) -> None:
        """End the command; record the release (unless already released) and tell the client."""
        workload = session.workload
        assert workload is not None
        termination = await self.supervisor.terminate(workload, self._grace_seconds())
        state = self._pod(session.pod)
        told: ReleaseReason = ended_reason(termination, "cancelled")
        if reason is not None and state is not None and state.phase == "running":
            told = ended_reason(termination, reason)
            await self._release(session.pod, told, termination.exit_code)
        workload.forget()
        session.workload = None
        if tell_client:
            await session.send(Exited(exit_code=termination.exit_code, reason=told))

    async def _preempt(self, session: PodSession, state: PodState) -> bool:
        workload = session.workload
        assert workload is not None
        assert state.evicted_by is not None
        assert state.gpu_index is not None
        by, gpu_index = state.evicted_by, state.gpu_index
        termination = await self.supervisor.terminate(workload, self._grace_seconds())
        if not termination.confirmed:
            log.error(
                "node-executor: %s: processes survived SIGKILL: %s",
                state.ref,
                termination.survivors,
            )
        log.info(
            "node-executor: %s preempted by %s, ended by %s", state.ref, by, termination.ended_by
        )
        await self._release(state.ref, "preempted", termination.exit_code)
        workload.forget()
        session.workload = None
        await session.send(PreemptedNotice(by=by.name, gpu_index=gpu_index))
        if (
            session.request is not None
            and session.request.requeue
            and session.channel is not None
            and not session.client_left
        ):
            return True  # dormant now: the next step queues it again
        await session.send(Exited(exit_code=termination.exit_code, reason="preempted"))
        return False

    def pod_processes(self, among: Collection[int] | None = None) -> dict[PodRef, list[int]]:
        """The live processes of each running workload (for the per-pod GPU metrics).

        With ``among`` (the pids a GPU sample names) only those of them: one stat read per
        pid, no scan of ``/proc`` (what a scrape asks, through ``ExecutorReadings``)."""
        leaders = {
            pod: session.workload.pid
            for pod, session in self._sessions.items()
            if session.workload is not None and session.workload.pid > 0
        }
        if among is None:
            processes = {pod: group_members(leader) for pod, leader in leaders.items()}
        else:
            groups = process_groups(among)
            processes = {
                pod: sorted(pid for pid, ids in groups.items() if leader in ids)
                for pod, leader in leaders.items()
            }
        processes.update(self.hooked.processes())
        return processes

    # ------------------------------------------------------------------ memory guard

    def _guarded_workloads(self) -> list[GuardedWorkload]:
        if self.sampler.source == "simulated":
            return []  # the guard is inert: a simulated sample names no process to measure
        guarded = []
        for pod, session in self._sessions.items():
            state = self._pod(pod)
            if session.workload is None or state is None or state.gpu_index is None:
                continue
            gpu = next((g for g in self.inventory.gpus if g.index == state.gpu_index), None)
            if gpu is None:  # its GPU left the inventory: released, and ended by its session
                continue
            leader = session.workload.pid
            guarded.append(
                GuardedWorkload(
                    pod=pod,
                    gpu_uuid=gpu.uuid,
                    memory_limit_bytes=memory_limit_bytes(gpu, state.limits),
                    # no scan of /proc: the guard asks which sampled pids are the leader's
                    pids=frozenset() if leader_exited(leader) else frozenset({leader}),
                    leader=max(leader, 0),
                )
            )
        for pod, pids in self.hooked.processes().items():
            state = self._pod(pod)
            if state is None or state.gpu_index is None or not pids:
                continue
            gpu = next((g for g in self.inventory.gpus if g.index == state.gpu_index), None)
            if gpu is None:  # its GPU left the inventory: no sample and no limit to hold it to
                continue
            guarded.append(
                GuardedWorkload(
                    pod=pod,
                    gpu_uuid=gpu.uuid,
                    memory_limit_bytes=memory_limit_bytes(gpu, state.limits),
                    pids=frozenset(pids),
                )
            )
        return guarded

    async def _on_memory_overrun(self, overrun: MemoryOverrun) -> None:
        if await self.hooked.out_of_memory(overrun.pod):
            return
        session = self._sessions.get(overrun.pod)
        if session is None or session.workload is None:
            return
        self._oom[overrun.pod] = overrun
        await self.supervisor.terminate(session.workload, 0)


def ended_reason(termination: Termination, otherwise: ReleaseReason) -> ReleaseReason:
    """A command found already gone when it was to be ended finished by itself: its own end
    (completed, or failed with its code) is the truth, not the reason it was to be ended for."""
    if termination.ended_by == "exited":
        return "completed" if termination.exit_code == 0 else "failed"
    return otherwise


class _HookedExecutorView:
    """The node-executor as the hooked pods see it."""

    def __init__(self, executor: NodeExecutor) -> None:
        self._executor = executor

    @property
    def identity(self) -> IdentityMode:
        return self._executor.identity

    def pod(self, ref: PodRef) -> PodState | None:
        return self._executor._pod(ref)

    def runs_command(self, ref: PodRef) -> bool:
        return ref in self._executor.sessions

    def pods_by_uid(self) -> dict[str, PodRef]:
        executor = self._executor
        return {
            pod.uid: pod.ref
            for pod in executor.loop.projection.state.pods_on(executor.node)
            if pod.uid
        }

    async def record_refusal(
        self, pod: PodRef | None, reason: str, message: str, channel: Channel | None = None
    ) -> None:
        executor = self._executor
        log.warning("node-executor: refused a CUDA hook: %s", message)
        if channel is not None and not channel.claim_refusal(reason, message):
            return  # a flood: counted for the socket's summary of refusals
        if pod is None:
            await executor._record(
                MessageRejected(
                    subject=f"socket:{executor.socket_path}",
                    reason=f"{reason}: {message}",
                    payload="",
                )
            )
            return
        await executor._record(
            PodRejected(pod=pod, node=executor.node, reason=reason, message=message)
        )

    async def request_gpu(self, pod: PodRef) -> Rejected | None:
        executor = self._executor
        events = await executor.loop.execute(
            RequestGpu(pod=pod, node=executor.node), node=executor.node
        )
        rejected = next((e for e in events if isinstance(e, PodRejected)), None)
        if rejected is None:
            return None
        return Rejected(reason=rejected.reason, message=rejected.message)

    async def release(self, pod: PodRef, reason: ReleaseReason, exit_code: int | None) -> None:
        await self._executor._release(pod, reason, exit_code)

    def waiting(self, state: PodState) -> Waiting:
        return self._executor._waiting(state)

    def message_period(self) -> float:
        return self._executor._message_period()

    def grace_seconds(self) -> float:
        return self._executor._grace_seconds()

    def gpu(self, index: int) -> GpuInfo:
        return self._executor.inventory.by_index(index)
