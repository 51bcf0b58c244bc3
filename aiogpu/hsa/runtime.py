"""The HSA runtime: one HSA library (real ROCr or the emulator), its agents, the waiter, copies
on SDMA engines, joins as barrier-AND packets, fault handling, and what ``info`` prints."""
from __future__ import annotations

import ctypes
import itertools
from collections import deque
import threading
import weakref
from typing import Any, ClassVar, Sequence

import numpy as np

from ..errors import DeviceLost, GPUError
from ..futures import GPUFuture
from ..hsa_bindings import loader
from ..hsa_bindings import types as T
from ..memory import Buffer
from .queues import barrier_and_packets
from ..runtime import CopyOp, Runtime
from .signals import CompletionHub
from .device import HsaDevice
from .kernels import unload_kernel
from .memory import HostLocks

KERNARG_RING_BYTES = 256 << 10
# On by default: a completion that never comes (a lost interrupt, a memory fault ROCr does not
# report, work on a queue KFD keeps evicted) otherwise hangs its awaiters forever. It fails work
# whose completion stays silent this long after it could start; pass watchdog_s=None for kernels
# that run longer than this on their own (docs/rocr-model.md says why).
DEFAULT_WATCHDOG_S = 60.0
# Options that shape the emulated hardware; given to the real library they raise TypeError.
EMULATOR_OPTIONS = frozenset({"gpus", "rocr_version", "sdma_engines", "xgmi_engines", "compute_units", "eager",
                              "emulator_event_limit", "emulator_min_queue_size", "timeline_records",
                              "engine_history_records"})
# What shapes the virtual KFD beneath the real ROCr (hsa-virtual); the others are emulator-only.
VIRTUAL_OPTIONS = frozenset({"gpus", "eager", "sdma_queues"})


