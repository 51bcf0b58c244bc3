"""Lanes (a CUDA stream, its completion word and the futures pending on it) and event pools.

A lane is to the CUDA backend what an AQL queue or an SDMA engine is to HSA: work on one lane
runs in order. After operation *t* a lane writes *t* into its **completion word**, a 64-bit word
in pinned, device-mapped host memory (``cuStreamWriteValue64``, ordered after the operation with
a memory barrier). That word is the CUDA form of an HSA signal:
- "is *t* done" is one load of host memory (about 0.05 us) instead of a ``cuEventQuery``
  (about 1 us on the H200 machine), and when it reads done every operation before *t* on the
  lane is done too (the spin and the waiter settle whole prefixes);
- work on another lane (or device) that depends on *t* waits for it on the device with
  ``cuStreamWaitValue64(word >= t)``: no event to record per operation, no host round trip.
Where the device lacks 64-bit stream memory operations (or with ``event_waits=True`` /
``completion_words=False``), each operation records an event instead and dependencies use
``cuStreamWaitEvent``. Errors show in event or stream queries (sticky CUDA errors), never in words.
"""
from __future__ import annotations

import ctypes
from collections import deque
from typing import Any

from . import driver as D
from .driver import cu

WORD_STRIDE = 64         # one cache line per lane: the GPU's writes never share a line
PAGE = 4096


class EventPool:
    """Events of one context (timing disabled: cheapest to record). An event goes back to the
    pool when its future has retired: a ``cuStreamWaitEvent`` already issued keeps waiting on
    the record it saw, so re-recording a pooled event never disturbs earlier waits. Events are
    handed out as ints (the hot path's handles)."""

    def __init__(self, device: Any):
        self.device = device
        self._free: list[int] = []
        self.in_use = 0
        self.created = 0

    def acquire(self) -> int:
        self.in_use += 1
        if self._free:
            return self._free.pop()
        self.device.make_current()
        self.created += 1
        return int(D.check(cu.cuEventCreate(D.EVENT_DISABLE_TIMING), "cuEventCreate"))

    def release(self, event: int) -> None:
        self.in_use -= 1
        self._free.append(event)

    def destroy(self) -> None:
        for ev in self._free:
            cu.cuEventDestroy(ev)
        self._free.clear()


