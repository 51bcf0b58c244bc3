"""Memory pools and allocations in real memory, and what each emulated GPU may touch.

Models ROCr's memory model for the parts aiogpu relies on:
- every GPU agent has one coarse-grained device pool; the CPU agent has a fine-grained system
  pool flagged KERNARG_INIT (kernel arguments) and a plain fine-grained system pool;
- allocations are anonymous mmaps at real addresses, rounded to the 4 KiB granule; a size that is
  a multiple of 2 MiB gets a 2 MiB aligned address (huge-page friendly, as ROCr does);
- device memory is accessible to its own GPU and to the GPUs named in
  ``hsa_amd_agents_allow_access``; system-pool memory to every GPU; other host memory only while
  locked with ``hsa_amd_memory_lock``, and only through the *agent* address it returns, which
  differs from the host address (as libhsakmt's userptr registration without SVM gives an
  alternate GPU VA): a runtime that hands a GPU the host pointer faults. Registrations follow
  ROCr / libhsakmt (``MemoryRegion::Lock``/``Unlock``, ``fmm_register_user_memory``,
  ``vm_find_object_by_userptr``): locking the same (address, size) again counts up and returns the
  same agent address; any other range, overlapping or not, is a registration of its own with
  its own agent address; ``hsa_amd_memory_unlock(ptr)`` finds the registration by its start
  address only: with exactly one there it counts down (at zero the agent range is unmapped);
  with none, or several (same start, different sizes), nothing happens, and it still returns
  SUCCESS;
- a freed allocation is unmapped and forgotten, so a later GPU access is a memory fault, reported
  as "use after free" while the range is among the recently freed ones.

``resolve`` is how kernels and copies reach memory: a writable uint8 NumPy view of real memory, or
a ``MemoryFault``.
"""
from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ...errors import MemoryFault
from .. import types as T
from ._abi import StatusError, new_handle, require, store

PAGE = 4096
HUGE = 2 << 20
DEVICE_POOL_SIZE = 16 << 30
FREED_HISTORY = 4096


@dataclass(eq=False)
class Pool:
    handle: int
    owner: int  # agent handle
    gpu: int | None  # GPU index of a device pool, None for system pools
    flags: int
    size: int
    used: int = 0

    @property
    def is_system(self) -> bool:
        return self.gpu is None

    def describe(self) -> str:
        return "system pool" if self.is_system else f"device pool of GPU {self.gpu}"


@dataclass(eq=False)
class Allocation:
    base: int
    size: int
    pool: Pool
    mm: mmap.mmap | None
    offset: int  # of ``base`` inside ``mm``
    allowed: set[int] = field(default_factory=set)  # GPU indices granted access

    @property
    def end(self) -> int:
        return self.base + self.size

    def accessible_by(self, gpu: int | None) -> bool:
        return gpu is None or self.pool.is_system or gpu == self.pool.gpu or gpu in self.allowed

    def view(self, address: int, nbytes: int) -> np.ndarray:
        return np.frombuffer(self.mm, dtype=np.uint8, count=nbytes, offset=self.offset + address - self.base)


USERPTR_APERTURE = 0x0001_0000_0000_0000  # agent addresses of locked host memory: above any host VA


@dataclass(eq=False)
class LockedRange:
    """One registration of host memory: [base, base + size) on the host, mapped for ``gpus``
    at ``agent_base`` (page granular, keeping the host address's offset in its page)."""

    base: int
    size: int
    gpus: set[int]
    agent_base: int  # the agent address of ``base``
    count: int = 1

    @property
    def agent_pages(self) -> tuple[int, int]:
        """[start, end) of the agent address range mapped (whole pages)."""
        start = self.agent_base - self.base % PAGE
        return start, start + _round_up(self.base % PAGE + self.size, PAGE)

    def host_address(self, agent_address: int, nbytes: int, gpu: int | None) -> int | None:
        """The host address behind [agent_address, +nbytes) if this registration maps it for ``gpu``."""
        start, end = self.agent_pages
        if not (start <= agent_address and agent_address + nbytes <= end) or gpu not in self.gpus:
            return None
        return agent_address - self.agent_base + self.base

    def covers_host(self, address: int, nbytes: int) -> bool:
        return self.base <= address and address + nbytes <= self.base + self.size


def _mmap_address(mm: mmap.mmap) -> int:
    holder = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(holder)
    del holder  # release the buffer export so the mmap can be closed later
    return address


def _round_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def system_memory_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover
        return 16 << 30


