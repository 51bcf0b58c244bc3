"""A GPU agent as aiogpu sees it: memory, compute queues, copy engines, kernel launches."""
from __future__ import annotations

import itertools
import math
from typing import Any, Iterable, Sequence

import numpy as np

from . import ordering
from .futures import GPUFuture
from .hsa_bindings import packets as P
from .hsa_bindings.codeobject import fill_hidden
from .hsa_bindings.signature import pack
from .kernels import Kernel, LoadedKernel, load_kernel
from .memory import Buffer, DeviceMemory, allocate
from .queues import AqlQueue, CopyEngines, KernargRing, PacketGroup, barrier_and_packets

MAX_GRID = 0xFFFFFFFF
MAX_WORKGROUP = 1024


def check_dims(name: str, dims: Any, limit: int) -> tuple[int, ...]:
    """Validate a grid or block: 1 to 3 positive integers each <= limit."""
    if isinstance(dims, (int, np.integer)):
        dims = (dims,)
    if not isinstance(dims, (tuple, list)) or not 1 <= len(dims) <= 3:
        raise ValueError(f"{name} must be 1 to 3 integers, got {dims!r}")
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"{name} entries must be integers, got {d!r}")
        if not 1 <= d <= limit:
            raise ValueError(f"{name} entries must be between 1 and {limit}, got {d}")
        out.append(int(d))
    return tuple(out)


def check_after(runtime: Any, after: Any) -> list[GPUFuture]:
    if isinstance(after, GPUFuture):
        after = [after]
    try:
        items = list(after)
    except TypeError:
        raise TypeError(f"after= takes GPUFutures, got {after!r}") from None
    for f in items:
        if not isinstance(f, GPUFuture):
            raise TypeError(f"after= takes GPUFutures, got {f!r}")
        if f._hub is not None and f._hub is not runtime.hub:
            raise ValueError(f"{f!r} belongs to another runtime")
    return items


def prepare_join(runtime: Any, futures: Iterable[Any]) -> tuple[Any, list, dict]:
    """The common part of every backend's ``gather`` (call under the runtime lock, after the
    capture check): (an already-settled future, or None; the futures still to wait for; their
    dependency map)."""
    runtime.check_open()
    futures = list(futures)
    deps = {f: True for f in futures}
    err = ordering.failed_dependency(deps)
    live = [f for f in futures if not f.retired]
    if err is not None or not live:
        from .futures import completed_future
        return completed_future(runtime.hub, "gather", err), [], deps
    return None, live, deps


def check_launch(kernel: Any, grid: Any, block: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate a launch's kernel, grid and block (shared by every backend's devices)."""
    if not isinstance(kernel, Kernel):
        raise TypeError(f"launch takes an aiogpu kernel, got {kernel!r}")
    grid = check_dims("grid", grid, MAX_GRID)
    block = check_dims("block", block, MAX_WORKGROUP)
    if len(block) != len(grid):
        raise ValueError(f"grid {grid} and block {block} must have the same number of dimensions")
    if math.prod(block) > MAX_WORKGROUP:
        raise ValueError(f"block {block} has {math.prod(block)} work-items; at most {MAX_WORKGROUP}")
    return grid, block


def check_args(device: Any, kernel: Kernel, args: Sequence[Any]) -> tuple[list, list, dict[int, Buffer]]:
    """Validate ``args`` against ``kernel``'s signature for a launch on ``device``: (argument
    values, buffer lengths, {index: Buffer}). Shared by every backend's devices."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if len(args) != len(kernel.args):
        raise TypeError(f"{kernel.name} takes {len(kernel.args)} arguments ({kernel.signature}), "
                        f"got {len(args)}")
    values, lengths, buffers = [], [], {}
    for i, (spec, value) in enumerate(zip(kernel.args, args)):
        if spec.pointer:
            if not isinstance(value, Buffer):
                raise TypeError(f"{kernel.name} argument {i} ({spec}) must be a Buffer, got "
                                f"{type(value).__name__}")
            value.check_usable()
            if value.device is not device:
                raise ValueError(f"{kernel.name} argument {i}: {value!r} is not on {device.name}; "
                                 f"copy it with aiogpu.copy first")
            values.append(value.address)
            lengths.append(value.nbytes)
            buffers[i] = value
        else:
            values.append(check_scalar(kernel, i, spec, value))
    return values, lengths, buffers