class CompletionWords:
    """Pinned, device-mapped host pages carved into one completion word per lane."""

    def __init__(self, device: Any):
        self.device = device
        self._pages: list[int] = []
        self._next = PAGE

    def slot(self) -> tuple[int, Any]:
        """(host address, device pointer object) of a fresh word, zeroed."""
        if self._next + WORD_STRIDE > PAGE:
            self.device.make_current()
            host = int(D.check(cu.cuMemHostAlloc(PAGE, D.HOSTALLOC_PORTABLE | D.HOSTALLOC_DEVICEMAP),
                               "cuMemHostAlloc(completion words)"))
            ctypes.memset(host, 0, PAGE)
            self._pages.append(host)
            self._next = 0
        host = self._pages[-1] + self._next
        self._next += WORD_STRIDE
        dptr = D.check(cu.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer")
        return host, cu.CUdeviceptr(int(dptr))

    def destroy(self) -> None:
        for host in self._pages:
            cu.cuMemFreeHost(host)
        self._pages.clear()


class Lane:
    """One CUDA stream of a device, its completion word and pending futures (ticket order).

    ``spin`` is this lane's adaptive spin window (seconds); ``rate`` the copy bandwidth it has
    shown (bytes/s, None until learned), from which an awaiter of a long copy predicts when to
    start spinning. ``sh`` and ``wordp`` are the stream handle and the word's device pointer as
    ints (0 without a word), the hot path's handles.

    ``fused_word`` decides, once per lane, how a launch or copy on it completes: the word's
    pointer where the launch or copy call itself writes the ticket there after its work
    (``HotPath.launch``/``memcpy`` with ``word``: one C call on the C hot path), or 0 where
    the submission writes the word itself or records an event: the lane has no word (events),
    or the runtime records an event per operation (``event_waits``), which goes between the
    work and the word. ``CudaRuntime.submit`` applies it, to operations that are one launch or
    copy call (``fusable``); the rest get the separate write."""

    __slots__ = ("name", "device", "stream", "ticket", "armed", "pending", "kind", "word", "dptr",
                 "spin", "rate", "sh", "wordp", "fused_word")

    def __init__(self, device: Any, name: str, kind: str, *, priority: int = 0):
        device.make_current()
        stream = D.check(cu.cuStreamCreateWithPriority(D.STREAM_NON_BLOCKING, priority), f"cuStreamCreate({name})")
        try:
            self._attach(device, name, kind, stream)
        except BaseException:          # (its completion word could not be made)
            cu.cuStreamDestroy(stream)
            raise

    def _attach(self, device: Any, name: str, kind: str, stream: Any) -> None:
        self.device, self.name, self.kind = device, name, kind
        self.stream = stream
        self.sh = int(stream)
        self.ticket = 0          # operations submitted so far
        self.armed = 0           # a host-function wake-up is queued after this ticket
        self.pending: deque = deque()
        self.spin = device.runtime.hub.spin_s
        self.rate: float | None = None
        self.word = self.dptr = None
        self.wordp = 0
        if device.words is not None:
            host, self.dptr = device.words.slot()
            self.word = ctypes.c_uint64.from_address(host)
            self.wordp = int(self.dptr)
        self.fused_word = 0 if device.runtime.event_waits else self.wordp

    @property
    def handle(self) -> int:
        return int(self.stream)

    def done_upto(self) -> int:
        """The last ticket known complete from the word (0 without a word)."""
        return self.word.value if self.word is not None else 0

    def arm(self, fn: int, data: int) -> int:
        """Queue the host function ``fn(data)`` after the lane's current work (a wake-up)."""
        return D.HOT.host_func(self.sh, fn, data)

    def destroy(self) -> None:
        if self.stream is not None:
            cu.cuStreamDestroy(self.stream)
            self.stream = None

    def __repr__(self) -> str:
        return f"<Lane {self.name} ticket={self.ticket} pending={len(self.pending)}>"


class ForeignLane(Lane):
    """Another library's CUDA stream (torch, CuPy, a raw handle) as a lane of ``device``.

    A future for it (``aiogpu.stream_future``) is one write of the lane's completion word queued
    on that stream (``cuStreamWriteValue64``, the only thing aiogpu adds to it; a pooled event
    where the device has no stream memory operations). Such futures complete in stream order, as
    a lane's do, so the spin and the waiter settle them like any lane's: the spin reads the word
    (a memory load, no ``cuEventQuery``), and a completion seen by the spin is settled off the
    loop. A parked awaiter is woken through a stream of aiogpu's own (``arm_stream``, created at
    the first park) that waits for the newest ticket (or event) and then runs the wake-up host
    function: nothing is queued on the library's stream that would delay its later work.
    A lane is kept per stream handle for the runtime's life; a stream destroyed while futures of
    it are pending is not supported (its handle may be reused by a new stream)."""

    __slots__ = ("arm_stream",)

    def __init__(self, device: Any, handle: int):
        # Its stream is the library's; the completion word, as a Lane's, is written after each
        # future's point.
        self._attach(device, f"{device.name}.stream{handle:#x}", "foreign", cu.CUstream(handle))
        self.arm_stream: Any = None

    def arm(self, fn: int, data: int) -> int:
        newest = self.pending[-1] if self.pending else None
        if newest is None or newest.retired or (newest.event is None and self.dptr is None):
            return 0
        if self.arm_stream is None:
            self.device.make_current()
            err, stream = cu.cuStreamCreate(D.STREAM_NON_BLOCKING)
            if err != 0:
                return int(err)
            self.arm_stream = stream
        hot, arm = D.HOT, int(self.arm_stream)
        if newest.event is not None:
            code = hot.wait_event(arm, newest.event)
        else:
            code = hot.wait64(arm, self.wordp, newest.ticket, D.WAIT_GEQ)
        return int(code) or hot.host_func(arm, fn, data)

    def destroy(self) -> None:
        if self.arm_stream is not None:
            cu.cuStreamDestroy(self.arm_stream)
            self.arm_stream = None

    def __repr__(self) -> str:
        return f"<ForeignLane {self.name} ticket={self.ticket} pending={len(self.pending)}>"
