"""Completion words and event pools; the lanes (a CUDA stream, its completion word and the
futures pending on it) are ``encode.Lane``, re-exported here.

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
from typing import Any

from . import driver as D
from .driver import cu
from .encode import ForeignLane, Lane, wait_on_device  # noqa: F401 - the lanes live with the launch encode

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
