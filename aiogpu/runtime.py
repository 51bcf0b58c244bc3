"""The runtime: one HSA library (real or emulated), its GPUs, the waiter, copies and joins.

``aiogpu.devices()`` and ``aiogpu.runtime()`` use a process-wide default runtime; tests and
applications that want isolation create ``Runtime(...)`` objects of their own.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any, Iterable

import numpy as np

from . import capture as _capture
from . import ordering
from .device import Device, check_after, prepare_join
from .errors import GPUError, RuntimeClosedError
from .hsa_bindings import loader
from .hsa_bindings import types as T
from .kernels import copy_kernel, fill_kernel
from .memory import Buffer, HostLocks
from .queues import PacketGroup, barrier_and_packets
from .futures import GPUFuture
from .signals import CompletionHub

KERNARG_RING_BYTES = 256 << 10
# On by default: a completion that never comes (a lost interrupt, a memory fault ROCr does not
# report, work on a queue KFD keeps evicted) otherwise hangs its awaiters forever. It fails work
# whose lane (queue or engine) completed nothing for this long although it could run; pass
# watchdog_s=None for kernels that run longer than this on their own.
DEFAULT_WATCHDOG_S = 60.0


BACKENDS = ("hsa", "emulator", "cuda")


def resolve_backend(backend: str | None) -> str | None:
    """The backend asked for (argument, else AIOGPU_BACKEND), or None for auto."""
    backend = backend or os.environ.get("AIOGPU_BACKEND") or None
    if backend not in (None, "auto", *BACKENDS):
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return None if backend == "auto" else backend


def cuda_available() -> tuple[bool, str]:
    """Whether the CUDA backend can run here, and why not."""
    try:
        from .cuda import probe
    except ImportError as exc:
        return False, f"aiogpu.cuda unavailable ({exc})"
    return probe()


class Runtime:
    """A GPU runtime over one backend. ``close()`` waits for submitted work, then frees all.

    ``Runtime("cuda")`` (or auto-selection finding an NVIDIA GPU) returns the CUDA runtime, which
    has the same interface; otherwise this HSA runtime, on ROCr or the emulator.
    """

    def __new__(cls, backend: str | None = None, **options: Any) -> Any:
        if cls is Runtime:
            chosen = resolve_backend(backend)
            if chosen == "cuda" or (chosen is None and _auto_prefers_cuda()):
                from .cuda.runtime import CudaRuntime
                return CudaRuntime(**{k: v for k, v in options.items() if k in CudaRuntime.OPTIONS})
        return super().__new__(cls)

    def __init__(self, backend: str | None = None, *, queues_per_device: int = 2, ring_size: int = 1024,
                 watchdog_s: float | None = DEFAULT_WATCHDOG_S, **emulator_options: Any):
        self.api = loader.load(resolve_backend(backend), **emulator_options)
        self.backend = self.api.backend
        self.reason = self.api.reason
        self.closed = False
        self.hub = CompletionHub(self.api, watchdog_s=watchdog_s)
        self.hub.owner = self
        self.lock = self.hub.lock
        self.hazards = ordering.Hazards()
        self._cpu, self._gpus = self._discover_agents()
        self._kernarg_pool, self._system_pool = self._host_pools()
        self._kernarg_blocks: list[int] = []
        self.host = HostLocks(self.api, self.all_agents)
        self._event_cb = T.system_event_callback_t(self._on_system_event)
        self.api.hsa_amd_register_system_event_handler(self._event_cb, None)
        self.devices = [Device(self, i, agent, pool, queues=queues_per_device, ring=ring_size,
                               kernarg_pool=self._kernarg_pool)
                        for i, (agent, pool) in enumerate(self._gpus)]
        self.memory_faults: list[dict] = []
        self.hub.on_timeout = self._on_timeout

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

    def pools(self, agent: Any) -> list[tuple[Any, int]]:
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
        for pool, flags in self.pools(agent):
            if want(flags):
                return pool
        raise RuntimeError(f"no suitable memory pool on agent {self.agent_name(agent)}")

    def _host_pools(self) -> tuple[Any, Any]:
        kernarg = self._find_pool(self._cpu, lambda f: f & T.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_KERNARG_INIT)
        system = self._find_pool(self._cpu, lambda f: f & T.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_FINE_GRAINED)
        return kernarg, system

    def agent_name(self, agent: Any) -> str:
        """The HSA agent's name (its ISA for GPUs, e.g. ``gfx90a``)."""
        name = ctypes.create_string_buffer(64)
        self.api.hsa_agent_get_info(agent, T.HSA_AGENT_INFO_NAME, name)
        return name.value.decode(errors="replace")

    def gpu_agents(self) -> list:
        """The GPU agents, in device order."""
        return [agent for agent, _ in self._gpus]

    def all_agents(self) -> list:
        """The CPU agent, then the GPU agents."""
        return [self._cpu, *self.gpu_agents()]

    def kernarg_block(self, agent: Any) -> tuple[int, int]:
        """(address, size) of kernarg memory for one queue's ring, visible to ``agent``."""
        out = ctypes.c_void_p()
        self.api.check(self.api.hsa_amd_memory_pool_allocate(self._kernarg_pool, KERNARG_RING_BYTES, 0,
                                                             ctypes.byref(out)), "kernarg allocation")
        agents = self.gpu_agents()   # graph kernargs may serve every device
        arr = (T.hsa_agent_t * len(agents))(*agents)
        self.api.check(self.api.hsa_amd_agents_allow_access(len(agents), arr, None, out.value),
                       "kernarg access")
        self._kernarg_blocks.append(out.value)
        return out.value, KERNARG_RING_BYTES

    # -- state ---------------------------------------------------------------------------------
    def check_open(self) -> None:
        """Raise RuntimeClosedError once ``close()`` has begun."""
        if self.closed:
            raise RuntimeClosedError("the aiogpu runtime is closed")

    def capturing(self) -> Any:
        """The graph capturing this runtime's operations in this context, else None."""
        return _capture.current(self)

    def stats(self) -> dict:
        """Counters that return to their baseline when no work is pending (leak checks)."""
        with self.lock:
            return {
                "pending": self.hub.pending_count,
                "signals_in_use": self.hub.pool.in_use,
                "kernarg_in_use": sum(q.kernarg.in_use for d in self.devices for q in d.queues),
                "backlog": sum(len(q.backlog) for d in self.devices for q in d.queues),
                "host_locks": self.host.count,
                "host_ranges": self.hazards.host_ranges,
                "small_allocations": sum(d.memory.small.used for d in self.devices),
                "large_allocations": sum(len(d.memory.large) for d in self.devices),
            }

    # -- copies --------------------------------------------------------------------------------
    def copy(self, dst: Any, src: Any, after: Iterable[GPUFuture] = ()) -> GPUFuture:
        """See ``aiogpu.copy``."""
        nbytes = _check_copy(dst, src)
        after = check_after(self, after)
        capture = self.capturing()
        if capture is not None:
            return capture.record_copy(dst, src, after)
        with self.lock:
            self.check_open()
            return self._submit_copy(dst, src, nbytes, after)

    def _submit_copy(self, dst: Any, src: Any, nbytes: int, after: list) -> GPUFuture:
        dst_state, dst_ptr, dst_agent, keep = self._side(dst)
        src_state, src_ptr, src_agent, keep2 = self._side(src)
        device = src.device if isinstance(src, Buffer) else dst.device   # the engine's device
        label = f"copy {_where(src)}->{_where(dst)} {nbytes} B"
        deps = ordering.dependencies([src_state], [dst_state], after)
        err = ordering.failed_dependency(deps)
        if err is not None:
            return ordering.failed_without_running(self.hub, label, err, [dst_state])
        host_ranges = [(a, n, side) for side in (dst, src) for a, n in [_host_key(side)] if a]
        pins = [(a, n, self.host.lock(a, n, side)) for a, n, side in host_ranges]
        if dst_ptr is None:
            dst_ptr = pins[0][2]
        if src_ptr is None:
            src_ptr = pins[-1][2]
        unlock = lambda: [self.host.unlock(a, n) for a, n, _ in pins]  # noqa: E731
        engine = device.engines.pick(dst_agent, src_agent)
        if engine is not None:
            fut = self.hub.new_future(label)
            fut.device, fut.kind, fut.nbytes = device, "copy", nbytes
            live = [d for d in deps if not d.retired]
            for dep in live:
                self.hub.depend(fut, dep, semantic=deps[dep])
            name = device.engines.submit(engine, dst_ptr, dst_agent, src_ptr, src_agent, nbytes,
                                         [d.signal for d in live], fut.signal)
            if name is not None:
                fut.queue = name
                device._track(fut, None, [src_state], [dst_state], keep + keep2, live)
                fut._cleanup.append(unlock)
                return fut
            for dep in live:           # the engine ran out between status and submit
                if fut in dep._dependents:
                    dep._dependents.remove(fut)
            self.hub.discard(fut)
        # No SDMA engine: the built-in copy kernel on the device's compute queue.
        shader = device.dispatch(device.loaded(copy_kernel), label + " (shader)", (max(nbytes, 1),), (256,),
                                 [dst_ptr, src_ptr, nbytes], [nbytes, nbytes], [], [], after,
                                 extra_reads=[src_state], extra_writes=[dst_state], keep=keep + keep2)
        shader.kind, shader.nbytes = "copy", nbytes
        if shader.retired:
            unlock()
        else:
            shader._cleanup.append(unlock)
        return shader

    def _side(self, side: Any) -> tuple[Any, int | None, Any, list]:
        """(ordering state, device pointer or None for host, agent, objects to keep alive)."""
        if isinstance(side, Buffer):
            return side, side.address, side.device.agent, [side]
        addr = side.__array_interface__["data"][0]
        return self.hazards.host(addr, side.nbytes), None, self._cpu, [side]

    def fill(self, buf: Buffer, value: int, after: Iterable[GPUFuture] = ()) -> GPUFuture:
        """See ``Buffer.fill``: the built-in fill kernel over the buffer's 32-bit words."""
        return buf.device.launch(fill_kernel, (max(buf.nbytes // 4, 1),), (256,),
                                 (buf, int(value) & 0xFFFFFFFF, buf.nbytes // 4), after=after)

    # -- joins ---------------------------------------------------------------------------------
    def gather(self, futures: Iterable[GPUFuture]) -> GPUFuture:
        """One future for all of ``futures``: a barrier-AND on the device where possible."""
        futures = check_after(self, list(futures))
        capture = self.capturing()
        if capture is not None:
            return capture.record_gather(futures)
        with self.lock:
            settled, live, _deps = prepare_join(self, futures)
            if settled is not None:
                return settled
            device = next((f.device for f in live if f.device is not None), self.devices[0])
            queue = device.queues[0]
            fut = self.hub.new_future(f"gather of {len(futures)}")
            fut.device, fut.kind = device, "join"
            for dep in live:
                self.hub.depend(fut, dep)
            packets = barrier_and_packets([d.signal for d in live], fut.signal)
            device._track(fut, queue, [], [], [], live)
            queue.submit(PacketGroup([p for p, _ in packets], [h for _, h in packets], fut))
            return fut

    # -- faults --------------------------------------------------------------------------------
    def _on_system_event(self, event_ptr: Any, _data: Any) -> int:
        # Runs on a driver thread: copy the facts out and hand over to the waiter thread.
        ev = event_ptr.contents
        if ev.event_type == T.HSA_AMD_GPU_MEMORY_FAULT_EVENT:
            info = (ev.memory_fault.agent.handle, ev.memory_fault.virtual_address, ev.memory_fault.fault_reason_mask)
            self.hub.post_event(lambda: self._on_memory_fault(*info))
        return T.HSA_STATUS_SUCCESS

    def _on_memory_fault(self, agent: int, address: int, reason: int) -> None:
        """A GPU memory fault on ``agent`` (waiter thread). ROCr reports it only through this
        system event, never through a queue callback, and KFD has evicted every queue of the
        process on that device (its SDMA queues included): nothing pending there will complete.
        Work that completed before is settled as done; the rest fails (what touched ``address``
        is named as the cause), and so does work elsewhere that depends on it. The device's
        compute queues are recreated; its SDMA engines, which ROCr never recreates, are no
        longer used (its copies run as shader copies)."""
        with self.lock:
            self.memory_faults.append({"agent": agent, "address": address, "reason": reason})
            dev = next((d for d in self.devices if d.agent.handle == agent), None)
            if dev is None:
                return
            status = T.HSA_STATUS_ERROR_MEMORY_FAULT
            mine = [f for f in self.hub.pending_futures() if f.device is dev and f.signal]
            self.hub._settle([(f.signal, f) for f in mine if self.hub.is_complete(f.signal)])
            host_address = self.host.to_host(address)   # a locked array's agent address
            for fut in mine:
                if not fut.done() and any(_touches(k, address) or host_address is not None
                                          and _touches(k, host_address) for k in fut.keep):
                    self.hub.fail(fut, GPUError(f"{fut.label}: GPU memory fault at 0x{address:x} (reason "
                                                f"0x{reason:x})", status=status, queue=fut.queue, packet=fut.packet))
            evicted = GPUError(f"{dev.name}: the driver evicted the device's queues after a GPU memory fault at "
                               f"0x{address:x} (reason 0x{reason:x})", status=status)
            dev.engines.lose()
            for fut in mine:
                if not fut.retired and ".sdma" in (fut.queue or ""):
                    self.hub.fail(fut, GPUError(f"{fut.label}: {evicted}", status=status, queue=fut.queue))
                    self.hub.retire_failed(fut)
            for queue in dev.queues:
                queue.abort(evicted, -1)

    def _on_timeout(self, fut: GPUFuture, exc: GPUError) -> bool:
        """A lost or stalled completion on a compute queue: abort that queue, so that what its
        packets held is freed and the device stays usable. Copies are left to the hub, which
        quarantines them (an engine cannot be aborted)."""
        for dev in self.devices:
            for queue in dev.queues:
                if fut in queue.inflight:
                    queue.abort(exc, queue.inflight[fut][1])
                    return True
                if any(group.future is fut for group in queue.backlog):
                    queue.abort(exc, -1)    # stuck behind a silent packet: the queue is wedged
                    return True
        return False

    # -- shutdown ------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Wait (up to ``timeout`` s) for submitted work, then release every resource."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        deadline = time.monotonic() + timeout
        while self.hub.pending_count and time.monotonic() < deadline:
            time.sleep(0.005)
        self.hub.close()
        for dev in self.devices:
            for q in dev.queues:
                q.destroy()
        for block in self._kernarg_blocks:
            self.api.hsa_amd_memory_pool_free(block)
        if self.backend == "emulator":
            self.api.hsa_shut_down()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Runtime {self.backend}: {len(self.devices)} GPU(s)>"


def _auto_prefers_cuda() -> bool:
    """Auto-selection: a real HSA GPU first, then an NVIDIA GPU, else the emulator."""
    api, _why = loader.try_real()
    if api is not None:
        api.shut_down()
        return False
    return cuda_available()[0]


def _where(side: Any) -> str:
    return side.device.name if isinstance(side, Buffer) else "host"


def _host_key(side: Any) -> tuple[int, int]:
    if isinstance(side, Buffer):
        return 0, 0
    return side.__array_interface__["data"][0], side.nbytes


def _touches(obj: Any, address: int) -> bool:
    if isinstance(obj, Buffer):
        return obj.address <= address < obj.address + obj.nbytes
    if isinstance(obj, np.ndarray):
        base = obj.__array_interface__["data"][0]
        return base <= address < base + obj.nbytes
    return False


def _check_copy(dst: Any, src: Any) -> int:
    """Validate a copy's two sides; returns the byte count."""
    for name, side in (("dst", dst), ("src", src)):
        if isinstance(side, Buffer):
            side.check_usable()
        elif isinstance(side, np.ndarray):
            if not side.flags.c_contiguous:
                raise ValueError(f"copy {name}: the NumPy array must be C-contiguous")
            if side.nbytes == 0:
                raise ValueError(f"copy {name}: the array is empty")
        else:
            raise TypeError(f"copy {name} must be a Buffer or a NumPy array, got {type(side).__name__}")
    if not isinstance(dst, Buffer) and not isinstance(src, Buffer):
        raise TypeError("copy needs at least one Buffer (host-to-host copies are NumPy's job)")
    if isinstance(dst, np.ndarray) and not dst.flags.writeable:
        raise ValueError("copy dst: the NumPy array is read-only")
    if isinstance(dst, Buffer) and isinstance(src, Buffer) and dst.device.runtime is not src.device.runtime:
        raise ValueError("copy between buffers of two different runtimes")
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy sizes differ: dst has {dst.nbytes} bytes, src {src.nbytes}")
    return dst.nbytes


_default: Runtime | None = None
_default_lock = threading.Lock()


def runtime(backend: str | None = None) -> Runtime:
    """The process-wide default runtime (created on first use: ``backend`` or AIOGPU_BACKEND,
    else a real GPU if one answers, else the emulator)."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = Runtime(backend)
        elif backend is not None and backend != _default.backend:
            raise ValueError(f"the default runtime already uses {_default.backend!r}, not {backend!r}")
        return _default
