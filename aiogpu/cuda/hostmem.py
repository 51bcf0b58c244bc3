"""Host arrays for DMA: page-locked registration (cached, counted) and pinned staging.

- **Registration** (``cuMemHostRegister``, portable + device-mapped): the copy engines read and
  write the user's array in place. A registration covers whole pages, so two arrays that share a
  page would overlap: a view is registered with the whole array it views (up to 64 MiB, or 4x
  the view), so neighbouring slices share one registration; overlapping idle registrations are
  merged into one. Registrations stay
  cached while their arrays live (a weak reference to the array's owner unregisters them when it
  dies, before its memory is freed), so copying the same array again costs no pinning; idle
  ones beyond ``CACHE_BYTES`` are dropped oldest first. ``in_use`` counts the registrations
  pending copies hold (the leak checks' ``host_locks``).
- **Staging** (blocks of the runtime's pinned pool, ``aiogpu/hostpool.py``): the core copies
  small host sources into a pinned block at submission; and when an array's pages are held by a
  busy registration that does not cover it, the copy goes through a bounce block of its own
  (``bounced``). A bounced device-to-host copy lands in the array on the
  host, before its future completes; until then later host-to-device copies of those bytes read
  them from its bounce block on the device (``CudaRuntime._host_source``), later writes of them
  bounce too (host steps stay in order), and
  any future that depends on it runs that host step before it completes (``host_deps``).
- Memory that is already page-locked by someone else (``torch.Tensor.pin_memory()``, CuPy's
  pinned allocator, ``cuMemHostAlloc``) is used as it is.
"""
from __future__ import annotations

import bisect
import ctypes
import mmap
import weakref
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from . import driver as D
from .driver import cu

PAGE = mmap.PAGESIZE
CACHE_BYTES = 4 << 30


class _Run:
    __slots__ = ("start", "end", "users", "owners", "dead")

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        self.users = 0
        # Weak references to the arrays whose memory this covers, each calling back when its
        # array dies. Plain references, not weakref.finalize: finalize's exit function walks a
        # global registry, which the waiter thread changes while work retires during the exit.
        self.owners: list[weakref.ref] = []
        self.dead = False      # an owner died: unregister once idle


OWNER_RANGE_LIMIT = 64 << 20


def _owner_range(arr: np.ndarray, addr: int, n: int) -> tuple[int, int]:
    """The byte range to register for ``arr``: the whole array it is a view of, when that is
    not much larger (so that copies of neighbouring slices share one registration instead of
    overlapping ones), else ``arr``'s own bytes."""
    root = arr
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root is arr or not root.flags.c_contiguous:
        return addr, addr + n
    base = root.__array_interface__["data"][0]
    if root.nbytes > max(OWNER_RANGE_LIMIT, 4 * n) or not base <= addr < addr + n <= base + root.nbytes:
        return addr, addr + n
    return base, base + root.nbytes