class HsaRuntime(Runtime):
    """aiogpu over the HSA API: AMD GPUs through ROCr, or the in-process emulator.

    Options beyond the core's: ``ring_size`` (AQL packets per queue ring, rounded up to a power
    of two and clamped to what the agent accepts, as ROCr needs; ValueError if not positive), and, for the
    emulator only, ``gpus``, ``rocr_version`` (``"5.2.3"``, the default, or ``"5.7"``: see
    ``EmulatedLibrary``), ``sdma_engines`` and ``xgmi_engines`` (engines per emulated GPU),
    ``compute_units``, ``eager`` (the packet processor reads a slot as soon as its header is
    valid), ``emulator_event_limit``, ``emulator_min_queue_size``, ``timeline_records`` and
    ``engine_history_records``. ``watchdog_s`` defaults to ``DEFAULT_WATCHDOG_S`` here.
    """

    backend = "hsa"
    OPTIONS: ClassVar[frozenset[str]] = Runtime.OPTIONS | {"ring_size"} | EMULATOR_OPTIONS | VIRTUAL_OPTIONS

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        api, why = loader.try_real()
        if api is None:
            return False, why
        api.shut_down()
        return True, why

    @classmethod
    def _default_choice(cls, requested: str | None) -> tuple[str, str]:
        if requested in ("hsa", "emulator", "hsa-virtual"):
            return requested, f"{requested} requested"
        ok, why = cls.probe()
        return ("hsa", why) if ok else ("emulator", f"no usable GPU ({why}); using the emulator")

    @classmethod
    def check_options(cls, backend: str, options: dict) -> None:
        super().check_options(backend, options)
        if backend == "hsa" and (EMULATOR_OPTIONS | VIRTUAL_OPTIONS) & set(options):
            raise TypeError(f"emulator-only option(s) "
                            f"{', '.join(sorted((EMULATOR_OPTIONS | VIRTUAL_OPTIONS) & set(options)))} "
                            f"given to the hsa backend (a real GPU)")
        if backend == "emulator" and "sdma_queues" in options:
            raise TypeError("sdma_queues is an option of the hsa-virtual backend (the emulator takes sdma_engines)")
        if backend == "hsa-virtual" and (EMULATOR_OPTIONS - VIRTUAL_OPTIONS) & set(options):
            raise TypeError(f"emulator-only option(s) "
                            f"{', '.join(sorted((EMULATOR_OPTIONS - VIRTUAL_OPTIONS) & set(options)))} given to "
                            f"hsa-virtual (it takes gpus, sdma_queues and eager)")

    def __init__(self, backend: str | None = None, *, queues_per_device: int = 2, ring_size: int = 1024,
                 watchdog_s: float | None = DEFAULT_WATCHDOG_S, copy_engines: bool = True, spin_s: float = 0.0,
                 **emulator_options: Any):
        self._check_shared_options(queues_per_device=queues_per_device, watchdog_s=watchdog_s, spin_s=spin_s,
                                  copy_engines=copy_engines)
        _check_positive("ring_size", ring_size, int)
        name, reason = self._chosen
        self.api = loader.load(name, reason, **emulator_options)
        try:
            self._init_core(CompletionHub(self.api, watchdog_s=watchdog_s, spin_s=spin_s),
                            copy_engines=copy_engines)
            self.reason = self.api.reason
            self._open(queues_per_device, ring_size)
        except BaseException:
            self._abandon()
            raise

    def _open(self, queues: int, ring: int) -> None:
        self._cpu, self._gpus = self._discover_agents()
        self._kernarg_pool, self._system_pool = self._host_pools()
        self._kernarg_blocks: list[int] = []
        self.host = HostLocks(self.api, self._all_agents)
        self.memory_faults: list[dict] = []
        self._faults_arrived: deque[tuple[int, int, int]] = deque()   # reported, not yet handled
        SYSTEM_EVENTS.attach(self)
        self.devices = [HsaDevice(self, i, agent, pool, queues=queues, ring=ring)
                        for i, (agent, pool) in enumerate(self._gpus)]
        self.hub.on_timeout = self._on_timeout
        for index, lost in SYSTEM_EVENTS.lost(self).items():   # earlier in this process
            if index < len(self.devices):
                with self.lock:
                    assert not self._lose(self.devices[index], lost)   # (nothing runs there yet)

    def _abandon(self) -> None:
        """A construction that failed part-way: stop the waiter and free what exists."""
        hub = getattr(self, "hub", None)
        if hub is not None:
            hub.close()
        for dev in getattr(self, "devices", []):
            dev._destroy()
        SYSTEM_EVENTS.detach(self)

    # -- discovery -----------------------------------------------------------------------------
    def _discover_agents(self) -> tuple[Any, list]:
        api, agents = self.api, []

        @T.agent_iterate_callback_t
        def visit(agent, _data):
            agents.append(T.hsa_agent_t(agent.handle))
            return T.HSA_STATUS_SUCCESS

        api.check(api.hsa_iterate_agents(visit, None), "hsa_iterate_agents")
        cpu, gpus = None, []
        for agent in agents:
            kind = ctypes.c_uint32()
            api.hsa_agent_get_info(agent, T.HSA_AGENT_INFO_DEVICE, ctypes.byref(kind))
            if kind.value == T.HSA_DEVICE_TYPE_CPU and cpu is None:
                cpu = agent
            elif kind.value == T.HSA_DEVICE_TYPE_GPU:
                pool = self._find_pool(agent, lambda flags: flags & T.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_COARSE_GRAINED)
                gpus.append((agent, pool))
        if cpu is None:
            raise RuntimeError("the HSA runtime reports no CPU agent")
        return cpu, gpus

    def _agent_pools(self, agent: Any) -> list[tuple[Any, int]]:
        """(pool, global flags) of every allocatable global pool of ``agent``."""
        api, out = self.api, []

        @T.pool_iterate_callback_t
        def visit(pool, _data):
            seg, flags, ok = ctypes.c_uint32(), ctypes.c_uint32(), ctypes.c_bool()
            api.hsa_amd_memory_pool_get_info(pool, T.HSA_AMD_MEMORY_POOL_INFO_SEGMENT, ctypes.byref(seg))
            api.hsa_amd_memory_pool_get_info(pool, T.HSA_AMD_MEMORY_POOL_INFO_GLOBAL_FLAGS, ctypes.byref(flags))
            api.hsa_amd_memory_pool_get_info(pool, T.HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALLOWED, ctypes.byref(ok))
            if seg.value == T.HSA_AMD_SEGMENT_GLOBAL and ok.value:
                out.append((T.hsa_amd_memory_pool_t(pool.handle), flags.value))
            return T.HSA_STATUS_SUCCESS

        api.check(api.hsa_amd_agent_iterate_memory_pools(agent, visit, None), "iterate memory pools")
        return out

    def _find_pool(self, agent: Any, want: Any) -> Any:
        for pool, flags in self._agent_pools(agent):
            if want(flags):
                return pool
        raise RuntimeError(f"no suitable memory pool on agent {self._agent_name(agent)}")

    def _host_pools(self) -> tuple[Any, Any]:
        kernarg = self._find_pool(self._cpu, lambda f: f & T.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_KERNARG_INIT)
        system = self._find_pool(self._cpu, lambda f: f & T.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_FINE_GRAINED)
        return kernarg, system

    def _agent_name(self, agent: Any) -> str:
        """The HSA agent's name (its ISA for GPUs, e.g. ``gfx90a``)."""
        name = ctypes.create_string_buffer(64)
        self.api.hsa_agent_get_info(agent, T.HSA_AGENT_INFO_NAME, name)
        return name.value.decode(errors="replace")

    def _gpu_agents(self) -> list:
        """The GPU agents, in device order."""
        return [agent for agent, _ in self._gpus]

    def _all_agents(self) -> list:
        """The CPU agent, then the GPU agents."""
        return [self._cpu, *self._gpu_agents()]

    def _kernarg_block(self, agent: Any) -> tuple[int, int]:
        """(address, size) of kernarg memory for one queue's ring, visible to every GPU agent
        (graph kernargs may serve every device)."""
        out = ctypes.c_void_p()
        self.api.check(self.api.hsa_amd_memory_pool_allocate(self._kernarg_pool, KERNARG_RING_BYTES, 0,
                                                             ctypes.byref(out)), "kernarg allocation")
        agents = self._gpu_agents()
        arr = (T.hsa_agent_t * len(agents))(*agents)
        self.api.check(self.api.hsa_amd_agents_allow_access(len(agents), arr, None, out.value),
                       "kernarg access")
        self._kernarg_blocks.append(out.value)
        return out.value, KERNARG_RING_BYTES

    def _release_kernarg_block(self, address: int) -> None:
        """Free a block of ``_kernarg_block`` before the runtime's close (under the lock; the
        caller guarantees that no packet reads it any more)."""
        self._kernarg_blocks.remove(address)
        self.api.check(self.api.hsa_amd_memory_pool_free(address), "kernarg free")

    def _agent_of(self, side: Any) -> Any:
        """The agent owning a copy side's memory (the CPU agent for host memory)."""
        return self._cpu if side.host else side.device.agent

    # -- hooks: host memory and copies -----------------------------------------------------------
    def _pin_host(self, address: int, size: int) -> int:
        """``hsa_amd_memory_lock`` for every agent; the agents' address of the memory."""
        return self.host.register(address, size)

    def _unpin_host(self, address: int) -> None:
        self.api.hsa_amd_memory_unlock(address)

    def _host_pointers(self, op: CopyOp) -> None:
        """Host sides outside the pinned pool are locked for the agents (pageable memory, not
        GTT) and unlocked when the copy retires."""
        for side in (op.dst, op.src):
            if side.host and side.ptr is None:
                addr, n = side.obj.__array_interface__["data"][0], side.obj.nbytes
                side.ptr = self.host.lock(addr, n, side.obj)
                op.cleanup.append(lambda a=addr, n=n: self.host.unlock(a, n))

    def _crowded(self) -> bool:
        """Whether any queue of the runtime has a back-log (``CopyEngines``: ROCr's copy queues
        then keep room; under lock)."""
        return any(q.backlog for d in self.devices for q in d.queues)

    def _engine_may_take(self, op: CopyOp) -> bool:
        return op.device.engines.may_take(self._agent_of(op.dst), self._agent_of(op.src))

    def _copy_lane(self, op: CopyOp, deps: dict) -> Any:
        """One of the device's SDMA engines (source device for peer copies and device-to-host,
        destination for host-to-device) that can take the copy now; None when none can."""
        return op.device.engines.pick(self._agent_of(op.dst), self._agent_of(op.src))

    def _encode_copy(self, fut: GPUFuture, op: CopyOp, lane: Any, waits: Sequence,
                     cleanup: list) -> list[int] | None:
        """The copy on engine ``lane`` after ``waits`` (``hsa_amd_memory_async_copy`` names
        their signals); None when the engine ran out between status and submit, or refused the
        copy (a shader copies it). An engine that refuses it with another error raises it: the
        copy fails (what it would have written reads as failed)."""
        device: HsaDevice = op.device
        signals = [d.signal for d in waits]
        try:
            name = device.engines.submit(lane, op.dst.ptr, self._agent_of(op.dst), op.src.ptr,
                                         self._agent_of(op.src), op.nbytes, signals, fut.signal, cleanup)
        except GPUError as exc:
            err = GPUError(f"{op.label}: {exc}", status=exc.status, queue=device.name)
            err.__cause__ = exc
            raise err from exc
        if name is None:
            return None
        fut.queue = name
        return signals

    # -- hooks: joins and graphs ------------------------------------------------------------------
    def _join_lane(self, device: Any, live: list, deps: dict) -> Any:
        """The device's first queue (a working device's, when this one is lost: the join only
        orders)."""
        if device.broken is not None:
            device = next((d for d in self.devices if d.broken is None), device)
        return device.queues[0]

    def _encode_join(self, fut: GPUFuture, lane: Any, waits: Sequence, cleanup: list) -> list[int]:
        """A barrier-AND packet (chained five signals at a time) waiting for every one of
        ``waits``."""
        fut.lane = lane
        signals = [d.signal for d in waits]
        lane.device._encode_group(fut, lane, barrier_and_packets(signals, fut.signal), cleanup)
        return signals

    def _instantiate(self, graph: Any) -> Any:
        from .graph import HsaGraphExec
        return HsaGraphExec(graph)

    # -- faults --------------------------------------------------------------------------------
    def _on_system_event(self, event_ptr: Any, _data: Any) -> int:
        # Runs on a driver thread: copy the facts out and hand over to the waiter thread.
        ev = event_ptr.contents
        if ev.event_type == T.HSA_AMD_GPU_MEMORY_FAULT_EVENT:
            self._faults_arrived.append(
                (ev.memory_fault.agent.handle, ev.memory_fault.virtual_address, ev.memory_fault.fault_reason_mask))
            self.hub.post_event(self._handle_reported_faults)
        return T.HSA_STATUS_SUCCESS

    def _handle_reported_faults(self) -> list:
        """Handle the memory faults ROCr has reported and nobody has handled yet (each once):
        the waiter thread does, and so does anything that is about to ask ROCr for what a lost
        device never finishes (loading code: ``HsaDevice._load``), so that it finds the device
        lost instead of waiting forever. (A fault that has struck but whose report ROCr has not
        delivered yet cannot be known here.)"""
        # Taken off under the lock: a report the waiter has taken is handled before any loader
        # that holds the lock can look (the waiter waits for the lock first).
        failed: list = []
        with self.lock:
            arrived = self._faults_arrived
            while arrived:
                failed += self._on_memory_fault(*arrived.popleft())
        return failed

    def _on_memory_fault(self, agent: int, address: int, reason: int) -> list:
        """A GPU memory fault on ``agent`` (waiter thread): the device is lost; the failure
        report of its work.

        ROCr reports the fault only through this system event, never through a queue callback
        (Runtime::VMFaultHandler), and KFD has evicted every queue of the process on that device,
        its SDMA queues included (``kfd_dqm_evict_pasid``). The eviction lasts until the process
        exits: queues created later are created evicted (KFD ``create_queue`` while
        ``qpd->evicted``), and ROCr never recreates its copy queues, so even loading a kernel
        there (``hsa_executable_freeze`` copies the code through them) would wait forever. Work
        that completed before is settled as done; everything else pending on the device fails
        with DeviceLost (what touched ``address`` is named as the cause of the fault), and so
        does work elsewhere that depends on it; every later operation on the device fails at
        once (``Device.broken``). Other devices go on. The loss is recorded for the process, so
        a later runtime on the same library finds the device lost too."""
        with self.lock:
            self.memory_faults.append({"agent": agent, "address": address, "reason": reason})
            dev = next((d for d in self.devices if d.agent.handle == agent), None)
            if dev is None or isinstance(dev.broken, DeviceLost):
                return []
            status = T.HSA_STATUS_ERROR_MEMORY_FAULT
            # The emulator can say what faulted (a kernel body's access); ROCr gives the address.
            cause = self.api.emulator.memory_fault_cause(address) if self.api.emulator else None
            lost = DeviceLost(f"{dev.name} was lost to a GPU memory fault at 0x{address:x} (reason 0x{reason:x}): "
                              f"the driver keeps this process's queues on it evicted, so nothing more runs there; "
                              f"only a new process recovers it", status=status)
            lost.__cause__ = cause
            SYSTEM_EVENTS.lose(self, dev.index, lost)
            return self._lose(dev, lost, address)

    def _lose(self, dev: HsaDevice, lost: DeviceLost, address: int | None = None) -> list:
        """Mark ``dev`` lost with ``lost`` (under the lock): the failure report of everything
        pending on it. What touched ``address`` (the fault's) is named as its cause."""
        status = lost.status
        dev.broken = lost
        dev.engines.lose()
        mine = [f for f in self.hub.pending_futures() if f.device is dev and f.signal]
        self.hub.settle_completed(mine)
        mine = [f for f in mine if not f.retired]
        host_address = self.host.to_host(address) if address is not None else None   # a locked array's agent address
        failed = []
        for fut in mine:
            if not fut.done() and address is not None and any(
                    _touches(k, address) or host_address is not None and _touches(k, host_address) for k in fut.keep):
                err = DeviceLost(f"{fut.label}: GPU memory fault at 0x{address:x}; {lost}",
                                 status=status, queue=fut.queue, packet=fut.packet)
                err.__cause__ = lost.__cause__
                failed.append((fut, err, True))     # (its queue's abort below retires it)
        for fut in mine:
            if dev.engines.runs(fut.queue):
                err = DeviceLost(f"{fut.label}: {lost}", status=status, queue=fut.queue)
                err.__cause__ = lost
                failed.append((fut, err, False))
        for queue in dev.queues:
            failed += queue.abort(lost, -1, lost=lost)
        named = {f for f, _, runs in failed if not runs}
        for fut in mine:        # anything else of the device (a join)
            if fut not in named:
                err = DeviceLost(f"{fut.label}: {lost}", status=status, queue=fut.queue)
                err.__cause__ = lost
                failed.append((fut, err, False))
        return failed

    def _on_timeout(self, fut: GPUFuture, exc: GPUError) -> list | None:
        """A lost or stalled completion on a compute queue: abort that queue, so that what its
        packets held is freed and the device stays usable (the abort's failure report). Copies
        are left to the hub, which quarantines them (an engine cannot be aborted): None."""
        for dev in self.devices:
            for queue in dev.queues:
                if fut in queue.inflight:
                    return queue.abort(exc, queue.inflight[fut][1])
                if any(group.future is fut for group in queue.backlog):
                    return queue.abort(exc, -1)    # stuck behind a silent packet: the queue is wedged
        return None

    # -- stats, description, shutdown ------------------------------------------------------------
    def _backend_stats(self) -> dict:
        queues = [q for d in self.devices for q in d.queues]
        return {
            "signals_in_use": self.hub.pool.in_use,
            "kernarg_in_use": sum(q.kernarg.in_use for q in queues),
            "copy_room_in_use": sum(d.engines.room_in_use for d in self.devices),
            "backlog": sum(len(q.backlog) for q in queues),
            "host_locks": self.host.count,
            "kernarg_blocks": len(self._kernarg_blocks),   # queues' rings and graphs' kernargs
            # How copies ran: per engine name (gpu0.sdma1 chosen by aiogpu, gpu0.rocr-h2d chosen by
            # ROCr), and "shader" for aiogpu's own copy kernel.
            "copies": {**{k: v for d in self.devices for k, v in sorted(d.engines.counts.items())},
                       "shader": self.shader_copies},
            **({"vkfd": {f"gpu{i}": self.api.vkfd.counters(i) for i in range(len(self.devices))}}
               if self.api.vkfd is not None else {}),
        }

    def describe(self) -> str:
        """The backend, why, the optional HSA calls, and every agent with its pools, queues and
        copy engines."""
        api = self.api
        optional = "all present" if not api.missing else "absent: " + ", ".join(api.missing)
        lines = [super().describe(), f"optional HSA calls: {optional}"]
        if api.vkfd is not None:
            vk = api.vkfd
            lines.append(f"virtual KFD: {vk.version}; {vk.gpus} GPU(s), {vk.kfd.vkfd_sdma_limit(0)} SDMA "
                         f"queue(s) per GPU, {'eager' if vk.kfd.vkfd_eager() else 'doorbell-driven'} "
                         f"command processor")
        if api.emulator is not None:
            lines.append(f"emulated ROCr release: {api.emulator.rocr_version}")
        for agent in self._all_agents():
            lines.append(self._describe_agent(agent))
            for dev in self.devices:
                if dev.agent.handle == agent.handle:
                    lines.append(f"    queues: {', '.join(f'{q.name} (ring {q.size})' for q in dev.queues)}")
                    if dev.engines.lost:
                        lines.append("    copies: shader copies (SDMA queues lost to a memory fault)")
                    elif dev.engines.rocr_picks:
                        lines.append("    copies: hsa_amd_memory_async_copy (no engine calls in this ROCr: "
                                     "its SDMA queues, or its blit kernels where it has none)")
                    else:
                        h2d = dev.engines.free_engines(agent, self._cpu)    # per direction (an agent
                        d2h = dev.engines.free_engines(self._cpu, agent)    # with itself is invalid)
                        lines.append(f"    copies: hsa_amd_memory_async_copy_on_engine; SDMA engines free: "
                                     f"host-to-device {len(h2d)}, device-to-host {len(d2h)}")
        return "\n".join(lines)

    def _describe_agent(self, agent: Any) -> str:
        api = self.api
        kind = ctypes.c_uint32()
        api.hsa_agent_get_info(agent, T.HSA_AGENT_INFO_DEVICE, ctypes.byref(kind))
        product = ctypes.create_string_buffer(64)
        api.hsa_agent_get_info(agent, T.HSA_AMD_AGENT_INFO_PRODUCT_NAME, product)
        kind_name = {T.HSA_DEVICE_TYPE_CPU: "CPU", T.HSA_DEVICE_TYPE_GPU: "GPU"}.get(kind.value, "DSP")
        lines = [f"agent {self._agent_name(agent)} [{kind_name}] {product.value.decode(errors='replace')}"]
        for pool, flags in self._agent_pools(agent):
            size = ctypes.c_size_t()
            api.hsa_amd_memory_pool_get_info(pool, T.HSA_AMD_MEMORY_POOL_INFO_SIZE, ctypes.byref(size))
            kinds = [n for bit, n in ((1, "kernarg"), (2, "fine-grained"), (4, "coarse-grained")) if flags & bit]
            lines.append(f"    pool {'/'.join(kinds)}: {size.value / 2**30:.1f} GiB")
        return "\n".join(lines)

    def _release(self) -> None:
        for dev in self.devices:
            dev._destroy()          # queues first: no packet reads a signal or kernarg after
        for dev in self.devices:    # then the executables, and with them their code objects' memory
            for loaded in dev._kernels.values():
                unload_kernel(self.api, loaded)
            dev._kernels.clear()
        for block in self._kernarg_blocks:
            self.api.hsa_amd_memory_pool_free(block)
        self.hub.close()
        SYSTEM_EVENTS.detach(self)     # last: balances the hsa_init this runtime's library made


