"""The CUDA runtime: the NVIDIA GPUs of this process, their lanes, copies, joins and graphs.

``CudaRuntime`` is the core's ``aiogpu.Runtime`` on the CUDA driver: the core owns validation,
hazards, the copy-direction rule and the shader-copy decision; this module implements the hooks.

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

import functools
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from ..errors import BackendUnavailable
from .._core.copies import CopyOp
from ..runtime import FIXES, Runtime
from . import driver as D
from . import nvrtc
from . import copies as _copies
from . import foreign, hostmem, interop, probe
from .device import CudaDevice
from .driver import cu
from .encode import wait_on_device
from .waiter import DEFAULT_SPIN_S, CudaHub


def _nothing(stream: int, word: int, ticket: int) -> int:
    """The enqueue of a submission with no work of its own (a join, a foreign stream's point)."""
    return 0


class CudaRuntime(Runtime):
    """aiogpu on NVIDIA GPUs through the CUDA driver API.

    Options beyond the core's: ``completion_words`` (lanes write a completion word in host
    memory after each operation, where the device has stream memory operations; else events),
    ``event_waits`` (cross-lane waits on events rather than on completion words). Compute lanes
    are CUDA streams (``queues_per_device``, default 8); copies run on per-direction copy streams.
    Raises BackendUnavailable where cuda-bindings or an NVIDIA GPU is missing.
    """

    backend = "cuda"
    engines_take_every_copy = True       # (``_copy_lane``: a copy stream always takes it)
    OPTIONS: ClassVar[frozenset[str]] = Runtime.OPTIONS | {"completion_words", "event_waits"}
    _foreign_kinds = " or a CUDA array (__cuda_array_interface__)"

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return probe()

    def __init__(self, backend: str | None = None, *, queues_per_device: int = 8, spin_s: float = DEFAULT_SPIN_S,
                 watchdog_s: float | None = None, copy_engines: bool = True,
                 completion_words: bool = True, event_waits: bool = False):
        ok, why = probe()
        if not ok:
            raise BackendUnavailable("cuda", why, FIXES["cuda"])
        self._check_shared_options(queues_per_device=queues_per_device, watchdog_s=watchdog_s, spin_s=spin_s,
                                  copy_engines=copy_engines)
        self.completion_words = completion_words
        self.event_waits = event_waits or not completion_words
        self._init_core(CudaHub(spin_s=spin_s, watchdog_s=watchdog_s), copy_engines=copy_engines)
        _copies.bind(self)         # (the core calls its copy hooks as C functions)
        self.reason = f"CUDA: {why}"
        try:                       # a failed construction leaves nothing behind (see _undo)
            count = D.check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
            for i in range(count):
                self.devices.append(CudaDevice(self, i, compute_streams=queues_per_device))
            self.hub.lanes = [lane for d in self.devices for lane in d.lanes]
            # How completion words are written (stats): by the hot path, where there are words.
            self.write_path = D.HOT.write_path if self.devices[0].compute[0].dptr is not None else None
            # Load NVRTC now (its import maps a large library while holding the GIL: done by the
            # first compile's worker thread, it stalled the event loop for 4-6 ms on the H200).
            nvrtc.version()
            self.host = hostmem.HostMemory(self)
            self._patches: tuple | None = None    # (op, patches) from _host_pointers to the submission
            self._enable_peers()
        except BaseException:
            self._undo()
            raise

    def _undo(self) -> None:
        """Release what a failed construction made: the devices made so far (their streams,
        events, completion words, primary contexts), pinned and registered host memory, the
        waiter thread. No work was submitted."""
        devices: list[Any] = self.devices
        if devices:
            self.pinned.close()
        for dev in devices:
            dev._destroy()
        host = getattr(self, "host", None)
        if host is not None:
            host.close()
        self.hub.close()
        for dev in devices:
            dev.release_context()
        self.devices = []
        D.forget_current()

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

    # -- encoding on a lane (under the lock) ------------------------------------------------------
    def _wait_on_device(self, lane: Any, waits: Sequence) -> int:
        """Make ``lane`` wait, on the device, for ``waits`` (``encode.wait_on_device``): the
        first failing call's CUresult, else 0."""
        return wait_on_device(lane, waits)

    def _completed_on_lane(self, fut: Any, lane: Any, cleanup: list, code: int, word: int) -> None:
        """After the operation's enqueue returned ``code`` (``word``: it wrote the completion
        word itself): record the event and write the word (unless it did), and make ``fut`` the
        lane's next ticket. Raises CudaError when a call failed (a sticky error fails the device
        first): nothing then completes ``fut``."""
        event = None
        if not code and not word:
            stream = lane.sh
            if lane.dptr is None or self.event_waits:
                event = lane.device.events.acquire()
                code = D.HOT.record(event, stream)
            if not code and lane.dptr is not None:
                code = D.HOT.write64(stream, lane.wordp, lane.ticket + 1)
        if code:
            if event is not None:
                lane.device.events.release(event)
            if int(code) in D.STICKY:
                self.hub.device_failed(lane.device, int(code), lane)
            raise D.CudaError(f"{fut.label} on {lane.name}: {D.error_name(code)}", status=int(code),
                              queue=lane.name)
        lane.ticket = ticket = lane.ticket + 1
        if lane.dptr is not None:
            lane.written = ticket            # (written after the work, by the call or here)
        fut.lane, fut.ticket, fut.event = lane, ticket, event
        fut.queue, fut.packet = lane.name, ticket
        if event is not None:
            cleanup.append(functools.partial(lane.device.events.release, event))

    def _encode_on_lane(self, fut: Any, lane: Any, waits: Sequence, cleanup: list, enqueue: Any, *,
                        fusable: bool = False, on_complete: list | None = None, nbytes: int = 0,
                        staging: Any = None) -> tuple:
        """``enqueue(stream, word, ticket)`` (returns a CUresult; ``stream`` the lane's as an
        int) on ``lane`` after ``waits``, then the lane's completion of ``fut``.

        ``fusable``: ``enqueue`` is one ``HotPath.launch`` or ``memcpy`` that passes ``word`` and
        ``ticket`` on (writing the ticket to the word after its work, only if queued). Whether
        it is given the lane's word is decided here, from ``lane.fused_word`` (encode.Lane);
        otherwise it gets ``word=0`` and the word is written (or the event recorded) after it."""
        lane.device.make_current()
        code = wait_on_device(lane, waits) if waits else 0
        word = lane.fused_word if fusable else 0
        if not code:
            code = enqueue(lane.sh, word, lane.ticket + 1 if word else 0)
        self._completed_on_lane(fut, lane, cleanup, code, word)
        fut.on_complete, fut.staging = on_complete, staging
        if nbytes:
            fut.nbytes = nbytes
        return ()

    # -- hooks: other libraries' streams and events ---------------------------------------------
    def _foreign_check(self, obj: Any) -> None:
        foreign.classify(obj)

    def _foreign_work(self, obj: Any, device: Any) -> tuple:
        dev, lane, label, enqueue = foreign.work(self, obj, device)
        return dev, lane, label, functools.partial(_encode_with, self, enqueue) if lane is not None else None

    def _wait_on(self, fut: Any, obj: Any, device: Any) -> None:
        foreign.wait_on(self, fut, obj, device)

    # -- hooks: copies ---------------------------------------------------------------------------
    def _foreign(self, obj: Any, what: str, write: bool) -> tuple | None:
        if not interop.is_foreign(obj):
            return None
        return interop.foreign_info(self, obj, what, write)

    def _shader_can_copy(self, op: CopyOp) -> bool:
        """A shader reaches peer memory only over an enabled peer mapping."""
        return op.direction != "peer" or op.dst.device.index in op.src.device.peers

    def _pin_host(self, address: int, size: int) -> int:
        """``cuMemHostRegister`` (portable, device-mapped): every context may use it."""
        self.devices[0].make_current()
        D.check(cu.cuMemHostRegister(address, size, D.HOSTREGISTER_PORTABLE | D.HOSTREGISTER_DEVICEMAP),
                f"cuMemHostRegister({size})")
        return int(D.check(cu.cuMemHostGetDevicePointer(address, 0), "cuMemHostGetDevicePointer"))

    def _unpin_host(self, address: int) -> None:
        self.devices[0].make_current()
        cu.cuMemHostUnregister(address)

    def _host_pinned(self, array: np.ndarray) -> bool:
        """The pinned pool, and arrays a cached registration covers (registered once, reused)."""
        if super()._host_pinned(array):
            return True
        addr = array.__array_interface__["data"][0]
        start, end = addr // hostmem.PAGE * hostmem.PAGE, -(-(addr + array.nbytes) // hostmem.PAGE) * hostmem.PAGE
        with self.lock:
            return self.host.registered(start, end)

    def _host_pointers(self, op: CopyOp) -> None:
        """Host sides outside the pinned pool: sources are registered (or read from a pending
        bounce block); destinations registered, or bounced through a pinned block copied out
        when the copy completes."""
        if op.direction == "h2d":
            if op.src.ptr is None:
                op.src.ptr, patches = self._host_source(op.src.obj, op.src.state, op.nbytes, op.cleanup)
                if patches:
                    self._patches = (op, patches)
        elif op.direction == "d2h" and op.dst.ptr is None:
            op.dst.ptr, op.on_complete, op.staging = self._host_destination(
                op.dst.obj, op.dst.state, op.nbytes, op.cleanup)

    # The encode of a copy and its lane choice, per copy: compiled (cuda/copies.py).
    _encode_copy = _copies.encode_copy
    _copy_lane = _copies.copy_lane

    def _take_patches(self, op: CopyOp) -> list | None:
        """The patches ``_host_pointers`` made for ``op`` (under the lock, between the two)."""
        got = self._patches
        if got is None or got[0] is not op:
            return None
        self._patches = None
        return got[1]

    @staticmethod
    def _with_patches(op: CopyOp, enqueue: Any, patches: list) -> Any:
        """After the upload ``enqueue`` queues, copy each patch, (offset, source pointer,
        bytes), into the destination at its offset, in order, on the same stream (so after the
        waits of the upload: the bounced downloads whose blocks they read have completed).
        Not fusable: the completion word goes after the last patch."""
        dst = op.dst.ptr

        def run(stream: int, word: int, ticket: int) -> int:
            code = enqueue(stream, 0, 0)
            memcpy = D.HOT.memcpy
            for off, src, n in patches:
                if code:
                    break
                code = memcpy(dst + off, src, n, stream)
            return code

        return run

    def with_foreign_waits(self, device: CudaDevice, streams: Iterable, enqueue: Any) -> Any:
        """Order a copy or launch after the work another library queued on ``streams`` (an
        event recorded there, waited for on the device). Fusable where ``enqueue`` is: the
        completion word is passed on to it."""
        streams = [int(s) for s in streams]
        if not streams:
            return enqueue

        def run(stream: int, word: int, ticket: int) -> int:
            hot = D.HOT
            for other in streams:
                ev = device.events.acquire()
                try:
                    code = hot.record(ev, other) or hot.wait_event(stream, ev)
                finally:
                    device.events.release(ev)
                if code:
                    return code
            return enqueue(stream, word, ticket)

        return run

    def _host_source(self, arr: np.ndarray, state: Any, nbytes: int, cleanup: list) -> tuple[int, list]:
        """(a device-readable pointer holding ``arr``'s bytes, patches) for a host-to-device
        copy of ``arr``.

        A bounced device-to-host copy into bytes of ``arr`` that has not landed on the host
        yet holds their newest value in its bounce block, on the device side: the upload reads
        them from there. When one such copy last wrote every byte of ``arr``, the pointer is
        into its block, at ``arr``'s offset; else the pointer is ``arr`` itself (registered, or
        a bounce block copied from it now) and each such copy's bytes are *patches*: (offset
        in the destination, pointer into its block, bytes), copied over the upload's
        destination after it, oldest download first (``_with_patches``). (Bounces happen only
        for arrays whose pages are held by a busy registration that does not cover them.)"""
        addr = arr.__array_interface__["data"][0]
        bounced = [w for w in state.writers()
                   if getattr(w, "staging", None) is not None and not w.done()]
        if len(bounced) == 1 and state.written_by(bounced[0]):
            block = bounced[0].staging
            block.retain()
            cleanup.append(block.release)
            return block.ptr + (addr - block.host), []
        patches = []
        for w in sorted(bounced, key=lambda f: f.signal):       # (submission order)
            block = w.staging
            lo, hi = max(addr, block.host), min(addr + nbytes, block.host + block.nbytes)
            if lo < hi:
                block.retain()
                cleanup.append(block.release)
                patches.append((lo - addr, block.ptr + (lo - block.host), hi - lo))
        got = self.host.pin(arr)
        if got is None:            # its pages are held by a busy registration: bounce
            ptr, release = self.host.stage(nbytes)
            hostmem.memmove(ptr, addr, nbytes)
            cleanup.append(release)
            return ptr, patches
        ptr, release = got
        cleanup.append(release)
        return ptr, patches

    def _host_destination(self, arr: np.ndarray, state: Any, nbytes: int,
                          cleanup: list) -> tuple[int, list | None, Any]:
        """(device-writable pointer, host-side completion steps, bounce block) for a
        device-to-host copy into ``arr``."""
        after_bounce = any(getattr(w, "staging", None) is not None for w in state.writers())
        if not after_bounce:        # (after a bounced write, bounce too: host steps stay in order)
            got = self.host.pin(arr)
            if got is not None:
                ptr, release = got
                cleanup.append(release)
                return ptr, None, None
        addr = arr.__array_interface__["data"][0]
        block = hostmem.SharedBlock(*self.host.stage(nbytes), host=addr, nbytes=nbytes)
        cleanup.append(block.release)
        ptr = block.ptr
        return ptr, [lambda: hostmem.memmove(addr, ptr, nbytes)], block

    # -- hooks: joins and graphs ------------------------------------------------------------------
    def _join_lane(self, device: CudaDevice, live: list, deps: dict) -> Any:
        """The lane of the live futures if they share one, else a compute lane of the device."""
        lanes = {id(f.lane): f.lane for f in live if f.lane is not None}
        return next(iter(lanes.values())) if len(lanes) == 1 else device._pick_lane(deps)

    def _encode_join(self, fut: Any, lane: Any, waits: Sequence, cleanup: list) -> tuple:
        """Device-side waits, then the lane's completion (word write or event record)."""
        return self._encode_on_lane(fut, lane, waits, cleanup, _nothing)

    def _instantiate(self, graph: Any) -> Any:
        from .graphs import CudaGraphExec
        return CudaGraphExec(graph)

    # -- stats, description, shutdown ------------------------------------------------------------
    def _backend_stats(self) -> dict:
        return {
            "signals_in_use": sum(d.events.in_use for d in self.devices),
            "host_locks": self.host.in_use,
            "host_registrations": len(self.host._runs),
            "host_bounced": self.host.bounced,
            "events_created": sum(d.events.created for d in self.devices),
            "spin_hits": self.hub.spin_hits,
            "spin_misses": self.hub.spin_misses,
            "arms": self.hub.arms,
            "wakeups": self.hub.wakeups,
        }

    def describe(self) -> str:
        """The backend, why, and every device with its streams."""
        lines = [super().describe(), f"hot path: {D.HOT.name} ({D.HOT_REASON})"]
        for dev in self.devices:
            lines.append(f"device {dev.name}: {dev.product} ({dev.isa})")
            lines.append(f"    streams: {', '.join(lane.name for lane in dev.lanes)}")
            lines.append(f"    stream memory operations: {'yes' if dev.memops else 'no (events)'}")
            peers = ", ".join(f"gpu{i}" for i in sorted(dev.peers)) or "none"
            lines.append(f"    peer access to: {peers}")
        return "\n".join(lines)

    def _release(self) -> None:
        for dev in self.devices:
            dev._destroy()          # synchronises: no host function posts the semaphore after
        self.host.close()
        self.hub.close()
        for dev in self.devices:
            dev.release_context()
        D.forget_current()


def _encode_with(rt: CudaRuntime, enqueue: Any, fut: Any, lane: Any, waits: Sequence, cleanup: list) -> tuple:
    return rt._encode_on_lane(fut, lane, waits, cleanup, enqueue)
