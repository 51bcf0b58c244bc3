"""Copy engines ("blits") per GPU, modelled on ROCr's GpuAgent (amd_gpu_agent.cpp).

ROCr keeps, per GPU agent, an array of blit objects indexed by *engine offset*; each is created
lazily at its first use (``GpuAgent::GetBlitObject``, ``GpuAgent::InitDma``):
- offset 0, device-to-device: always a blit *kernel* on ROCr's utility queue;
- offset 1, host-to-device: an SDMA queue (engine id ``HSA_AMD_SDMA_ENGINE_0``);
- offset 2, device-to-host and PCIe peer copies: an SDMA queue (``ENGINE_1``; ``ENGINE_0`` when
  the GPU has a single SDMA engine);
- offsets 3.. : xGMI peer engines (``ENGINE_2 << i``), when the GPUs share an xGMI hive.
When ROCr cannot create the SDMA queue at first use (KFD has none left, or SDMA is disabled),
that blit silently becomes a blit kernel and the copy call still succeeds.

The emulated functions follow ROCr:
- ``hsa_amd_memory_copy_engine_status`` (``Runtime::CopyMemoryStatus``, ``GpuAgent::DmaCopyStatus``):
  INVALID_AGENT when source and destination agents are the same; for xGMI peers only xGMI
  engines; otherwise ENGINE_0 when the host-to-device blit is free (on gfx90a only for
  host-to-device copies), ENGINE_1 when the device-to-host blit is free, and any free xGMI engine.
  A blit is free when it was never used, or when it is a real SDMA queue with nothing pending
  (``GpuAgent::DmaEngineIsFree``): a blit that fell back to a kernel is never free again once
  used. An empty mask is OUT_OF_RESOURCES.
- ``hsa_amd_memory_async_copy_on_engine`` (``Runtime::CopyMemoryOnEngine``,
  ``GpuAgent::DmaCopyOnEngine``): the engine id must be a single bit of a known engine, else
  INVALID_ARGUMENT; an xGMI peer copy must use an xGMI engine, a non-xGMI copy may not, and on
  gfx90a ENGINE_0 serves host-to-device only, else INVALID_ARGUMENT; a copy within one GPU runs
  on the device-to-device blit kernel unless ``force_copy_on_sdma``.
- ``hsa_amd_memory_async_copy`` (``GpuAgent::DmaCopy``, ``GetBlitObject(dst, src, size)``): same
  GPU: the blit kernel; PCIe: host-to-device or device-to-host blit; xGMI: the peer's xGMI blit.
  It is the only copy call of ROCr 5.2.3 (the emulator's default ``rocr_version``): the blit is
  ROCr's choice, an SDMA queue, or a blit kernel on the same agent when the SDMA queue could not
  be created (``GpuAgent::InitDma``'s blit_lambda: ``CreateBlitSdma`` failed, ``CreateBlitKernel``);
  a busy blit takes the copy behind what it runs (no engine is "free" or "busy" to the caller).
The copy agent is the source agent when it is a GPU, else the destination agent (ROCr:
``Runtime::CopyMemory``: ``copy_agent = src_gpu ? src_agent : dst_agent``). Both ranges must
be reachable by it at submission (else INVALID_ARGUMENT, the emulator's stand-in for a fault).

Each blit is a worker thread with a FIFO: it waits (blocking) until every dependency signal is
0, copies with memmove semantics through ``MemoryManager.resolve`` and subtracts 1 from the
completion signal. A fault aborts the copy and goes to the device's memory-fault handling (see
``events``); an evicted blit (its device faulted) runs and completes nothing more.
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

HISTORY_RECORDS = 1024  # per blit; older CopyRecords are dropped (``outcomes`` keeps totals)
DEV_TO_DEV, HOST_TO_DEV, DEV_TO_HOST, XGMI_BASE = 0, 1, 2, 3  # ROCr's blit offsets
MAX_XGMI_ENGINES = 14
GFX90A = "gfx90a"


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
    """A copy a blit ran: its sequence number on the agent and how it ended."""

    seq: int
    dst: int
    src: int
    nbytes: int
    name: str
    outcome: str  # "done" | "fault" | "dependency destroyed"
    end_ns: int = field(default_factory=now_ns)


class Blit:
    """One of ROCr's blit objects: an SDMA queue, or a blit kernel (``is_sdma`` False)."""

    def __init__(self, ctx: Context, agent: Agent, offset: int, history: int) -> None:
        self.ctx, self.agent, self.offset = ctx, agent, offset
        self.created = False    # lazily, at first use (ROCr's lazy_ptr)
        self.is_sdma = False
        self.history: deque[CopyRecord] = deque(maxlen=history)  # the newest copies only
        self.outcomes: Counter[str] = Counter()  # every copy ever run, by outcome
        self.waiter = Waiter()
        self._lock = threading.Lock()
        self._jobs: deque[CopyJob] = deque()
        self._running = False
        self._stopping = False
        self.evicted = False
        self._thread: threading.Thread | None = None

    @property
    def role(self) -> str:
        """What ROCr uses the blit at this offset for (GpuAgent::InitDma's comments)."""
        return ("d2d", "h2d", "d2h")[self.offset] if self.offset < XGMI_BASE else f"xgmi{self.offset - XGMI_BASE}"

    @property
    def pending(self) -> int:
        """Copies queued or running (ROCr: PendingBytes() != 0)."""
        with self._lock:
            return len(self._jobs) + self._running

    def create(self, sdma: bool) -> None:
        self.created, self.is_sdma = True, sdma

    def submit(self, job: CopyJob) -> None:
        with self._lock:
            require(not self._stopping, T.HSA_STATUS_ERROR_NOT_INITIALIZED, "engine stopped")
            self._jobs.append(job)
            if self._thread is None:
                kind = f"sdma{self.offset}" if self.is_sdma else f"blit{self.offset}"
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"{self.ctx.name}-gpu{self.agent.gpu}-{kind}")
                self._thread.start()
        self.waiter.wake()

    def evict(self) -> None:
        """KFD evicted the device's queues: nothing queued or running completes any more."""
        with self._lock:
            self.evicted = True
            self._jobs.clear()
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
                self.ctx.report_bug(f"blit {self.offset} of GPU {self.agent.gpu}", exc)
            finally:
                with self._lock:
                    self._running = False

    def _take(self) -> CopyJob | str | None:
        with self._lock:
            if self._stopping:
                return "stop"
            if self._jobs and not self.evicted:
                self._running = True
                return self._jobs.popleft()
        return None

    def _execute(self, job: CopyJob) -> None:
        def ready() -> str | None:
            if self._stopping or self.evicted:
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
        if self.evicted:
            return  # the device faulted meanwhile: the copy never completes
        end = now_ns()
        self._record(CopyRecord(job.seq, job.dst, job.src, job.size, job.name, "done"))
        kind, engine = ("copy", self.offset - 1) if self.is_sdma else ("blit", None)
        self.ctx.timeline.add(TimelineRecord(self.agent.gpu, None, engine, kind, job.name, job.size,
                                             start, end, job.seq))
        if job.completion is not None:  # last: whoever sees the signal complete finds the records
            job.completion.set_timestamps(start, end)
            try:
                job.completion.add(-1)
            except StatusError:
                pass  # destroyed by the runtime while the copy ran

    def _record(self, record: CopyRecord) -> None:
        self.history.append(record)
        self.outcomes[record.outcome] += 1

    def _fault(self, job: CopyJob, fault: MemoryFault) -> None:
        """A GPU memory fault: the device's queues (this one included) are evicted and the
        system event is delivered; the aborted copy never completes."""
        self._record(CopyRecord(job.seq, job.dst, job.src, job.size, job.name, "fault"))
        self.ctx.events.memory_fault(self.agent.handle, self.agent.gpu, fault, f"sdma {self.offset}")


