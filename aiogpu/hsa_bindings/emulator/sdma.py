"""SDMA copy engines: a few per GPU, each a worker thread with a FIFO of copies.

Models ``hsa_amd_memory_async_copy`` / ``_on_engine`` / ``hsa_amd_memory_copy_engine_status``:
- the copy agent is the source agent when the source is a GPU, else the destination agent (two
  CPU agents: GPU 0); its engines are ids ``1 << i``;
- at submission, both ranges must be reachable by the copy agent (device memory of its own or
  granted with allow_access, system-pool memory, locked host memory) else INVALID_ARGUMENT; no
  engine (none configured, or exhausted by fault injection) is OUT_OF_RESOURCES, as when ROCr
  cannot create an SDMA queue; an engine id that is not one of the agent's is INVALID_ARGUMENT;
- an engine waits (blocking) until every dependency signal is 0, copies with memmove semantics
  through ``MemoryManager.resolve``, and subtracts 1 from the completion signal. A fault aborts the
  copy: the memory-fault event goes to the handlers first, then the completion signal is
  decremented, so the engine moves on and nothing waiting on the copy hangs; the event is how
  the runtime learns that the copy failed.
"""
from __future__ import annotations

import itertools
import threading
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from .. import types as T
from ._abi import StatusError, join_thread, now_ns, require
from .agents import Agent
from .context import Context
from .faults import FaultRecord
from .memory import MemoryFault
from .signals import Signal, Waiter, wait_for
from .timeline import TimelineRecord


@dataclass(eq=False)
class CopyJob:
    seq: int
    dst: int
    src: int
    size: int
    deps: list[Signal]
    completion: Signal | None
    name: str  # "H2D", "D2H", "D2D", "P2P" or "H2H"


@dataclass(frozen=True)
class CopyRecord:
    """A copy an engine ran: its sequence number on the agent and how it ended."""

    seq: int
    dst: int
    src: int
    nbytes: int
    name: str
    outcome: str  # "done" | "fault" | "dependency destroyed"
    end_ns: int = field(default_factory=now_ns)


HISTORY_RECORDS = 1024  # per engine; older CopyRecords are dropped (``outcomes`` keeps totals)


class Engine:
    def __init__(self, ctx: Context, agent: Agent, index: int, history: int = HISTORY_RECORDS) -> None:
        self.ctx, self.agent, self.index, self.bit = ctx, agent, index, 1 << index
        self.history: deque[CopyRecord] = deque(maxlen=history)  # the newest copies only
        self.outcomes: Counter[str] = Counter()  # every copy ever run, by outcome
        self.waiter = Waiter()
        self._lock = threading.Lock()
        self._jobs: deque[CopyJob] = deque()
        self._running = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._jobs) + self._running

    def submit(self, job: CopyJob) -> None:
        with self._lock:
            require(not self._stopping, T.HSA_STATUS_ERROR_NOT_INITIALIZED, "engine stopped")
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"{self.ctx.name}-gpu{self.agent.gpu}-sdma{self.index}")
                self._thread.start()
        self.waiter.wake()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
        self.waiter.wake()
        join_thread(thread)

    def _run(self) -> None:
        while True:
            job = wait_for(self.waiter, (), self._take)
            if job == "stop":
                return
            try:
                self._execute(job)
            except BaseException as exc:
                self.ctx.report_bug(f"sdma engine {self.index} of GPU {self.agent.gpu}", exc)
            finally:
                with self._lock:
                    self._running = False

    def _take(self) -> CopyJob | str | None:
        with self._lock:
            if self._stopping:
                return "stop"
            if self._jobs:
                self._running = True
                return self._jobs.popleft()
        return None

    def _execute(self, job: CopyJob) -> None:
        def ready() -> str | None:
            if self._stopping:
                return "stop"
            if any(not d.alive for d in job.deps):
                return "dead"
            return "ok" if all(d.load() == 0 for d in job.deps) else None

        state = wait_for(self.waiter, job.deps, ready)
        if state == "dead":
            dead = next(d for d in job.deps if not d.alive)
            self._fault(job, MemoryFault(dead.address + 8, "copy dependency signal destroyed while waited on"))
        if state != "ok":
            return
        start = now_ns()
        try:
            np.copyto(self._view(job.dst, job.size, True), self._view(job.src, job.size, False))
        except MemoryFault as fault:
            self._fault(job, fault)
            return
        self._finish(job, start)

    def _view(self, address: int, size: int, write: bool) -> np.ndarray:
        return self.ctx.memory.resolve(self.agent.gpu, address, size, write)

    def _finish(self, job: CopyJob, start: int) -> None:
        delay = self.ctx.faults.completion_delay(self.agent.gpu, None, job.seq)
        if delay:
            wait_for(Waiter(), (), lambda: self._stopping, delay)
        end = now_ns()
        self._record(CopyRecord(job.seq, job.dst, job.src, job.size, job.name, "done"))
        if job.completion is not None:
            job.completion.set_timestamps(start, end)
            try:
                job.completion.add(-1)
            except StatusError:
                pass  # destroyed by the runtime while the copy ran
        self.ctx.timeline.add(TimelineRecord(self.agent.gpu, None, self.index, "copy", job.name, job.size,
                                             start, end, job.seq))

    def _record(self, record: CopyRecord) -> None:
        self.history.append(record)
        self.outcomes[record.outcome] += 1

    def _fault(self, job: CopyJob, fault: MemoryFault) -> None:
        self._record(CopyRecord(job.seq, job.dst, job.src, job.size, job.name, "fault"))
        self.ctx.events.memory_fault(self.agent.handle, self.agent.gpu, fault, f"sdma {self.index}")
        if job.completion is not None:   # after the event: the aborted copy retires
            try:
                job.completion.add(-1)
            except StatusError:
                pass


