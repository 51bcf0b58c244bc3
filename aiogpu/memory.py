"""Device memory: buffers, a buddy sub-allocator over 2 MiB blocks, and host-memory locking.

Small allocations come from 2 MiB blocks split buddy-fashion (power-of-two pieces, at least
``MIN_PIECE`` bytes, aligned to their size), so that many small buffers share a few huge-page
blocks. Large allocations are rounded up to a multiple of 2 MiB and placed at a 2 MiB-aligned
address (fewer TLB misses and page tables). A buffer returns to the allocator only when no
pending GPU work uses it.
"""
from __future__ import annotations

import collections
import weakref
from typing import Any, Callable

import numpy as np

from .errors import NotOnCudaError, RuntimeClosedError

BLOCK = 2 << 20          # 2 MiB: huge-page size, the unit of every allocation from the driver
MIN_PIECE = 256
MIN_ORDER = MIN_PIECE.bit_length() - 1
BLOCK_ORDER = BLOCK.bit_length() - 1
SMALL_LIMIT = BLOCK // 2  # larger requests get blocks of their own


def round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


class BuddyAllocator:
    """Power-of-two pieces carved from 2 MiB blocks; freeing merges buddies back.

    ``get_block()`` returns the address of a fresh 2 MiB-aligned block, ``put_block(addr)`` gives
    a fully free one back. Not thread-safe: the runtime lock guards it.
    """

    def __init__(self, get_block: Callable[[], int], put_block: Callable[[int], None]):
        self._get_block, self._put_block = get_block, put_block
        self._free: dict[int, set[int]] = {o: set() for o in range(MIN_ORDER, BLOCK_ORDER + 1)}
        self._used: dict[int, int] = {}   # address -> order
        self.blocks = 0

    @staticmethod
    def order_for(nbytes: int) -> int:
        return max(MIN_ORDER, (max(nbytes, 1) - 1).bit_length())

    def alloc(self, nbytes: int) -> int:
        order = self.order_for(nbytes)
        if order > BLOCK_ORDER:
            raise ValueError(f"{nbytes} bytes is too large for the sub-allocator")
        found = next((o for o in range(order, BLOCK_ORDER + 1) if self._free[o]), None)
        if found is None:
            self._free[BLOCK_ORDER].add(self._get_block())
            self.blocks += 1
            found = BLOCK_ORDER
        addr = self._free[found].pop()
        while found > order:        # split, keeping the upper half free
            found -= 1
            self._free[found].add(addr + (1 << found))
        self._used[addr] = order
        return addr

    def free(self, addr: int) -> None:
        order = self._used.pop(addr)
        while order < BLOCK_ORDER:
            buddy = addr ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            addr = min(addr, buddy)
            order += 1
        if order == BLOCK_ORDER:
            self._put_block(addr)
            self.blocks -= 1
        else:
            self._free[order].add(addr)

    @property
    def used(self) -> int:
        return len(self._used)