class CopyEngines:
    """The blits of every GPU of one emulator, and ROCr's rules for choosing among them.

    ``sdma_engines`` is the GPUs' NumSdmaEngines (0..2; 0: SDMA disabled, as with
    HSA_ENABLE_SDMA=0, so every blit is a kernel), ``xgmi_engines`` their NumSdmaXgmiEngines
    (with xGMI engines, all emulated GPUs form one xGMI hive).
    """

    def __init__(self, ctx: Context, sdma_engines: int, xgmi_engines: int = 0, history: int = HISTORY_RECORDS,
                 isa: str = GFX90A) -> None:
        self.ctx = ctx
        self.num_sdma, self.num_xgmi = sdma_engines, xgmi_engines
        self.limit_h2d = isa == GFX90A  # gfx90a: SDMA0 serves host-to-device only (a RAS issue)
        count = XGMI_BASE + xgmi_engines
        self.blits = [[Blit(ctx, agent, i, history) for i in range(count)] for agent in ctx.agents.gpus]
        self._seq = [itertools.count() for _ in ctx.agents.gpus]
        self._xgmi_peers: list[list[int]] = [[] for _ in ctx.agents.gpus]

    @property
    def engines(self) -> list[list[Blit]]:
        """Per GPU, the blits that have engine ids (offset 1 upwards), in engine-offset order."""
        return [blits[1:] for blits in self.blits]

    def copy_agent(self, dst_agent: Agent, src_agent: Agent) -> Agent:
        if src_agent.is_gpu:
            return src_agent
        if dst_agent.is_gpu:
            return dst_agent
        require(self.ctx.agents.gpus, T.HSA_STATUS_ERROR_INVALID_AGENT, "no GPU agent to copy with")
        return self.ctx.agents.gpus[0]

    # ---- the HSA functions -------------------------------------------------------------------
    def status(self, dst_agent: Agent, src_agent: Agent) -> int:
        """The engine-id mask of free engines for this direction (ROCr: GpuAgent::DmaCopyStatus)."""
        require(dst_agent is not src_agent, T.HSA_STATUS_ERROR_INVALID_AGENT,
                "copy engine status of an agent with itself")
        agent = self.copy_agent(dst_agent, src_agent)
        mask = 0
        if self._is_xgmi(dst_agent, src_agent):
            mask = sum(self._bit(XGMI_BASE + i) for i in range(self.num_xgmi) if self._free(agent, XGMI_BASE + i))
        else:
            h2d = src_agent.is_gpu is False and dst_agent.is_gpu
            if self._free(agent, HOST_TO_DEV) and (h2d or not self.limit_h2d):
                mask |= self._bit(HOST_TO_DEV)
            if self._free(agent, DEV_TO_HOST):
                mask |= self._bit(DEV_TO_HOST)
            for i in range(self.num_xgmi):
                if self._free(agent, XGMI_BASE + i):
                    mask |= self._bit(XGMI_BASE + i)
        require(mask, T.HSA_STATUS_ERROR_OUT_OF_RESOURCES, "no copy engine free")
        return mask

    def submit(self, dst: int, dst_agent: Agent, src: int, src_agent: Agent, size: int, deps: list[Signal],
               completion: Signal | None, engine_id: int | None = None, force_sdma: bool = False) -> None:
        """Queue a copy on the blit ROCr would use (``engine_id`` None: hsa_amd_memory_async_copy)."""
        agent = self.copy_agent(dst_agent, src_agent)
        offset = self._default_offset(agent, dst_agent, src_agent) if engine_id is None else \
            self._offset_on_engine(agent, dst_agent, src_agent, engine_id, force_sdma)
        self._check_reachable(agent, dst, size, True)
        self._check_reachable(agent, src, size, False)
        blit = self._get(agent, offset)
        name = _direction(dst_agent, src_agent)
        blit.submit(CopyJob(next(self._seq[agent.gpu]), dst, src, size, deps, completion, name))

    def evict(self, gpu: int) -> None:
        for blit in self.blits[gpu]:
            blit.evict()

    def shutdown(self) -> None:
        for blits in self.blits:
            for blit in blits:
                blit.stop()

    # ---- ROCr's rules ------------------------------------------------------------------------
    def _bit(self, offset: int) -> int:
        """The engine id of a blit offset (ROCr: ffs(engine_id) == offset; the device-to-host
        blit reports ENGINE_0 on a GPU with a single SDMA engine)."""
        if offset == DEV_TO_HOST and self.num_sdma == 1:
            return T.HSA_AMD_SDMA_ENGINE_0
        return 1 << (offset - 1)

    def _is_xgmi(self, dst_agent: Agent, src_agent: Agent) -> bool:
        return dst_agent.is_gpu and src_agent.is_gpu and dst_agent is not src_agent and self.num_xgmi > 0

    def _free(self, agent: Agent, offset: int) -> bool:
        """ROCr: GpuAgent::DmaEngineIsFree: never used, or an SDMA queue with nothing pending."""
        blit = self.blits[agent.gpu][offset]
        return not blit.created or (blit.is_sdma and blit.pending == 0)

    def _offset_on_engine(self, agent: Agent, dst_agent: Agent, src_agent: Agent, engine_id: int,
                          force_sdma: bool) -> int:
        """ROCr: Runtime::CopyMemoryOnEngine + GpuAgent::DmaCopyOnEngine's checks."""
        require(engine_id and engine_id & (engine_id - 1) == 0, T.HSA_STATUS_ERROR_INVALID_ARGUMENT,
                f"engine id 0x{engine_id:x} is not a single bit")
        offset = engine_id.bit_length()  # ffs()
        require(offset <= 2 + self.num_xgmi, T.HSA_STATUS_ERROR_INVALID_ARGUMENT,
                f"engine id 0x{engine_id:x} is not an engine of GPU {agent.gpu}")
        same = dst_agent is src_agent and dst_agent is agent
        if self.num_sdma == 0:
            return DEV_TO_DEV  # SDMA disabled: ROCr uses the blit kernel
        xgmi = self._is_xgmi(dst_agent, src_agent)
        h2d = not src_agent.is_gpu and dst_agent.is_gpu
        require(not (xgmi and offset < XGMI_BASE), T.HSA_STATUS_ERROR_INVALID_ARGUMENT,
                f"an xGMI peer copy cannot run on PCIe engine 0x{engine_id:x}")
        require(not (not h2d and not same and self.limit_h2d and offset == HOST_TO_DEV),
                T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "gfx90a: SDMA engine 0 serves host-to-device copies only")
        return DEV_TO_DEV if same and not force_sdma else offset

    def _default_offset(self, agent: Agent, dst_agent: Agent, src_agent: Agent) -> int:
        """ROCr: GpuAgent::GetBlitObject(dst, src, size) (gang copies not modelled)."""
        if dst_agent is src_agent and dst_agent is agent:
            return DEV_TO_DEV
        if self._is_xgmi(dst_agent, src_agent):
            peers = self._xgmi_peers[agent.gpu]
            if dst_agent.handle not in peers:
                peers.append(dst_agent.handle)
            return XGMI_BASE + peers.index(dst_agent.handle) % self.num_xgmi
        return HOST_TO_DEV if not src_agent.is_gpu and dst_agent.is_gpu else DEV_TO_HOST

    def _get(self, agent: Agent, offset: int) -> Blit:
        """ROCr: GetBlitObject: create the blit at first use; an SDMA queue that cannot be
        created (SDMA disabled or exhausted) is silently a blit kernel."""
        blit = self.blits[agent.gpu][offset]
        if not blit.created:
            wanted = offset != DEV_TO_DEV and self.num_sdma > 0
            exhausted = wanted and self.ctx.faults.sdma_exhausted(agent.gpu)
            if exhausted:
                self.ctx.faults.record(FaultRecord("sdma_exhausted", agent.gpu, None, None,
                                                   f"no SDMA queue for blit {offset}: it falls back to a kernel"))
            blit.create(sdma=wanted and not exhausted)
            if blit.is_sdma:  # ROCr: BlitSdma::Initialize makes two interrupt signals
                blit.events = [self.ctx.signals.events.take() for _ in range(2)]
        return blit

    def _check_reachable(self, agent: Agent, address: int, size: int, write: bool) -> None:
        try:
            self.ctx.memory.resolve(agent.gpu, address, size, write)
        except MemoryFault as fault:
            raise StatusError(T.HSA_STATUS_ERROR_INVALID_ARGUMENT, fault.reason) from fault


def _direction(dst_agent: Agent, src_agent: Agent) -> str:
    if src_agent.is_gpu and dst_agent.is_gpu:
        return "D2D" if src_agent is dst_agent else "P2P"
    return f"{'D' if src_agent.is_gpu else 'H'}2{'D' if dst_agent.is_gpu else 'H'}"