class CopyEngines:
    """The SDMA engines of every GPU of one emulator."""

    def __init__(self, ctx: Context, per_gpu: int, history: int = HISTORY_RECORDS) -> None:
        self.ctx = ctx
        self.engines = [[Engine(ctx, agent, i, history) for i in range(per_gpu)] for agent in ctx.agents.gpus]
        self._seq = [itertools.count() for _ in ctx.agents.gpus]

    def copy_agent(self, dst_agent: Agent, src_agent: Agent) -> Agent:
        if src_agent.is_gpu:
            return src_agent
        if dst_agent.is_gpu:
            return dst_agent
        require(self.ctx.agents.gpus, T.HSA_STATUS_ERROR_INVALID_AGENT, "no GPU agent to copy with")
        return self.ctx.agents.gpus[0]

    def submit(self, dst: int, dst_agent: Agent, src: int, src_agent: Agent, size: int, deps: list[Signal],
               completion: Signal | None, engine_bit: int | None = None) -> None:
        agent = self.copy_agent(dst_agent, src_agent)
        self._check_reachable(agent, dst, size, True)
        self._check_reachable(agent, src, size, False)
        engine = self._choose(agent, engine_bit)
        name = _direction(dst_agent, src_agent)
        engine.submit(CopyJob(next(self._seq[agent.gpu]), dst, src, size, deps, completion, name))

    def status(self, dst_agent: Agent, src_agent: Agent) -> int:
        """Bitmask of the copy agent's idle engines (0 when exhausted)."""
        agent = self.copy_agent(dst_agent, src_agent)
        if self.ctx.faults.sdma_exhausted(agent.gpu):
            return 0
        return sum(e.bit for e in self.engines[agent.gpu] if e.pending == 0)

    def shutdown(self) -> None:
        for engines in self.engines:
            for engine in engines:
                engine.stop()

    def _choose(self, agent: Agent, engine_bit: int | None) -> Engine:
        engines = self.engines[agent.gpu]
        if not engines or self.ctx.faults.sdma_exhausted(agent.gpu):
            self.ctx.faults.record(FaultRecord("sdma_exhausted", agent.gpu, None, None,
                                               "no SDMA engine available: OUT_OF_RESOURCES"))
            raise StatusError(T.HSA_STATUS_ERROR_OUT_OF_RESOURCES, f"no SDMA engine on GPU {agent.gpu}")
        if engine_bit is not None:
            match = [e for e in engines if e.bit == engine_bit]
            require(match, T.HSA_STATUS_ERROR_INVALID_ARGUMENT,
                    f"engine id 0x{engine_bit:x} is not an SDMA engine of GPU {agent.gpu}")
            return match[0]
        idle = [e for e in engines if e.pending == 0]
        return idle[0] if idle else min(engines, key=lambda e: e.pending)

    def _check_reachable(self, agent: Agent, address: int, size: int, write: bool) -> None:
        try:
            self.ctx.memory.resolve(agent.gpu, address, size, write)
        except MemoryFault as fault:
            raise StatusError(T.HSA_STATUS_ERROR_INVALID_ARGUMENT, fault.reason) from fault


def _direction(dst_agent: Agent, src_agent: Agent) -> str:
    if src_agent.is_gpu and dst_agent.is_gpu:
        return "D2D" if src_agent is dst_agent else "P2P"
    return f"{'D' if src_agent.is_gpu else 'H'}2{'D' if dst_agent.is_gpu else 'H'}"
