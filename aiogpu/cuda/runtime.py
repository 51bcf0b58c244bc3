"""The CUDA runtime: the NVIDIA GPUs of this process, their lanes, copies, joins and graphs.

Same interface as the HSA ``aiogpu.runtime.Runtime`` (``backend``, ``reason``, ``devices``,
``lock``, ``hub``, ``copy``, ``gather``, ``fill``, ``stats``, ``close``).

Submission (``submit``, under the runtime lock): the dependencies from buffer hazards and
``after=`` become device-side waits on the chosen lane, one per other lane (the newest
dependency of each lane suffices: lanes run in order; none for work its completion word already
shows done): ``cuStreamWaitValue64`` on the other lane's completion word, or
``cuStreamWaitEvent`` where events are used (streams.py). Then the operation, then the lane's
completion-word write (and event record) that completes the future. Nothing waits on the host.

Copies: host-to-device on the destination's ``h2d`` lane, device-to-host on the source's ``d2h``
lane, device-to-device on its ``d2d`` lane, between GPUs on the SOURCE device's ``peer`` lane
(DMA over the peer mapping when peer access is enabled, else ``cuMemcpyPeerAsync``, which the
driver stages). With ``copy_engines=False`` copies run as shader copies (the built-in copy kernel
on a compute lane) wherever the memory is mapped for the device.
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Iterable

import numpy as np

from .. import capture as _capture
from .. import ordering
from ..device import check_after, prepare_join
from ..errors import GPUError, RuntimeClosedError
from ..futures import PENDING, completed_future
from ..kernels import copy_kernel, fill_kernel
from ..memory import Buffer
from . import driver as D
from . import hostmem, interop, probe
from .device import CudaDevice
from .driver import cu
from .waiter import DEFAULT_SPIN_S, CudaHub


_wait64 = cu.cuStreamWaitValue64


def other_done(dep: Any) -> int:
    """The last ticket of ``dep``'s lane known complete (no device-side wait needed up to it)."""
    return dep.lane.done_upto()


