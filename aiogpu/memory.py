"""Device memory: buffers, a buddy sub-allocator over 2 MiB blocks, and host-memory locking.

Small allocations come from 2 MiB blocks split buddy-fashion (power-of-two pieces, at least
``MIN_PIECE`` bytes, aligned to their size), so that many small buffers share a few huge-page
blocks. Large allocations are rounded up to a multiple of 2 MiB and placed at a 2 MiB-aligned
address (fewer TLB misses and page tables). A buffer returns to the allocator only when no
pending GPU work uses it.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Any, Callable

import numpy as np

from .errors import RuntimeClosedError
from .hsa_bindings import types as T

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
    """One device's memory: an HSA pool, the buddy allocator for small buffers, large blocks."""

    def __init__(self, api: Any, pool: Any, agents_for_access: Callable[[], list]):
        self._api, self._pool = api, pool
        self._agents_for_access = agents_for_access
        self._bases: dict[int, int] = {}  # aligned address -> address the pool returned
        self.small = BuddyAllocator(lambda: self._pool_alloc(BLOCK), self._pool_free)
        self.large: dict[int, int] = {}   # address -> size

    def alloc(self, nbytes: int) -> tuple[int, int]:
        """(address, capacity) of ``nbytes`` of device memory."""
        if nbytes <= SMALL_LIMIT:
            addr = self.small.alloc(nbytes)
            return addr, 1 << self.small.order_for(nbytes)
        size = round_up(nbytes, BLOCK)
        addr = self._pool_alloc(size)
        self.large[addr] = size
        return addr, size

    def free(self, addr: int) -> None:
        if addr in self.large:
            del self.large[addr]
            self._pool_free(addr)
        else:
            self.small.free(addr)

    def _pool_alloc(self, size: int) -> int:
        """``size`` bytes at a 2 MiB-aligned address, visible to every GPU agent (peer access)."""
        ptr = self._raw_alloc(size)
        if ptr % BLOCK:
            self._api.hsa_amd_memory_pool_free(ptr)
            base = self._raw_alloc(size + BLOCK)
            ptr = round_up(base, BLOCK)
            self._bases[ptr] = base
        agents = self._agents_for_access()
        if agents:
            arr = (T.hsa_agent_t * len(agents))(*agents)
            self._api.check(self._api.hsa_amd_agents_allow_access(len(agents), arr, None, ptr),
                            "hsa_amd_agents_allow_access")
        return ptr

    def _raw_alloc(self, size: int) -> int:
        out = ctypes.c_void_p()
        self._api.check(self._api.hsa_amd_memory_pool_allocate(self._pool, size, 0, ctypes.byref(out)),
                        f"hsa_amd_memory_pool_allocate({size})")
        return out.value

    def _pool_free(self, addr: int) -> None:
        self._api.hsa_amd_memory_pool_free(self._bases.pop(addr, addr))


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

    def unuse(self) -> None:
        """One operation using this buffer retired (under the runtime lock)."""
        self.users -= 1
        if self.users == 0 and self.freed:
            self._finalizer()

    def to_numpy(self, dtype: Any = np.uint8) -> Any:
        """A GPUFuture whose result is a new NumPy array holding a copy of the buffer."""
        dtype = np.dtype(dtype)
        if self.nbytes % dtype.itemsize:
            raise ValueError(f"{self!r} is not a whole number of {dtype} elements")
        out = np.empty(self.nbytes // dtype.itemsize, dtype=dtype)
        fut = self.device.runtime.copy(out, self)
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


class NotOnCudaError(TypeError, AttributeError):
    """CUDA interop asked of a buffer of another backend (an AttributeError too, so that
    ``hasattr(buf, "__cuda_array_interface__")`` answers False there)."""


def allocate(device: Any, nbytes: int) -> "Buffer":
    """``nbytes`` of ``device.memory`` as a Buffer (the ``alloc`` of every backend's devices)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"alloc takes a byte count, got {nbytes!r}")
    if nbytes <= 0:
        raise ValueError(f"alloc needs a positive byte count, got {nbytes}")
    rt = device.runtime
    with rt.lock:
        rt.check_open()
        address, _ = device.memory.alloc(int(nbytes))

    def release(address: int) -> None:
        with rt.lock:
            if not rt.closed:
                device.memory.free(address)

    return Buffer(device, address, int(nbytes), release)


class HostLocks:
    """Host arrays locked for the agents while GPU work uses them (pageable memory, not GTT).

    ``hsa_amd_memory_lock`` registers a range and returns the address agents must use for it,
    which may differ from the host address (libhsakmt's alternate VA). ``hsa_amd_memory_unlock``
    takes only the start address and, when two registrations start there, unlocks neither
    (ROCr: MemoryRegion::Unlock; libhsakmt finds the registration by its start only). So no two
    registrations here share a start: a range inside an existing registration uses it, else the
    array's root buffer (the whole memory its NumPy views share) is registered, so overlapping
    views of one array share one registration. Registrations are counted per use and unlocked
    when the last use retires. Call under the runtime lock.
    """

    def __init__(self, api: Any, agents: Callable[[], list]):
        self._api, self._agents = api, agents
        self._regs: dict[int, list[int]] = {}          # start -> [size, uses, agent address]
        self._uses: dict[tuple[int, int], list[int]] = {}   # (addr, size) -> [uses, registration start]

    def lock(self, addr: int, size: int, owner: Any = None) -> int:
        """Lock [addr, addr + size) (``owner``: the NumPy array holding it, whose root buffer is
        registered); returns the agent address of ``addr``. Raises ValueError if the memory
        can only be registered at a start another registration has (never for NumPy views of
        one buffer), HsaError if ROCr refuses."""
        use = self._uses.get((addr, size))
        if use is None:
            start = self._containing(addr, size)
            if start is None:
                start, length = root_range(owner, addr, size)
                if start in self._regs:
                    raise ValueError(f"host memory at 0x{start:x} is already locked as a range of "
                                     f"{self._regs[start][0]} bytes; ROCr cannot unlock two ranges with "
                                     f"one start address")
                self._regs[start] = [length, 0, self._register(start, length)]
            use = self._uses[(addr, size)] = [0, start]
        use[0] += 1
        reg = self._regs[use[1]]
        reg[1] += 1
        return reg[2] + (addr - use[1])

    def unlock(self, addr: int, size: int) -> None:
        """One use of [addr, addr + size) retired; the registration goes with its last use."""
        use = self._uses[(addr, size)]
        use[0] -= 1
        if use[0] == 0:
            del self._uses[(addr, size)]
        reg = self._regs[use[1]]
        reg[1] -= 1
        if reg[1] == 0:
            del self._regs[use[1]]
            self._api.hsa_amd_memory_unlock(use[1])

    def to_host(self, agent_address: int) -> int | None:
        """The host address behind an agent address of a registration (fault attribution)."""
        for start, (length, _uses, agent) in self._regs.items():
            if agent <= agent_address < agent + length:
                return start + agent_address - agent
        return None

    @property
    def count(self) -> int:
        return len(self._regs)

    def _containing(self, addr: int, size: int) -> int | None:
        return next((start for start, (length, _u, _a) in self._regs.items()
                     if start <= addr and addr + size <= start + length), None)

    def _register(self, start: int, length: int) -> int:
        agents = self._agents()
        arr = (T.hsa_agent_t * len(agents))(*agents)
        out = ctypes.c_void_p()
        self._api.check(self._api.hsa_amd_memory_lock(start, length, arr, len(agents), ctypes.byref(out)),
                        "hsa_amd_memory_lock")
        return out.value


def root_range(owner: Any, addr: int, size: int) -> tuple[int, int]:
    """(start, size) of the buffer that ``owner`` (a NumPy array) views, when it contains
    [addr, addr + size); else that range itself."""
    if isinstance(owner, np.ndarray):
        root = owner
        while isinstance(root.base, np.ndarray):
            root = root.base
        start, length = root.__array_interface__["data"][0], root.nbytes
        if root.base is not None:   # a view of another buffer (bytes, mmap, ctypes...): all of it
            try:
                whole = np.frombuffer(root.base, dtype=np.uint8)
                start, length = whole.__array_interface__["data"][0], whole.nbytes
            except (TypeError, ValueError, BufferError):
                pass
        if start <= addr and addr + size <= start + length:
            return start, length
    return addr, size