class DeviceMemory:
    """One device's memory over a backend's raw allocator: the buddy allocator for small buffers,
    2 MiB-aligned blocks of their own for large ones, and a cache of free blocks.

    A caching allocator: a block no buffer uses any more stays with the device, kept by size,
    and the next request of that size takes it back, so a steady state (a service allocating
    and freeing per request) makes no driver call. ``trim()`` gives the cached blocks back; an
    allocation the driver refuses trims and tries once more before raising OutOfMemoryError.

    ``raw_alloc(size)`` returns the address of ``size`` fresh bytes (raising OutOfMemoryError when
    there are none), ``raw_free(address)`` gives such an address back. Not thread-safe: the
    runtime lock guards it.
    """

    def __init__(self, raw_alloc: Callable[[int], int], raw_free: Callable[[int], None]):
        self._raw_alloc, self._raw_free = raw_alloc, raw_free
        self._bases: dict[int, int] = {}  # aligned address -> address the raw allocator returned
        self._sizes: dict[int, int] = {}  # every aligned block from the driver -> its size
        self._cache: dict[int, list[int]] = {}   # size -> free blocks kept for reuse
        self.cached_bytes = 0
        self.small = BuddyAllocator(lambda: self._aligned(BLOCK), self._release)
        self.large: dict[int, int] = {}   # address -> size
        # Addresses of buffers let go of, from any thread (see ``give_back``), freed by ``drain``.
        self.returned: collections.deque[int] = collections.deque()
        self.destroyed = False

    def give_back(self, address: int) -> None:
        """A buffer's memory is no longer used. Safe from any thread and never blocks: a garbage
        collection runs buffer finalizers in whatever thread it interrupts, possibly one that
        the holder of the runtime lock waits for (a deadlock if this took the lock). Freed at
        the next ``drain``, which the lock's holders call."""
        self.returned.append(address)

    def drain(self) -> None:
        """Free what ``give_back`` collected (under the runtime lock)."""
        returned = self.returned
        while returned and not self.destroyed:
            self.free(returned.popleft())

    def alloc(self, nbytes: int) -> tuple[int, int]:
        """(address, capacity) of ``nbytes`` of device memory."""
        if self.returned:
            self.drain()
        if nbytes <= SMALL_LIMIT:
            addr = self.small.alloc(nbytes)
            return addr, 1 << self.small.order_for(nbytes)
        size = round_up(nbytes, BLOCK)
        addr = self._aligned(size)
        self.large[addr] = size
        return addr, size

    def free(self, addr: int) -> None:
        if addr in self.large:
            del self.large[addr]
            self._release(addr)
        else:
            self.small.free(addr)

    def _aligned(self, size: int) -> int:
        """``size`` bytes at a 2 MiB-aligned address (huge pages: fewer TLB misses): a cached
        block of that size, else one from the driver (after trimming the cache if refused)."""
        cached = self._cache.get(size)
        if cached:
            self.cached_bytes -= size
            return cached.pop()
        try:
            return self._from_driver(size)
        except MemoryError:
            if not self.cached_bytes:
                raise
            self.trim()
            return self._from_driver(size)

    def _from_driver(self, size: int) -> int:
        ptr = self._raw_alloc(size)
        if ptr % BLOCK:
            self._raw_free(ptr)
            base = self._raw_alloc(size + BLOCK)
            ptr = round_up(base, BLOCK)
            self._bases[ptr] = base
        self._sizes[ptr] = size
        return ptr

    def _release(self, addr: int) -> None:
        """A block no buffer uses any more: kept for reuse."""
        size = self._sizes[addr]
        self._cache.setdefault(size, []).append(addr)
        self.cached_bytes += size

    def trim(self) -> int:
        """Give every cached free block back to the driver; returns the bytes given back."""
        self.drain()
        freed = self.cached_bytes
        for blocks in self._cache.values():
            for addr in blocks:
                del self._sizes[addr]
                self._raw_free(self._bases.pop(addr, addr))
        self._cache.clear()
        self.cached_bytes = 0
        return freed

    def destroy(self) -> None:
        """Give every block back (the runtime is closing; no buffer is usable any more)."""
        self.destroyed = True
        self.returned.clear()
        self.trim()
        for addr in list(self._sizes):
            del self._sizes[addr]
            self._raw_free(self._bases.pop(addr, addr))
        self.large.clear()

    @property
    def allocations(self) -> int:
        """Live allocations, small and large (a leak counter)."""
        return self.small.used + len(self.large)


def host_dtype(dtype: Any, what: str) -> np.dtype:
    """``dtype`` as a NumPy dtype whose bytes may be written by a device: numeric (bool,
    integer, float, complex) with a non-zero item size. Object, string, void and structured
    dtypes raise TypeError (raw bytes written into PyObject pointers would crash the process)."""
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{what}: {dtype!r} is not a NumPy dtype ({exc})") from None
    if dtype.kind not in "biufc" or dtype.itemsize == 0 or dtype.fields is not None:
        raise TypeError(f"{what}: dtype {dtype} is not numeric; GPU memory holds bool, integer, "
                        f"float or complex data")
    return dtype