_INT_RANGES: dict[str, tuple[int, int]] = {}


def check_scalar(kernel: Kernel, i: int, spec: Any, value: Any) -> Any:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{kernel.name} argument {i} ({spec}) must be a number, got {value!r}")
    bounds = _INT_RANGES.get(spec.type_name)
    if bounds is None and spec.dtype.kind in "iu":
        info = np.iinfo(spec.dtype)
        bounds = _INT_RANGES[spec.type_name] = (int(info.min), int(info.max))
    if bounds is not None:
        if isinstance(value, (float, np.floating)) and not float(value).is_integer():
            raise TypeError(f"{kernel.name} argument {i} ({spec}) must be an integer, got {value!r}")
        if not bounds[0] <= int(value) <= bounds[1]:
            raise ValueError(f"{kernel.name} argument {i} ({spec}) out of range: {value}")
        return int(value)
    return float(value)


class Device:
    """One GPU: ``alloc`` buffers, ``launch`` kernels. Copies go through ``aiogpu.copy``."""

    def __init__(self, runtime: Any, index: int, agent: Any, pool: Any, *, queues: int, ring: int,
                 kernarg_pool: Any):
        self.runtime, self.index, self.agent = runtime, index, agent
        self.name = f"gpu{index}"
        api = runtime.api
        self.isa = runtime.agent_name(agent)
        self.memory = DeviceMemory(api, pool, runtime.gpu_agents)
        self._kernels: dict[Kernel, LoadedKernel] = {}
        self.queues = [AqlQueue(api, runtime.hub, agent, f"{self.name}.q{i}", size=ring,
                                kernarg=KernargRing(*runtime.kernarg_block(agent)))
                       for i in range(queues)]
        self.engines = CopyEngines(api, agent, self.name)
        self._rr = itertools.cycle(range(queues))

    def __repr__(self) -> str:
        return f"<Device {self.name} {self.isa} ({self.runtime.backend})>"

    # -- memory --------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Buffer:
        """``nbytes`` of device memory (synchronous, cheap; contents undefined)."""
        return allocate(self, nbytes)

    # -- kernels -------------------------------------------------------------------------------
    def loaded(self, kernel: Kernel) -> LoadedKernel:
        """``kernel`` loaded on this device (its code object loaded and frozen once, then cached)."""
        got = self._kernels.get(kernel)
        if got is None:
            got = self._kernels[kernel] = load_kernel(self.runtime.api, self.agent, kernel, self.isa)
        return got

    def launch(self, kernel: Kernel, grid: Any, block: Any, args: Sequence[Any] = (), *,
               after: Iterable[GPUFuture] = ()) -> GPUFuture:
        """Dispatch ``kernel`` over ``grid`` work-items in workgroups of ``block``.

        Returns at once with a GPUFuture. Bad input raises ValueError/TypeError before anything
        is submitted. The launch waits on the device for ``after`` and for earlier operations
        that conflict with the buffers it uses.
        """
        rt = self.runtime
        grid, block = check_launch(kernel, grid, block)
        values, lengths, buffers = self._check_args(kernel, args)
        after = check_after(rt, after)
        capture = rt.capturing()
        if capture is not None:
            return capture.record_launch(self, kernel, grid, block, tuple(args), after)
        with rt.lock:
            rt.check_open()
            loaded = self.loaded(kernel)
            reads = [b for b in buffers.values()]
            writes = [buffers[i] for i in kernel.writes if i in buffers]
            return self.dispatch(loaded, kernel.name, grid, block, values, lengths, reads, writes, after)

    def _check_args(self, kernel: Kernel, args: Sequence[Any]) -> tuple[list, list, dict[int, Buffer]]:
        return check_args(self, kernel, args)

    _scalar = staticmethod(check_scalar)

    # -- submission (under the runtime lock) ---------------------------------------------------
    def dispatch(self, loaded: LoadedKernel, label: str, grid: tuple, block: tuple, values: list,
                 lengths: list, reads: list, writes: list, after: list[GPUFuture], *,
                 extra_reads: list = (), extra_writes: list = (), keep: list = ()) -> GPUFuture:
        """Submit one kernel dispatch with its dependencies; returns its future."""
        rt = self.runtime
        states_r, states_w = list(reads) + list(extra_reads), list(writes) + list(extra_writes)
        deps = ordering.dependencies(states_r, states_w, after)
        err = ordering.failed_dependency(deps)
        if err is not None:
            return ordering.failed_without_running(rt.hub, label, err, states_w)
        queue = self._pick_queue(deps)
        fut = rt.hub.new_future(label)
        fut.device, fut.kind = self, "dispatch"
        packets, barrier = self._wait_packets(fut, queue, deps)
        pkt = P.hsa_kernel_dispatch_packet_t()
        dims = len(grid)
        grid3, block3 = tuple(grid) + (1,) * (3 - dims), tuple(block) + (1,) * (3 - dims)
        pkt.workgroup_size_x, pkt.workgroup_size_y, pkt.workgroup_size_z = block3
        pkt.grid_size_x, pkt.grid_size_y, pkt.grid_size_z = grid3
        pkt.private_segment_size = loaded.private_segment_size
        pkt.group_segment_size = loaded.group_segment_size
        pkt.kernel_object = loaded.kernel_object
        pkt.completion_signal.handle = fut.signal
        kernarg = pack_args(loaded, values, lengths, grid, block)
        header = P.make_header(P.HSA_PACKET_TYPE_KERNEL_DISPATCH, barrier=barrier and not packets)
        packets.append((pkt, header | dims << 16))
        self._track(fut, queue, states_r, states_w, keep, deps)
        queue.submit(PacketGroup([p for p, _ in packets], [h for _, h in packets], fut, kernarg,
                                 kernarg_align=loaded.kernarg_align))
        return fut

    def _pick_queue(self, deps: dict[GPUFuture, bool]) -> AqlQueue:
        """The queue of the newest dependency on this device (a barrier bit then suffices),
        else the next queue round-robin, so independent work spreads over the queues."""
        names = {q.name: q for q in self.queues}
        for fut in reversed(list(deps)):
            if not fut.retired and fut.queue in names:
                return names[fut.queue]
        return self.queues[next(self._rr)]

    def _wait_packets(self, fut: GPUFuture, queue: AqlQueue, deps: dict[GPUFuture, bool]) -> tuple[list, bool]:
        """Barrier-AND packets for dependencies on other queues/engines/devices, and whether the
        first packet needs the barrier bit (a dependency earlier in the same queue)."""
        hub, barrier, signals = self.runtime.hub, False, []
        for dep, semantic in deps.items():
            if dep.retired:
                continue
            if dep.queue == queue.name:
                barrier = True
                if semantic:
                    dep._dependents.append(fut)
            else:
                hub.depend(fut, dep, semantic=semantic)
                signals.append(dep.signal)
        packets = barrier_and_packets(signals, barrier=barrier) if signals else []
        return packets, barrier

    def _track(self, fut: GPUFuture, queue: Any, reads: list, writes: list, keep: Iterable,
               deps: Iterable[GPUFuture] = ()) -> None:
        """Ordering state, buffer use counts and the clean-up run when ``fut`` retires."""
        ordering.record(fut, reads, writes, deps)
        used = {id(s): s for s in list(reads) + list(writes) if isinstance(s, Buffer)}
        for buf in used.values():
            buf.users += 1
        fut.keep.extend(used.values())
        fut.keep.extend(keep)
        hazards = self.runtime.hazards
        hosts = [s for s in list(reads) + list(writes) if isinstance(s, ordering.HostRange)]

        def cleanup() -> None:
            for buf in used.values():
                buf.unuse()
            for state in hosts:
                hazards.prune_host(state)
            if queue is not None:
                queue.retired(fut)

        fut._cleanup.append(cleanup)


def pack_args(loaded: LoadedKernel, values: list, lengths: list, grid: tuple, block: tuple) -> bytes:
    """Kernarg bytes, padded to the segment size the code object asks for, with the hidden
    dispatch-geometry arguments (code object v5) filled for ``grid``/``block``."""
    data = pack(loaded.args, loaded.layout, values, lengths)
    data += bytes(max(0, loaded.kernarg_size - len(data)))
    return fill_hidden(loaded.hidden, data, grid, block)