class _SystemEvents:
    """The process's one ROCr system-event handler per initialised HSA library, and the
    balance of each runtime's ``hsa_init`` with ``hsa_shut_down``.

    ROCr keeps every handler given to ``hsa_amd_register_system_event_handler`` until its last
    ``hsa_shut_down`` destroys the runtime (Runtime::SetCustomSystemEventHandler appends to
    ``system_event_handlers_``; 5.2.3 has no call that removes one). A C callback per Runtime
    would dangle once that Runtime is collected, so one callback, alive as long as this module,
    is registered once per initialisation of a library (by the first runtime on it), and hands
    each event to the live runtimes on that library (held weakly: a collected runtime is simply
    not called; a closed one has left). Every runtime holds one ``hsa_init`` of its library
    (made by ``loader``); ``detach`` gives it back. ROCr counts those references: when aiogpu's
    last one is given back the library is shut down unless someone else in the process still
    holds one (``hsa_system_get_info`` then still answers), and the next runtime registers the
    callback again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()              # the registry (the callback takes it)
        self._opening = threading.Lock()           # attach/detach, shut-down included
        self._serials = itertools.count(1)
        self._libraries: dict[Any, dict] = {}       # library key -> its entry
        self._by_serial: dict[int, dict] = {}       # the callback's user data -> the entry
        self.callback = T.system_event_callback_t(self._on_event)

    @staticmethod
    def _key(api: Any) -> Any:
        # The real library: its dlopen handle (one ROCr per process, however often loaded);
        # the emulator: the object, one emulated process each; hsa-virtual: the ROCr handle and
        # the virtual KFD's open (each time ROCr reopens it, it is a fresh process to the KFD:
        # docs/rocr-model.md).
        handle = getattr(api.library, "_handle", None)
        if getattr(api, "vkfd", None) is not None:
            return (handle, api.vkfd.generation)
        return handle if handle is not None else id(api.library)

    def attach(self, rt: "HsaRuntime") -> None:
        """``rt`` receives its library's system events from now on; registers the callback
        if nobody on this library has since it was initialised. HsaError if ROCr refuses."""
        api, key = rt.api, self._key(rt.api)
        with self._opening, self._lock:
            entry = self._libraries.get(key)
            if entry is None:
                entry = {"serial": next(self._serials), "registered": False, "opens": 0,
                         "runtimes": weakref.WeakSet(), "lost": {}}
                self._libraries[key] = entry
                self._by_serial[entry["serial"]] = entry
                if getattr(api.library, "_handle", None) is None:   # an emulator: forget it with it
                    weakref.finalize(api.library, self._forget, key)
            if not entry["registered"]:
                api.check(api.hsa_amd_register_system_event_handler(self.callback, entry["serial"]),
                          "hsa_amd_register_system_event_handler")
                entry["registered"] = True
            entry["opens"] += 1
            entry["runtimes"].add(rt)
            rt._events_attached = True

    def detach(self, rt: "HsaRuntime") -> None:
        """``rt`` is closing (its queues are destroyed and its waiter stopped): it receives no
        more events, and its ``hsa_init`` is balanced by ``hsa_shut_down`` (also where
        ``attach`` was never reached: a construction that failed part-way). Idempotent."""
        api, key = rt.api, self._key(rt.api)
        with self._opening:
            with self._lock:
                if getattr(rt, "_events_shut_down", False):
                    return
                rt._events_shut_down = True
                entry = self._libraries.get(key)
                if entry is not None and getattr(rt, "_events_attached", False):
                    entry["runtimes"].discard(rt)
                    entry["opens"] -= 1
            # Without the registry's lock: ROCr's shut-down joins its event thread, which may be
            # in the callback.
            api.hsa_shut_down()
            if entry is not None and entry["opens"] <= 0:
                # Still initialised (another holder's hsa_init): ROCr keeps the handler.
                major = ctypes.c_uint16()
                entry["registered"] = api.hsa_system_get_info(
                    T.HSA_SYSTEM_INFO_VERSION_MAJOR, ctypes.byref(major)) == T.HSA_STATUS_SUCCESS

    def lose(self, rt: "HsaRuntime", index: int, lost: DeviceLost) -> None:
        """Device ``index`` of ``rt``'s library is lost for the rest of the process (KFD keeps
        the process evicted there, whatever runtime or init cycle comes next)."""
        with self._lock:
            entry = self._libraries.get(self._key(rt.api))
            if entry is not None:
                entry["lost"].setdefault(index, lost)

    def lost(self, rt: "HsaRuntime") -> dict[int, DeviceLost]:
        """The devices of ``rt``'s library lost earlier in this process, by index."""
        with self._lock:
            entry = self._libraries.get(self._key(rt.api))
            return dict(entry["lost"]) if entry is not None else {}

    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._libraries.pop(key, None)
            if entry is not None:
                self._by_serial.pop(entry["serial"], None)

    def _on_event(self, event_ptr: Any, data: Any) -> int:
        # A driver thread: find the live runtimes and let each copy out what concerns it.
        with self._lock:
            entry = self._by_serial.get(data or 0)
            runtimes = list(entry["runtimes"]) if entry is not None else []
        for rt in runtimes:
            try:
                rt._on_system_event(event_ptr, None)
            except Exception:  # noqa: BLE001 - one runtime's trouble must not hide the event from the others
                pass
        # No runtime of aiogpu's on this library: the event is not ours to take (for a memory
        # fault ROCr then reports it and aborts, as it does for a process without handlers).
        return T.HSA_STATUS_SUCCESS if runtimes else T.HSA_STATUS_ERROR


# Module level, never freed: ROCr may call the callback until the process exits.
SYSTEM_EVENTS = _SystemEvents()


def _check_positive(name: str, value: Any, kind: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def _touches(obj: Any, address: int) -> bool:
    if isinstance(obj, Buffer):
        return obj.address <= address < obj.address + obj.nbytes
    if isinstance(obj, np.ndarray):
        base = obj.__array_interface__["data"][0]
        return base <= address < base + obj.nbytes
    return False