class Buffer:
    """``nbytes`` of memory on one device.

    Allocation is synchronous and cheap. ``free()`` (or garbage collection) returns the memory
    only after every GPU operation that uses the buffer has retired.
    """

    def __init__(self, device: Any, address: int, nbytes: int, release: Callable[[int], None]):
        self.device = device
        self.address = address
        self.nbytes = nbytes
        self.users = 0                 # pending operations that use it
        self.freed = False
        self.last_write: Any = None    # ordering state, see ordering.py
        self.reads: list = []
        self._finalizer = weakref.finalize(self, release, address)

    def check_usable(self) -> None:
        """Raise ValueError for a freed buffer, RuntimeClosedError for a closed runtime."""
        if self.freed:
            raise ValueError(f"{self!r} was freed")
        if self.device.runtime.closed:
            raise RuntimeClosedError(f"{self!r}: its runtime is closed")

    def free(self) -> None:
        """Give the memory back once no pending GPU work uses it; the buffer is unusable after."""
        with self.device.runtime.lock:
            if self.freed:
                return
            self.freed = True
            if self.users == 0:
                self._finalizer()
                self.device.memory.drain()

    def unuse(self) -> None:
        """One operation using this buffer retired (under the runtime lock)."""
        self.users -= 1
        if self.users == 0 and self.freed:
            self._finalizer()
            self.device.memory.drain()

    def to_numpy(self, dtype: Any = np.uint8) -> Any:
        """A GPUFuture whose result is a new NumPy array holding a copy of the buffer.

        The array lives in the runtime's pinned host memory (so the copy needs no pinning); it
        stays valid after the runtime is closed. TypeError for a non-numeric dtype, ValueError
        when the buffer is not a whole number of elements."""
        dtype = host_dtype(dtype, "to_numpy")
        if self.nbytes % dtype.itemsize:
            raise ValueError(f"{self!r} is not a whole number of {dtype} elements")
        rt = self.device.runtime
        rt.check_open()
        with rt.lock:     # a new array in the runtime's pinned memory: no pinning per call
            out = rt.pinned.empty(self.nbytes, dtype)
            fut = rt.copy(out, self)     # (in the same section: one Ctrl-C hold, not two)
        fut.value = out
        return fut

    def fill(self, value: int, *, after: Any = ()) -> Any:
        """Fill with a repeated 32-bit ``value`` (device-side; nbytes must be a multiple of 4)."""
        if self.nbytes % 4:
            raise ValueError(f"fill writes 32-bit words; {self!r} is not a multiple of 4 bytes")
        return self.device.runtime.fill(self, value, after=after)

    # -- interop (CUDA devices only): a one-dimensional uint8 array of ``nbytes`` ----------------
    @property
    def __cuda_array_interface__(self) -> dict:
        """CUDA Array Interface v3 (CUDA buffers only; its ``stream`` is the pending writer's)."""
        return self._cuda("__cuda_array_interface__").cuda_array_interface(self)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        """A DLPack capsule (CUDA buffers only); ``stream`` waits on the device for pending work."""
        return self._cuda("__dlpack__").dlpack(self, stream=stream, max_version=max_version,
                                              dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._cuda("__dlpack_device__").dlpack_device(self)

    def _cuda(self, what: str) -> Any:
        if getattr(self.device, "dlpack", None) is None:
            raise NotOnCudaError(f"{what}: {self!r} is on the {self.device.runtime.backend} backend; "
                                 f"only CUDA buffers export device memory")
        return self.device

    def __repr__(self) -> str:
        return f"<Buffer {self.nbytes} B on {self.device.name} at 0x{self.address:x}>"