class HostMemory:
    """Registrations and staging blocks of one runtime (guarded by the runtime lock)."""

    def __init__(self, runtime: Any):
        self.rt = runtime
        self._starts: list[int] = []
        self._runs: dict[int, _Run] = {}
        self._idle: OrderedDict[int, _Run] = OrderedDict()   # LRU of idle cached runs
        self.registered_bytes = 0
        self.foreign_pinned = 0
        self.bounced = 0         # copies that went through a bounce block

    # -- public ------------------------------------------------------------------------------------
    @property
    def in_use(self) -> int:
        return sum(1 for r in self._runs.values() if r.users)

    def pin(self, arr: np.ndarray) -> tuple[int, Callable[[], None]] | None:
        """(device-usable pointer, release) for DMA on ``arr`` in place; None when its pages are
        held by a busy registration that does not cover it (the caller then bounces)."""
        addr, n = arr.__array_interface__["data"][0], arr.nbytes
        lo, hi = _owner_range(arr, addr, n)
        start, end = lo // PAGE * PAGE, -(-hi // PAGE) * PAGE
        run = self._covering(start, end)
        if run is None:
            overlapping = self._overlapping(start, end)
            if any(r.users for r in overlapping):
                self.bounced += 1
                return None
            owners = []
            for r in overlapping:       # merge idle neighbours that share pages with this one
                start, end = min(start, r.start), max(end, r.end)
                owners += self._unregister(r)
            self.rt.devices[0].make_current()
            (err,) = cu.cuMemHostRegister(start, end - start,
                                          D.HOSTREGISTER_PORTABLE | D.HOSTREGISTER_DEVICEMAP)
            if err == D.ALREADY_REGISTERED or (err != 0 and self._pinned_elsewhere(addr)):
                if self._pinned_elsewhere(addr):
                    self.foreign_pinned += 1
                    return addr, _noop
                return None
            if err != 0:
                raise D.CudaError(f"cuMemHostRegister({end - start} bytes): {D.error_name(err)}",
                                  status=int(err))
            run = _Run(start, end)
            self._insert(run)
            for owner in owners:
                self._own_object(run, owner)
        self._own(run, arr)
        run.users += 1
        self._idle.pop(run.start, None)
        return addr, lambda: self._release(run)

    def stage(self, nbytes: int) -> tuple[int, Callable[[], None]]:
        """A pinned, device-mapped block of at least ``nbytes`` from the runtime's pinned pool
        (host address == device address: unified addressing); release gives it back."""
        address, _device, release = self.rt.pinned.block(nbytes)
        return address, release

    def close(self) -> None:
        for run in list(self._runs.values()):
            self._unregister(run)

    def registered(self, start: int, end: int) -> bool:
        """Whether a live registration covers [start, end) (page-aligned)."""
        return self._covering(start, end) is not None

    # -- registrations -------------------------------------------------------------------------------
    def _pinned_elsewhere(self, addr: int) -> bool:
        err, kind = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)
        return err == 0 and int(kind) == int(cu.CUmemorytype.CU_MEMORYTYPE_HOST)

    def _covering(self, start: int, end: int) -> _Run | None:
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0:
            run = self._runs[self._starts[i]]
            if run.end >= end and not run.dead:
                return run
        return None

    def _overlapping(self, start: int, end: int) -> list[_Run]:
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        out = []
        while i < len(self._starts) and self._starts[i] < end:
            run = self._runs[self._starts[i]]
            if run.end > start:
                out.append(run)
            i += 1
        return out

    def _insert(self, run: _Run) -> None:
        bisect.insort(self._starts, run.start)
        self._runs[run.start] = run
        self.registered_bytes += run.end - run.start

    def _own(self, run: _Run, arr: np.ndarray) -> None:
        owner = arr
        while isinstance(owner, np.ndarray) and owner.base is not None:
            owner = owner.base
        self._own_object(run, owner)

    def _own_object(self, run: _Run, owner: Any) -> None:
        if any(ref() is owner for ref in run.owners):
            return
        try:
            run.owners.append(weakref.ref(owner, lambda _ref: self._owner_died(run)))
        except TypeError:            # not weakly referenceable: no caching for this run
            run.dead = True

    def _owner_died(self, run: _Run) -> None:
        rt = self.rt
        with rt.lock:
            run.dead = True
            if run.users == 0 and not rt.closed and self._runs.get(run.start) is run:
                self._unregister(run)

    def _release(self, run: _Run) -> None:
        run.users -= 1
        if run.users:
            return
        if run.dead:
            self._unregister(run)
            return
        self._idle[run.start] = run
        while self.registered_bytes > CACHE_BYTES and self._idle:
            _, old = self._idle.popitem(last=False)
            self._unregister(old)

    def _unregister(self, run: _Run) -> list:
        """Unregister ``run``; returns the live owners it was tied to."""
        if self._runs.pop(run.start, None) is None:
            return []
        self._starts.remove(run.start)
        self._idle.pop(run.start, None)
        self.registered_bytes -= run.end - run.start
        owners = [o for o in (ref() for ref in run.owners) if o is not None]
        run.owners = []              # (their callbacks die with them: nothing calls back)
        self.rt.devices[0].make_current()
        cu.cuMemHostUnregister(run.start)
        return owners


def _noop() -> None:
    pass


class SharedBlock:
    """A staging block that several operations use (a bounced device-to-host copy and the
    host-to-device copies that read its bytes before they land): freed with the last user.
    ``host`` is where its bytes land (the host address of the download's destination)."""

    __slots__ = ("ptr", "refs", "_release", "host", "nbytes")

    def __init__(self, ptr: int, release: Callable[[], None], host: int = 0, nbytes: int = 0):
        self.ptr, self.refs, self._release = ptr, 1, release
        self.host, self.nbytes = host, nbytes

    def retain(self) -> None:
        self.refs += 1

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            self._release()


def host_pointer(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def memmove(dst: int, src: int, n: int) -> None:
    ctypes.memmove(dst, src, n)