class MemoryManager:
    """Pools, allocations (sorted by address for bisect lookup), locked host ranges."""

    def __init__(self, cpu_handle: int, gpu_handles: list[int]) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._allocs: list[Allocation] = []
        self._locks: list[LockedRange] = []
        self._next_agent_va = USERPTR_APERTURE
        self._freed: deque[tuple[int, int, str]] = deque(maxlen=FREED_HISTORY)
        self.gpu_count = len(gpu_handles)
        fine = T.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_FINE_GRAINED
        host = system_memory_size()
        self.kernarg_pool = Pool(new_handle(), cpu_handle, None,
                                 fine | T.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_KERNARG_INIT, host)
        self.system_pool = Pool(new_handle(), cpu_handle, None, fine, host)
        self.device_pools = [Pool(new_handle(), h, i, T.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_COARSE_GRAINED,
                                  DEVICE_POOL_SIZE) for i, h in enumerate(gpu_handles)]
        self._pools = {p.handle: p for p in [self.kernarg_pool, self.system_pool, *self.device_pools]}

    # ---- pools -----------------------------------------------------------------------------
    def pool(self, handle: int) -> Pool:
        pool = self._pools.get(handle)
        require(pool is not None, T.HSA_STATUS_ERROR_INVALID_MEMORY_POOL, f"unknown pool 0x{handle:x}")
        return pool

    def pools_of(self, agent_handle: int) -> list[Pool]:
        return [p for p in self._pools.values() if p.owner == agent_handle]

    def pool_info(self, pool: Pool, attribute: int, address: int) -> None:
        """``hsa_amd_memory_pool_get_info`` with the C types of hsa_ext_amd.h."""
        values = {
            T.HSA_AMD_MEMORY_POOL_INFO_SEGMENT: (ctypes.c_int32, T.HSA_AMD_SEGMENT_GLOBAL),
            T.HSA_AMD_MEMORY_POOL_INFO_GLOBAL_FLAGS: (ctypes.c_uint32, pool.flags),
            T.HSA_AMD_MEMORY_POOL_INFO_SIZE: (ctypes.c_size_t, pool.size),
            T.HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALLOWED: (ctypes.c_bool, True),
            T.HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_GRANULE: (ctypes.c_size_t, PAGE),
            T.HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALIGNMENT: (ctypes.c_size_t, PAGE),
            T.HSA_AMD_MEMORY_POOL_INFO_ACCESSIBLE_BY_ALL: (ctypes.c_bool, pool.is_system),
            T.HSA_AMD_MEMORY_POOL_INFO_ALLOC_MAX_SIZE: (ctypes.c_size_t, pool.size),
        }
        require(attribute in values, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, f"pool attribute {attribute}")
        ctype, value = values[attribute]
        store(address, ctype, value)

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, pool: Pool, size: int) -> int:
        require(size > 0, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "size 0")
        require(size <= pool.size, T.HSA_STATUS_ERROR_INVALID_ALLOCATION, "larger than ALLOC_MAX_SIZE")
        rounded = _round_up(size, PAGE)
        align = HUGE if size % HUGE == 0 else PAGE
        with self._lock:
            require(pool.used + rounded <= pool.size, T.HSA_STATUS_ERROR_OUT_OF_RESOURCES, "pool full")
            pool.used += rounded
        try:
            mm = mmap.mmap(-1, rounded + (align - PAGE))
        except OSError as exc:
            with self._lock:
                pool.used -= rounded
            raise StatusError(T.HSA_STATUS_ERROR_OUT_OF_RESOURCES, str(exc)) from exc
        start = _mmap_address(mm)
        base = _round_up(start, align)
        self._insert(Allocation(base, rounded, pool, mm, base - start))
        return base

    def free(self, address: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, address)
            found = i < len(self._starts) and self._starts[i] == address
            require(found, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, f"0x{address:x} is not an allocation")
            alloc = self._allocs.pop(i)
            del self._starts[i]
            alloc.pool.used -= alloc.size
            self._freed.append((alloc.base, alloc.end, alloc.pool.describe()))
        self._unmap(alloc)

    def allow_access(self, gpus: list[int], address: int) -> None:
        alloc = self.find(address)
        if alloc is None:
            with self._lock:
                known = any(lk.agent_pages[0] <= address < lk.agent_pages[1] or lk.covers_host(address, 1)
                            for lk in self._locks)
            require(known, T.HSA_STATUS_ERROR_INVALID_ARGUMENT,
                    f"0x{address:x} is neither an allocation nor locked host memory")
            return
        with self._lock:
            alloc.allowed.update(gpus)

    def lock(self, address: int, size: int, gpus: list[int]) -> int:
        """Register [address, address + size) for ``gpus``; returns its agent address (ROCr:
        MemoryRegion::Lock; libhsakmt: the same (address, size) is counted, not re-registered)."""
        require(address and size > 0, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL or empty host range")
        with self._lock:
            same = next((lk for lk in self._locks if (lk.base, lk.size) == (address, size)), None)
            if same is not None:
                same.count += 1
                same.gpus.update(gpus)
                return same.agent_base
            pages = _round_up(address % PAGE + size, PAGE)
            agent_base = self._next_agent_va + address % PAGE
            self._next_agent_va += pages + PAGE  # a guard page between registrations
            self._locks.append(LockedRange(address, size, set(gpus), agent_base))
            return agent_base

    def unlock(self, address: int) -> None:
        """ROCr: MemoryRegion::Unlock (its libhsakmt calls' failures are ignored): the one
        registration starting at ``address`` counts down; none or several: nothing happens."""
        with self._lock:
            starting = [lk for lk in self._locks if lk.base == address]
            if len(starting) != 1:
                return
            lk = starting[0]
            lk.count -= 1
            if lk.count == 0:
                self._locks.remove(lk)

    def locked(self) -> list[tuple[int, int, int, int]]:
        """(host address, size, agent address, count) of every registration."""
        with self._lock:
            return [(lk.base, lk.size, lk.agent_base, lk.count) for lk in self._locks]

    # ---- GPU access ------------------------------------------------------------------------
    def resolve(self, gpu: int | None, address: int, nbytes: int, write: bool = False) -> np.ndarray:
        """A uint8 view of [address, address + nbytes) as GPU ``gpu`` (None: the CPU) sees it."""
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        access = "write" if write else "read"
        if nbytes < 0 or address <= 0:
            raise MemoryFault(address, f"{access} of {nbytes} bytes at a NULL/invalid address")
        alloc = self.find(address)
        if alloc is not None:
            return self._resolve_allocation(alloc, gpu, address, nbytes, access)
        host = self._find_lock(address, nbytes, gpu)
        if host is not None:
            return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(host))
        raise MemoryFault(address, self._why_unknown(address, nbytes, gpu, access),
                          T.HSA_AMD_MEMORY_FAULT_PAGE_NOT_PRESENT)

    def find(self, address: int) -> Allocation | None:
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i >= 0 and address < self._allocs[i].end:
                return self._allocs[i]
        return None

    def release_all(self) -> None:
        with self._lock:
            allocs, self._allocs, self._starts = self._allocs, [], []
            self._locks.clear()
        for alloc in allocs:
            self._unmap(alloc)

    # ---- internals -------------------------------------------------------------------------
    def _insert(self, alloc: Allocation) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, alloc.base)
            self._starts.insert(i, alloc.base)
            self._allocs.insert(i, alloc)

    @staticmethod
    def _unmap(alloc: Allocation) -> None:
        mm, alloc.mm = alloc.mm, None
        try:
            mm.close()
        except BufferError:
            pass  # a NumPy view still exports it: unmapped when the last view dies

    def _resolve_allocation(self, alloc: Allocation, gpu: int | None, address: int, nbytes: int,
                            access: str) -> np.ndarray:
        if address + nbytes > alloc.end:
            raise MemoryFault(alloc.end, f"{access} of {nbytes} bytes at 0x{address:x} runs past the end of "
                              f"the {alloc.size}-byte allocation at 0x{alloc.base:x}")
        if not alloc.accessible_by(gpu):
            raise MemoryFault(address, f"{access} by GPU {gpu} of {alloc.pool.describe()} memory at 0x{address:x} "
                              f"without hsa_amd_agents_allow_access")
        mm = alloc.mm
        if mm is None:  # freed concurrently
            raise MemoryFault(address, f"use after free: {access} at 0x{address:x}")
        return alloc.view(address, nbytes)

    def _find_lock(self, address: int, nbytes: int, gpu: int | None) -> int | None:
        """The host address behind a locked range: GPUs reach it through its agent address,
        the CPU (``gpu`` None) through its host address."""
        with self._lock:
            for lk in self._locks:
                if gpu is None and lk.covers_host(address, nbytes):
                    return address
                if gpu is not None:
                    host = lk.host_address(address, nbytes, gpu)
                    if host is not None:
                        return host
        return None

    def _why_unknown(self, address: int, nbytes: int, gpu: int | None, access: str) -> str:
        with self._lock:
            freed = next((f for f in reversed(self._freed) if f[0] <= address < f[1]), None)
            host_of_lock = next((lk for lk in self._locks if lk.covers_host(address, nbytes)), None)
            other_agents = any(lk.host_address(address, nbytes, g) is not None for lk in self._locks
                               for g in range(self.gpu_count))
        if freed is not None:
            return f"use after free: {access} at 0x{address:x} in {freed[2]} memory [0x{freed[0]:x}, 0x{freed[1]:x}) freed earlier"
        if other_agents:
            return f"{access} by GPU {gpu} of host memory at 0x{address:x} locked for other agents only"
        if host_of_lock is not None:
            return (f"{access} by GPU {gpu} at host address 0x{address:x} of locked memory: GPUs reach it at "
                    f"its agent address 0x{host_of_lock.agent_base + address - host_of_lock.base:x} "
                    f"(hsa_amd_memory_lock's agent_ptr)")
        return (f"{access} of {nbytes} bytes at unknown address 0x{address:x} (neither allocated from a "
                f"pool nor locked with hsa_amd_memory_lock)")
