"""One HSA GPU agent: its memory pool, AQL compute queues, SDMA engines, kernel dispatches."""
from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, Any, Sequence

from .._core.hazards import broken_error
from ..device import Device
from ..futures import GPUFuture
from ..hsa_bindings import packets as P
from ..hsa_bindings import types as T
from ..kernels import Kernel
from .queues import AqlQueue, CopyEngines, KernargRing, PacketGroup, barrier_and_packets
from .kernels import LoadedKernel, code_object, load_kernel, needs_compile, pack_args

if TYPE_CHECKING:
    from .runtime import HsaRuntime


class HsaDevice(Device):
    """An HSA GPU agent: compute lanes are AQL queues, copies run on its SDMA engines."""

    def __init__(self, runtime: "HsaRuntime", index: int, agent: Any, pool: Any, *, queues: int,
                 ring: int):
        self.agent, self._pool, self._api = agent, pool, runtime.api
        super().__init__(runtime, index, runtime._agent_name(agent))
        self.queues = [AqlQueue(runtime.api, runtime.hub, agent, f"{self.name}.q{i}", size=ring,
                                kernarg=KernargRing(*runtime._kernarg_block(agent)))
                       for i in range(queues)]
        for queue in self.queues:          # lanes in the core's sense
            queue.device, queue.kind = self, "compute"
        self._set_compute_lanes(self.queues)
        self.engines = CopyEngines(runtime.api, agent, self.name, runtime._crowded)

    # -- hooks: memory -------------------------------------------------------------------------
    def _raw_alloc(self, size: int) -> int:
        """``size`` bytes of the agent's coarse-grained pool, visible to every GPU agent (peer
        access). OutOfMemoryError when the pool has no room."""
        api, out = self._api, ctypes.c_void_p()
        status = api.hsa_amd_memory_pool_allocate(self._pool, size, 0, ctypes.byref(out))
        if status in (T.HSA_STATUS_ERROR_OUT_OF_RESOURCES, T.HSA_STATUS_ERROR_INVALID_ALLOCATION):
            raise self._out_of_memory(size, self._memory_free(), status)
        api.check(status, f"hsa_amd_memory_pool_allocate({size})")
        agents = self.runtime._gpu_agents()
        arr = (T.hsa_agent_t * len(agents))(*agents)
        api.check(api.hsa_amd_agents_allow_access(len(agents), arr, None, out.value),
                  "hsa_amd_agents_allow_access")
        return out.value

    def _raw_free(self, address: int) -> None:
        self._api.hsa_amd_memory_pool_free(address)

    def _memory_size(self) -> int | None:
        return self._pool_size()

    def _memory_free(self) -> int | None:
        """The pool's size less what this runtime holds from it (ROCr 5.2 reports no free
        figure for a pool: ``hsa_amd_memory_pool_get_info`` has SIZE, not what is left)."""
        size = self.memory_size
        return None if size is None else max(0, size - self.memory.driver_bytes)

    def _pool_size(self) -> int | None:
        size = ctypes.c_size_t()
        status = self._api.hsa_amd_memory_pool_get_info(self._pool, T.HSA_AMD_MEMORY_POOL_INFO_SIZE,
                                                        ctypes.byref(size))
        return size.value if status == 0 else None

    # -- hooks: kernels ------------------------------------------------------------------------
    def _load(self, kernel: Kernel) -> LoadedKernel:
        """Load ``kernel`` (under the runtime lock). A memory fault reported on this device but
        not handled yet loses it first: ``hsa_executable_freeze`` copies the code through
        queues KFD has evicted, and would never return. Raises DeviceLost on a lost device."""
        failed = self.runtime._handle_reported_faults()
        if failed:     # (its work fails on the waiter, which settles the report)
            self.runtime.hub.post_event(lambda: failed)
        if self.broken is not None:
            raise broken_error(f"loading {kernel.name} on {self.name}", self.broken)
        return load_kernel(self._api, self.agent, kernel, self.isa)

    def _needs_compile(self, kernel: Kernel) -> bool:
        """OpenCL C source not yet compiled by comgr for this agent's ISA (the emulator runs
        reference bodies: nothing to compile)."""
        return needs_compile(kernel, self._api.backend, self.isa)

    def _compile(self, kernel: Kernel) -> None:
        """comgr (or the disk cache) on a compile worker thread; ``_load`` then finds the code
        object on the kernel."""
        code_object(kernel, self._api.backend, self.isa)

    def _encode_kernel(self, fut: GPUFuture, lane: AqlQueue, loaded: LoadedKernel, grid: tuple, block: tuple,
                       values: Sequence, lengths: Sequence, waits: Sequence, cleanup: list, copy: Any = None,
                       foreign: Sequence = ()) -> list[int]:
        """One dispatch packet on the queue ``lane``, after barrier-AND packets for ``waits`` on
        other queues and engines (the barrier bit for those in this very queue). Whatever can
        fail (packing the arguments, their size) fails before any packet is written.
        (``foreign`` is always empty here: HSA takes no other library's arrays.)"""
        queue = lane
        kernarg = pack_args(loaded, values, lengths, grid, block)
        if len(kernarg) > queue.kernarg.size:
            raise ValueError(f"{fut.label}: {len(kernarg)} bytes of kernel arguments exceed the kernarg "
                             f"ring of {queue.name} ({queue.kernarg.size} bytes)")
        pkt = P.hsa_kernel_dispatch_packet_t()
        dims = len(grid)
        grid3, block3 = tuple(grid) + (1,) * (3 - dims), tuple(block) + (1,) * (3 - dims)
        pkt.workgroup_size_x, pkt.workgroup_size_y, pkt.workgroup_size_z = block3
        pkt.grid_size_x, pkt.grid_size_y, pkt.grid_size_z = grid3
        pkt.private_segment_size = loaded.private_segment_size
        pkt.group_segment_size = loaded.group_segment_size
        pkt.kernel_object = loaded.kernel_object
        fut.lane = queue
        packets, barrier, keys = self._wait_packets(queue, waits)
        pkt.completion_signal.handle = fut.signal
        header = P.make_header(P.HSA_PACKET_TYPE_KERNEL_DISPATCH, barrier=barrier and not packets)
        packets.append((pkt, header | dims << 16))
        self._encode_group(fut, queue, packets, cleanup, kernarg, loaded.kernarg_align)
        return keys

    def _lane_load(self, lane: AqlQueue) -> int:
        """Packet groups in flight or back-logged on the queue."""
        return len(lane.inflight) + len(lane.backlog)

    def _encode_group(self, fut: GPUFuture, queue: AqlQueue, packets: list, cleanup: list,
                      kernarg: bytes = b"", kernarg_align: int = 16) -> None:
        """Hand ``fut``'s packets to ``queue`` (published now, or back-logged until the ring has
        room); the queue forgets them once ``fut`` has retired. GPUError when they cannot be
        written (``AqlQueue.submit``'s ``refuse``)."""
        cleanup.append(functools.partial(queue.retired, fut))
        queue.submit(PacketGroup([p for p, _ in packets], [h for _, h in packets], fut, kernarg,
                                 kernarg_align=kernarg_align), refuse=True)

    def _wait_packets(self, queue: AqlQueue, waits: Sequence) -> tuple[list, bool, list[int]]:
        """Barrier-AND packets for the ``waits`` on other queues/engines/devices, whether the
        first packet needs the barrier bit (a dependency whose packets are earlier in this very
        HSA queue; one left over from the queue's previous incarnation, destroyed by an error,
        is waited for by its signal like any other: see ``AqlQueue.holds``), and the signals
        the packets name."""
        barrier, signals = False, []
        for dep in waits:
            if queue.holds(dep):
                barrier = True
            else:
                signals.append(dep.signal)
        packets = barrier_and_packets(signals, barrier=barrier) if signals else []
        return packets, barrier, signals

    def _destroy(self) -> None:
        for queue in self.queues:
            queue.destroy()
        self.memory.destroy()