class CudaRuntime:
    """A GPU runtime over the CUDA driver. ``close()`` waits for submitted work, then frees all."""

    OPTIONS = ("compute_streams", "spin_s", "watchdog_s", "copy_engines", "completion_words",
               "event_waits")
    backend = "cuda"

    def __init__(self, *, compute_streams: int = 4, spin_s: float = DEFAULT_SPIN_S,
                 watchdog_s: float | None = None, copy_engines: bool = True,
                 completion_words: bool = True, event_waits: bool = False):
        ok, why = probe()
        if not ok:
            raise RuntimeError(f"the CUDA backend cannot run here: {why}")
        self.reason = f"CUDA: {why}"
        self.closed = False
        self.copy_engines = copy_engines
        self.completion_words = completion_words
        self.event_waits = event_waits or not completion_words
        self.hub = CudaHub(spin_s=spin_s, watchdog_s=watchdog_s)
        self.hub.owner = self
        self.lock = self.hub.lock
        self.hazards = ordering.Hazards()
        count = D.check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        try:
            self.devices = [CudaDevice(self, i, compute_streams=compute_streams) for i in range(count)]
        except BaseException:
            self.hub.close()
            raise
        self.hub.lanes = [lane for d in self.devices for lane in d.lanes]
        lane = self.devices[0].compute[0]
        self.write_path = D.calibrate_write64(lane.stream, lane.dptr) if lane.dptr is not None else None
        self.host = hostmem.HostMemory(self)
        self._enable_peers()
        self._graphs: weakref.WeakSet = weakref.WeakSet()

    def _enable_peers(self) -> None:
        for a in self.devices:
            for b in self.devices:
                if a is b:
                    continue
                err, can = cu.cuDeviceCanAccessPeer(a.cudev, b.cudev)
                if err == 0 and can:
                    a.make_current()
                    (err,) = cu.cuCtxEnablePeerAccess(b.ctx, 0)
                    if err in (0, D.PEER_ALREADY_ENABLED):
                        a.peers.add(b.index)

    # -- state ---------------------------------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise RuntimeClosedError("the aiogpu runtime is closed")

    def capturing(self) -> Any:
        return _capture.current(self)

    def stats(self) -> dict:
        """Counters that return to their baseline when no work is pending (leak checks)."""
        if not self.closed:
            self.hub.scan()
        with self.lock:
            return {
                "pending": self.hub.pending_count,
                "signals_in_use": sum(d.events.in_use for d in self.devices),
                "kernarg_in_use": 0,
                "backlog": 0,
                "host_locks": self.host.in_use,
                "host_ranges": self.hazards.host_ranges,
                "host_registrations": len(self.host._runs),
                "host_bounced": self.host.bounced,
                "small_allocations": sum(d.memory.small.used for d in self.devices),
                "large_allocations": sum(len(d.memory.large) for d in self.devices),
                "events_created": sum(d.events.created for d in self.devices),
                "spin_hits": self.hub.spin_hits,
                "spin_misses": self.hub.spin_misses,
                "arms": self.hub.arms,
                "wakeups": self.hub.wakeups,
            }

    # -- submission (under the lock) -------------------------------------------------------------
    def submit(self, device: CudaDevice, lane: Any, label: str, deps: dict, enqueue: Any,
               reads: list, writes: list, keep: Iterable = (), cleanup: Iterable = (), *,
               on_complete: list | None = None, nbytes: int = 0, staging: Any = None) -> Any:
        """Wait on ``deps`` on the device, run ``enqueue(stream)`` (returns a CUresult), record
        the completion event and write the lane's completion word; returns the future. Failures
        before the work is queued return a failed future and run ``cleanup`` at once."""
        hub = self.hub
        if deps or device.broken is not None:
            err = ordering.failed_dependency(deps) if deps else None
            if err is None and device.broken is not None:
                err = GPUError(f"{label}: {device.broken}", status=device.broken.status, queue=lane.name)
            if err is not None:
                for fn in cleanup:
                    fn()
                return ordering.failed_without_running(hub, label, err, writes)
        device.make_current()
        stream = lane.stream
        hot = D.HOT
        code = 0
        if deps:
            waits: dict = {}
            for dep in deps:
                other = getattr(dep, "lane", None)
                if other is None or other is lane or dep.retired:
                    continue
                cur = waits.get(other)
                if cur is None or dep.ticket > cur.ticket:
                    waits[other] = dep
            for dep in waits.values():
                if dep.ticket > other_done(dep):
                    if dep.event is not None:
                        code = hot.wait(stream, dep.event)
                    else:       # wait on the device for the other lane's completion word
                        code = _wait64(stream, dep.lane.dptr, dep.ticket, D.WAIT_GEQ)[0]
                    if code:
                        break
        if not code:
            code = enqueue(stream)
        event = None
        if not code:
            if lane.dptr is None or self.event_waits:
                event = device.events.acquire()
                code = hot.record(event, stream)
            if not code and lane.dptr is not None:
                code = D.write64(stream, lane.dptr, lane.ticket + 1)
        if code:
            if event is not None:
                device.events.release(event)
            exc = GPUError(f"{label} on {lane.name}: {D.error_name(code)}", status=int(code), queue=lane.name)
            for fn in cleanup:
                fn()
            if int(code) in D.STICKY:
                hub.device_failed(device, int(code), lane)
            return completed_future(hub, label, exc)
        lane.ticket = ticket = lane.ticket + 1
        fut = hub.new_future(label)
        fut.lane, fut.ticket, fut.event = lane, ticket, event
        fut.device, fut.queue, fut.packet = device, lane.name, ticket
        fut.on_complete, fut.nbytes, fut.staging = on_complete, nbytes, staging
        if deps:
            host_deps = None
            for dep, semantic in deps.items():
                if dep.retired:
                    continue
                if semantic:
                    dep._dependents.append(fut)
                if dep._state == PENDING and (getattr(dep, "on_complete", None) or getattr(dep, "host_deps", None)):
                    # Work with host-side completion steps (bounced device-to-host copies): they
                    # run before this future completes, so that its result includes them.
                    host_deps = host_deps or []
                    if dep.on_complete:
                        host_deps.append(dep)
                    host_deps.extend(d for d in dep.host_deps or () if d._state == PENDING)
            fut.host_deps = host_deps
        # Ordering state, buffer use counts, and what runs when the work has retired.
        events = device.events
        if reads or writes:
            ordering.record(fut, reads, writes)
            used = {id(s): s for s in (*reads, *writes)}.values()
            bufs = [s for s in used if type(s) is Buffer]
            hosts = [s for s in used if type(s) is ordering.HostRange]
            for buf in bufs:
                buf.users += 1
            fut.keep.extend(bufs)
        else:
            bufs = hosts = ()
        if keep:
            fut.keep.extend(keep)
        if bufs or hosts or cleanup:
            hazards = self.hazards

            def done() -> None:
                if event is not None:
                    events.release(event)
                for buf in bufs:
                    buf.unuse()
                for state in hosts:
                    hazards.prune_host(state)
                for fn in cleanup:
                    fn()

            fut._cleanup.append(done)
        elif event is not None:
            fut._cleanup.append(lambda: events.release(event))
        hub.watch(fut)
        return fut

    # -- copies --------------------------------------------------------------------------------
    def copy(self, dst: Any, src: Any, after: Iterable[Any] = ()) -> Any:
        """See ``aiogpu.copy``; on CUDA each side may also be a CUDA array of another library
        (``__cuda_array_interface__``: torch, CuPy, ...)."""
        nbytes = self._check_copy(dst, src)
        after = check_after(self, after)
        capture = self.capturing()
        if capture is not None:
            if interop.is_foreign(dst) or interop.is_foreign(src):
                raise TypeError("a graph captures copies of Buffers and NumPy arrays only")
            return capture.record_copy(dst, src, after)
        with self.lock:
            self.check_open()
            return self._submit_copy(dst, src, nbytes, after)

    def _check_copy(self, dst: Any, src: Any) -> int:
        for name, side in (("dst", dst), ("src", src)):
            if isinstance(side, Buffer):
                side.check_usable()
                if side.device.runtime is not self:
                    raise ValueError("copy between buffers of two different runtimes")
            elif isinstance(side, np.ndarray):
                if not side.flags.c_contiguous:
                    raise ValueError(f"copy {name}: the NumPy array must be C-contiguous")
                if side.nbytes == 0:
                    raise ValueError(f"copy {name}: the array is empty")
            elif interop.is_foreign(side):
                interop.foreign_info(self, side, name)   # validates
            else:
                raise TypeError(f"copy {name} must be a Buffer, a NumPy array or a CUDA array, "
                                f"got {type(side).__name__}")
        if not isinstance(dst, Buffer) and not isinstance(src, Buffer):
            raise TypeError("copy needs at least one Buffer")
        if isinstance(dst, np.ndarray) and not dst.flags.writeable:
            raise ValueError("copy dst: the NumPy array is read-only")
        n_dst, n_src = _nbytes(self, dst), _nbytes(self, src)
        if n_dst != n_src:
            raise ValueError(f"copy sizes differ: dst has {n_dst} bytes, src {n_src}")
        return n_dst

    def _side(self, side: Any, name: str) -> tuple:
        """(kind, pointer, device, ordering state, foreign stream or None)."""
        if isinstance(side, Buffer):
            return "dev", side.address, side.device, side, None
        if isinstance(side, np.ndarray):
            addr = side.__array_interface__["data"][0]
            return "host", addr, None, self.hazards.host(addr, side.nbytes), None
        ptr, nbytes, device, stream = interop.foreign_info(self, side, name)
        return "dev", ptr, device, self.hazards.host(ptr, nbytes), stream

    def _submit_copy(self, dst: Any, src: Any, nbytes: int, after: list) -> Any:
        dkind, dptr, ddev, dstate, dstream = self._side(dst, "dst")
        skind, sptr, sdev, sstate, sstream = self._side(src, "src")
        label = f"copy {_where(src)}->{_where(dst)} {nbytes} B"
        deps = ordering.dependencies([sstate], [dstate], after)
        cleanup, on_complete, keep, staging = [], None, [dst, src], None
        if skind == "host":
            device, direction = ddev, "h2d"
        elif dkind == "host":
            device, direction = sdev, "d2h"
        elif ddev is sdev:
            device, direction = sdev, "d2d"
        else:
            device, direction = sdev, "peer"     # the SOURCE device's engine
        if ordering.failed_dependency(deps) is None and device.broken is None:
            if direction == "h2d":
                sptr = self._host_source(src, sstate, nbytes, cleanup)
            elif direction == "d2h":
                dptr, on_complete, staging = self._host_destination(dst, dstate, nbytes, cleanup)
        foreign_waits = [s for s in (dstream, sstream) if s is not None]
        peer_dma = direction != "peer" or ddev.index in sdev.peers
        if self.copy_engines or not peer_dma:
            lane = {"h2d": device.h2d, "d2h": device.d2h, "d2d": device.d2d, "peer": device.peer}[direction]
            if peer_dma:
                copy = lambda stream: D.HOT.memcpy(dptr, sptr, nbytes, stream)  # noqa: E731
            else:
                copy = lambda stream: cu.cuMemcpyPeerAsync(  # noqa: E731
                    dptr, ddev.ctx, sptr, sdev.ctx, nbytes, stream)[0]
            enqueue = self._with_foreign_waits(device, foreign_waits, copy)
            return self.submit(device, lane, label, deps, enqueue, [sstate], [dstate], keep, cleanup,
                               on_complete=on_complete, nbytes=nbytes, staging=staging)
        # Shader copy: the built-in copy kernel on a compute lane of the engine's device.
        loaded = device.loaded(copy_kernel)
        blocks = max(1, min(-(-nbytes // (16 * 256)), 8192))
        lane = device.pick_lane(deps)
        params = loaded.pack([dptr, sptr, nbytes])
        func = loaded.func
        run = lambda stream: D.HOT.kernel(func, (blocks, 1, 1), (256, 1, 1), stream, params)  # noqa: E731
        enqueue = self._with_foreign_waits(device, foreign_waits, run)
        return self.submit(device, lane, label + " (shader)", deps, enqueue, [sstate], [dstate], keep,
                           cleanup, on_complete=on_complete, nbytes=nbytes, staging=staging)

    def _with_foreign_waits(self, device: CudaDevice, streams: list, enqueue: Any) -> Any:
        """Order the copy after the work another library queued on its own streams."""
        if not streams:
            return enqueue

        def run(stream: Any) -> int:
            for other in streams:
                ev = device.events.acquire()
                try:
                    code = D.HOT.record(ev, cu.CUstream(other)) or D.HOT.wait(stream, ev)
                finally:
                    device.events.release(ev)
                if code:
                    return code
            return enqueue(stream)

        return run

    def _host_source(self, arr: np.ndarray, state: Any, nbytes: int, cleanup: list) -> int:
        """A device-readable pointer holding ``arr``'s bytes for a host-to-device copy."""
        addr = arr.__array_interface__["data"][0]
        writer = state.last_write
        pending = writer is not None and not writer.retired
        block = getattr(writer, "staging", None) if pending else None
        if block is not None and not writer.done():
            # A device-to-host copy into ``arr`` went through a bounce block and has not
            # landed in ``arr`` yet: its block holds the newest bytes, on the device side.
            block.retain()
            cleanup.append(block.release)
            return block.ptr
        if nbytes <= hostmem.STAGE_LIMIT and not pending:
            ptr, release = self.host.stage(nbytes)    # nothing pending writes it: copy it now
            hostmem.memmove(ptr, addr, nbytes)
            cleanup.append(release)
            return ptr
        got = self.host.pin(arr)
        if got is None:            # its pages are held by a busy registration: bounce
            ptr, release = self.host.stage(nbytes)
            hostmem.memmove(ptr, addr, nbytes)
            cleanup.append(release)
            return ptr
        ptr, release = got
        cleanup.append(release)
        return ptr

    def _host_destination(self, arr: np.ndarray, state: Any, nbytes: int,
                          cleanup: list) -> tuple[int, list | None, Any]:
        """(device-writable pointer, host-side completion steps, bounce block) for a
        device-to-host copy into ``arr``."""
        writer = state.last_write
        after_bounce = (writer is not None and not writer.retired
                        and getattr(writer, "staging", None) is not None)
        if not after_bounce:        # (after a bounced write, bounce too: host steps stay in order)
            got = self.host.pin(arr)
            if got is not None:
                ptr, release = got
                cleanup.append(release)
                return ptr, None, None
        block = hostmem.SharedBlock(*self.host.stage(nbytes))
        cleanup.append(block.release)
        addr, ptr = arr.__array_interface__["data"][0], block.ptr
        return ptr, [lambda: hostmem.memmove(addr, ptr, nbytes)], block

    def fill(self, buf: Buffer, value: int, after: Iterable[Any] = ()) -> Any:
        """See ``Buffer.fill``: ``cuMemsetD32Async`` (the fill kernel inside a capture)."""
        after = check_after(self, after)
        dev = buf.device
        if self.capturing() is not None:
            return dev.launch(fill_kernel, (max(buf.nbytes // 4, 1),), (256,),
                              (buf, int(value) & 0xFFFFFFFF, buf.nbytes // 4), after=after)
        buf.check_usable()
        with self.lock:
            self.check_open()
            deps = ordering.dependencies([], [buf], after)
            lane = dev.pick_lane(deps)
            word, count, ptr = int(value) & 0xFFFFFFFF, buf.nbytes // 4, buf.address
            return self.submit(dev, lane, f"fill {buf.nbytes} B", deps,
                               lambda stream: cu.cuMemsetD32Async(ptr, word, count, stream)[0],
                               [], [buf])

    # -- joins ---------------------------------------------------------------------------------
    def gather(self, futures: Iterable[Any]) -> Any:
        """One future for all of ``futures``: an event recorded after device-side waits."""
        futures = check_after(self, list(futures))
        capture = self.capturing()
        if capture is not None:
            return capture.record_gather(futures)
        with self.lock:
            settled, live, deps = prepare_join(self, futures)
            if settled is not None:
                return settled
            device = next((f.device for f in live if f.device is not None), self.devices[0])
            lanes = {id(f.lane): f.lane for f in live if getattr(f, "lane", None) is not None}
            lane = next(iter(lanes.values())) if len(lanes) == 1 else device.pick_lane(deps)
            device = lane.device
            return self.submit(device, lane, f"gather of {len(futures)}", deps, lambda stream: 0, [], [])

    # -- graphs ----------------------------------------------------------------------------------
    def instantiate_graph(self, graph: Any) -> Any:
        from .graphs import CudaGraphExec
        exe = CudaGraphExec(graph)
        self._graphs.add(exe)
        return exe

    # -- shutdown ------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Wait (up to ``timeout`` s) for submitted work, then release every resource."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        deadline = time.monotonic() + timeout
        while self.hub.pending_count and time.monotonic() < deadline:
            self.hub.scan()
            if self.hub.pending_count:
                time.sleep(0.001)
        self.hub.close()
        with self.lock:
            for exe in list(self._graphs):
                exe.destroy()
            for dev in self.devices:
                dev.destroy()
            self.host.close()
            for dev in self.devices:
                dev.release_context()
            D.forget_current()

    def __enter__(self) -> "CudaRuntime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<CudaRuntime: {len(self.devices)} GPU(s)>"


def _where(side: Any) -> str:
    if isinstance(side, Buffer):
        return side.device.name
    return "host" if isinstance(side, np.ndarray) else type(side).__name__


def _nbytes(rt: CudaRuntime, side: Any) -> int:
    if isinstance(side, (Buffer, np.ndarray)):
        return side.nbytes
    return interop.foreign_info(rt, side, "side")[1]
