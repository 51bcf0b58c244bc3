"""Device memory: buffers, a buddy sub-allocator over 2 MiB blocks, and host-memory locking.

Small allocations come from 2 MiB blocks split buddy-fashion (power-of-two pieces, at least
``MIN_PIECE`` bytes, aligned to their size), so that many small buffers share a few huge-page
blocks. Large allocations are rounded up to a multiple of 2 MiB and placed at a 2 MiB-aligned
address (fewer TLB misses and page tables). A buffer returns to the allocator only when no
pending GPU work uses it.
"""
from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

try:
    import cython  # type: ignore[import-untyped,import-not-found,unused-ignore]
except ImportError:            # interpreted, where Cython is not installed (see _core/interrupts.py)
    globals()["cython"] = type("cython", (), {"compiled": False})
if not cython.compiled:
    get_value: Any = None    # (the .pxd's C function, used only compiled)

from . import capture as _capture
from ._core.copies import download
from ._core.hazards import BufferState
from ._core.submit import reap, writers_lane
from .errors import NotOnCudaError, RuntimeClosedError

if TYPE_CHECKING:
    from ._core.futures import GPUFuture

BLOCK = 2 << 20          # 2 MiB: huge-page size, the unit of every allocation from the driver
MIN_PIECE = 256
MIN_ORDER = MIN_PIECE.bit_length() - 1
BLOCK_ORDER = BLOCK.bit_length() - 1
SMALL_LIMIT = BLOCK // 2  # larger requests get blocks of their own
# The free-list cache of each size class holds up to this many bytes, and at least CACHE_MIN pieces.
CACHE_BYTES = 4 << 20
CACHE_MIN = 4


def round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


class BuddyAllocator:
    """Power-of-two pieces carved from 2 MiB blocks; freeing merges buddies back.

    In front of the buddy lists sits a free-list cache per size class: a freed piece waits
    there (up to ``CACHE_BYTES`` per class, at least ``CACHE_MIN`` pieces) and the next request
    of its class takes it back, so a steady state (a service allocating and freeing the same
    sizes per request) is a list pop and append. ``flush()`` merges the cached pieces back.

    ``get_block()`` returns the address of a fresh 2 MiB-aligned block, ``put_block(addr)`` gives
    a fully free one back. The runtime lock guards it, except ``take_cached`` and ``recycle``,
    which any thread may call at any time (each is a few operations that the GIL makes atomic:
    a list pop or append and a dict store or delete, on state no other method leaves
    half-changed between two such operations). So the methods under the lock take a cached
    piece with one pop, never a test of the list and then a pop: ``take_cached`` may empty it
    in between.
    """

    def __init__(self, get_block: Callable[[], int], put_block: Callable[[int], None]):
        self._get_block, self._put_block = get_block, put_block
        self._free: dict[int, set[int]] = {o: set() for o in range(MIN_ORDER, BLOCK_ORDER + 1)}
        self._used: dict[int, int] = {}   # address -> order, of every piece handed out
        # Freed pieces kept for reuse, by order (index), and how many each order keeps at most.
        self._cache: list[list[int]] = [[] for _ in range(BLOCK_ORDER + 1)]
        self._cap = [max(CACHE_MIN, CACHE_BYTES >> o) for o in range(BLOCK_ORDER + 1)]
        self.blocks = 0

    @staticmethod
    def order_for(nbytes: int) -> int:
        return MIN_ORDER if nbytes <= MIN_PIECE else (nbytes - 1).bit_length()

    def alloc(self, nbytes: int) -> int:
        """The address of a piece of at least ``nbytes`` (ValueError above a block)."""
        order = MIN_ORDER if nbytes <= MIN_PIECE else (nbytes - 1).bit_length()   # (order_for, inline)
        if order > BLOCK_ORDER:
            raise ValueError(f"{nbytes} bytes is too large for the sub-allocator")
        try:        # (a bare pop, never a look then a pop: take_cached may empty the list between)
            addr = self._cache[order].pop()
        except IndexError:
            pass
        else:
            self._used[addr] = order
            return addr
        free = self._free
        for found in range(order, BLOCK_ORDER + 1):     # the smallest free piece that fits
            if free[found]:
                break
        else:
            free[BLOCK_ORDER].add(self._get_block())
            self.blocks += 1
            found = BLOCK_ORDER
        addr = free[found].pop()
        while found > order:        # split, keeping the upper half free
            found -= 1
            free[found].add(addr + (1 << found))
        self._used[addr] = order
        return addr

    def take_cached(self, nbytes: int) -> int | None:
        """A cached piece for ``nbytes`` (1 to SMALL_LIMIT), else None; any thread, no lock."""
        order = MIN_ORDER if nbytes <= MIN_PIECE else (nbytes - 1).bit_length()
        try:
            addr = self._cache[order].pop()
        except IndexError:
            return None
        self._used[addr] = order
        return addr

    def recycle(self, addr: int) -> bool:
        """Put the piece at ``addr`` in its class's cache if there is room (True); False when it
        is not a piece of this allocator or the cache is full (then ``free`` it under the lock).
        Any thread, no lock."""
        order = self._used.get(addr)
        if order is None:
            return False
        cached = self._cache[order]
        if len(cached) >= self._cap[order]:
            return False
        del self._used[addr]
        cached.append(addr)
        return True

    def free(self, addr: int) -> None:
        """Give the piece at ``addr`` back: to its class's cache, else merged with its buddies."""
        order = self._used.pop(addr)
        cached = self._cache[order]
        if len(cached) < self._cap[order]:
            cached.append(addr)
        else:
            self._merge(addr, order)

    def _merge(self, addr: int, order: int) -> None:
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

    def flush(self) -> None:
        """Merge every cached piece back into the buddy lists (whole free blocks go back)."""
        for order, cached in enumerate(self._cache):
            while True:     # (pop until empty: take_cached may take from the list meanwhile)
                try:
                    addr = cached.pop()
                except IndexError:
                    break
                self._merge(addr, order)

    @property
    def used(self) -> int:
        """Pieces handed out and not freed (cached ones are free)."""
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
        the holder of the runtime lock waits for (a deadlock if this took the lock). A small
        piece goes straight to its size class's cache when there is room; anything else is
        freed at the next ``drain``, which the lock's holders call. Nothing after ``destroy``
        (and no module global is read: this runs during interpreter shutdown too)."""
        if self.destroyed:
            return
        if not self.small.recycle(address):
            self.returned.append(address)

    def take(self, nbytes: int) -> int | None:
        """The address of a cached small piece for ``nbytes`` (1 or more), else None (then
        ``alloc`` under the lock). Any thread, no lock: the steady state of a service."""
        if nbytes > SMALL_LIMIT or self.returned or self.destroyed:
            return None
        return self.small.take_cached(nbytes)

    def drain(self) -> None:
        """Free what ``give_back`` collected (under the runtime lock)."""
        returned = self.returned
        while returned and not self.destroyed:
            self.free(returned.popleft())

    def alloc(self, nbytes: int) -> int:
        """The address of ``nbytes`` (1 or more) of device memory."""
        if self.returned:
            self.drain()
        if nbytes <= SMALL_LIMIT:
            return self.small.alloc(nbytes)
        size = round_up(nbytes, BLOCK)
        addr = self._aligned(size)
        self.large[addr] = size
        return addr

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
            self.small.flush()              # cached pieces may free whole blocks
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
        self.small.flush()
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
    def driver_bytes(self) -> int:
        """Bytes held from the driver (in use or cached for reuse)."""
        return sum(self._sizes.values())

    @property
    def allocations(self) -> int:
        """Live allocations, small and large (a leak counter)."""
        return self.small.used + len(self.large)


# Requests host_dtype accepted (scalar types, names, dtypes) -> the dtype it returned: a copy
# from an array or a to_numpy names the same few dtypes again and again.
_HOST_DTYPES: dict = {}
# NumPy scalar types (np.float32, ...) that ``to_numpy`` was given, as their validated dtypes.
_NUMPY_TYPES: dict = {}
# The capture context variable, read per download (one module lookup less than ``_capture._active``).
_capture_active = _capture._active


def host_dtype(dtype: Any, what: str) -> np.dtype:
    """``dtype`` as a NumPy dtype whose bytes may be written by a device: numeric (bool,
    integer, float, complex, and ml_dtypes' ``bfloat16`` where installed) with a non-zero item
    size, in native byte order. Object, string, void, datetime and structured dtypes raise
    TypeError (raw bytes written into PyObject pointers would crash the process)."""
    kind = type(dtype)
    if kind is type or kind is str or isinstance(dtype, np.dtype):
        got = _HOST_DTYPES.get(dtype)
        # (a dtype itself only: another that compares equal to it may differ in metadata)
        if got is not None and (got is dtype or kind is type or kind is str):
            return got
        key = dtype
    else:
        key = None
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{what}: {dtype!r} is not a NumPy dtype ({exc})") from None
    numeric = dtype.kind in "biufc" or dtype.name == "bfloat16"
    if not numeric or dtype.itemsize == 0 or dtype.fields is not None or dtype.subdtype is not None:
        raise TypeError(f"{what}: dtype {dtype} is not numeric; GPU memory holds bool, integer, "
                        f"float or complex data")
    if not dtype.isnative:
        raise TypeError(f"{what}: dtype {dtype.str} is not in native byte order")
    if key is not None and len(_HOST_DTYPES) < 256:
        _HOST_DTYPES[key] = dtype
    return dtype


def _index(value: Any, what: str) -> int:
    """``value`` as a Python int (TypeError for bools, floats and other non-integers)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    return int(value)


def _shape(shape: Any, itemsize: int, room: int) -> tuple[int, ...]:
    """A view's shape: ``shape`` validated (positive integers), or all of ``room`` bytes."""
    if shape is None:
        if room % itemsize:
            raise ValueError(f"{room} bytes are not a whole number of {itemsize}-byte elements; "
                             f"give a shape")
        return (room // itemsize,)
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    if not isinstance(dims, (tuple, list)) or not dims:
        raise TypeError(f"shape must be an integer or a non-empty tuple of integers, got {shape!r}")
    out = tuple(_index(d, "shape entries") for d in dims)
    if any(d <= 0 for d in out):
        raise ValueError(f"shape entries must be positive, got {shape!r}")
    if math.prod(out) * itemsize > room:
        raise ValueError(f"a view of shape {out} needs {math.prod(out) * itemsize} bytes; only "
                         f"{room} are left")
    return out


def _init_state(s: BufferState, device: Any, address: int, nbytes: int) -> None:
    """A new allocation's core fields (``Buffer.__init__``): whole, unused, unordered."""
    s.device = device
    s.address = address
    s.nbytes = nbytes
    s._base = None                 # the allocation a view views (see ``Buffer.root``)
    s.offset = 0                   # byte offset from root.address
    s.typed_dtype = None           # None: raw bytes (any pointer argument)
    s._shape = (nbytes,)
    s.users = 0                    # pending operations that use it
    s.freed = False
    s.last_write = None            # ordering state, see _core/hazards.py
    s.reads = []
    s.ranges = None                # ordering state by byte range, once views are used


def _free(buf: Any) -> None:
    """``Buffer.free`` (its fields read as C fields where this module is compiled)."""
    s = buf
    if s._base is not None:
        raise TypeError(f"{buf!r} is a view; free the buffer it views (its .base)")
    # No lock: ``users`` only drops to zero under the lock, in ``_unuse``, which gives the
    # memory back itself once ``freed`` is set; ``_give`` makes the two racing callers one.
    if s.freed:
        return
    s.freed = True
    if s.users == 0:
        b = buf
        b._give()
        memory = s.device.memory
        if memory.returned:     # a large block (or a full cache): back now, under the lock
            with s.device.runtime.lock:
                memory.drain()


def alloc_plain(device: Any, nbytes: Any) -> "Buffer | None":
    """``Device.alloc`` of the common case in one call: a positive int no larger than
    ``SMALL_LIMIT`` whose size class has a cached piece (``DeviceMemory.take``), the runtime
    open, allocations not tracked. None, having done nothing, for anything else: the caller's
    general path then validates (and names what is wrong) and allocates."""
    if type(nbytes) is not int or nbytes <= 0 or nbytes > SMALL_LIMIT:
        return None
    rt = device.runtime
    if rt.closed or rt.track_allocations:
        return None
    memory = device.memory
    address = memory.take(nbytes)
    if address is None:
        return None
    return _new_buffer(device, address, nbytes, memory.give_back)


def _new_buffer(device: Any, address: int, nbytes: int, release: Callable[[int], None]) -> "Buffer":
    """``Buffer(device, address, nbytes, release)`` without the call of a class (compiled: an
    extension type's allocation and C field writes)."""
    buf = Buffer.__new__(Buffer)
    _init_buffer(buf, device, address, nbytes, release)
    return buf


def _init_buffer(buf: "Buffer", device: Any, address: int, nbytes: int, release: Callable[[int], None]) -> None:
    """A new allocation's fields (``Buffer.__init__``, ``_new_buffer``): the core's (whole,
    unused, unordered), the function that gives its memory back (any thread, never blocks),
    and the flag that says the memory is still the buffer's: ``_give`` takes it, exactly once,
    whichever of free(), the last user's retirement (waiter thread) and __del__ gets there
    first."""
    _init_state(buf, device, address, nbytes)
    buf._release = release
    buf.allocated_at = None        # (set after, while the runtime tracks allocations)
    buf._owned = True


def _to_numpy(buf: Any, dtype: Any) -> "GPUFuture[np.ndarray]":
    """``Buffer.to_numpy`` (its fields read as C fields where this module is compiled)."""
    s = buf
    rt = s.device.runtime
    if (s if s._base is None else s._base).freed or rt.closed:
        buf._check_usable()               # (raises what it raises for either)
    if dtype is None:
        dtype, shape = buf.dtype, s._shape
    else:
        # (the dtypes asked for by their NumPy type, validated once: a service asks per request)
        valid = _NUMPY_TYPES.get(dtype) if type(dtype) is type else None
        if valid is None:
            valid = host_dtype(dtype, "to_numpy")
            if type(dtype) is type and len(_NUMPY_TYPES) < 64:
                _NUMPY_TYPES[dtype] = valid
        dtype = valid
        if s.nbytes % dtype.itemsize:
            raise ValueError(f"{buf!r} is not a whole number of {dtype} elements")
        shape = None
    active = get_value(_capture_active) if cython.compiled else _capture_active.get()   # (a C call, compiled)
    if active is not None and _capture.current(rt) is not None:
        # Nothing would fill the new array until a replay, and every replay would overwrite
        # it: a graph copies into host memory the caller owns.
        raise TypeError("to_numpy cannot be captured: inside a graph, copy into an array of "
                        "your own, aiogpu.copy(out, buf), and read it after each replay")
    reap(rt)     # (others' finished work first: see submit.reap)
    lock = rt.lock    # a new array in the runtime's pinned memory: no pinning per call
    lock.enter()
    try:
        if rt.closed:
            rt._check_open()
        out, address, ptr = rt.pinned.empty_at(s.nbytes, dtype)
        if shape is not None and len(shape) != 1:
            out = out.reshape(shape)
        # (In the same section: one Ctrl-C hold, not two.)
        fut = download(rt, s, out, address, ptr)
    finally:
        lock.exit()
    fut.value = out
    return fut


class Buffer(BufferState):
    """``nbytes`` of memory on one device, or a view of part of such memory.

    Allocation is synchronous and cheap. ``free()`` (or garbage collection) returns the memory
    only after every GPU operation that uses the buffer has retired.

    A buffer from ``Device.alloc`` is *raw*: a one-dimensional array of ``nbytes`` uint8, which
    any pointer argument of a kernel accepts; ``len()`` is its byte count and ``buf[a:b]`` a raw
    view of bytes ``a`` to ``b``. ``buf.view(dtype, shape, offset)`` is a *typed* view; slicing
    it selects elements along its first axis. A view is a Buffer too (``copy``, ``launch``,
    ``fill``, ``to_numpy`` and the interop exports take it); it owns no memory, keeps its
    ``base`` (the allocation) alive, and is unusable once the base is freed. GPU work on views
    is ordered by the bytes it touches: work on disjoint views of one buffer may overlap,
    overlapping views are ordered as one buffer is.

    ``allocated_at``: where ``Device.alloc`` made it (a ``traceback.StackSummary``) when its
    runtime tracks allocations (``Runtime.track_allocations``), else None.

    The state the core reads per operation (users, freed, ordering state, the viewed
    allocation) lives in fields of ``BufferState``, its base (typed where the core is compiled).
    """

    if TYPE_CHECKING:
        allocated_at: Any
        _release: Callable[[int], None]
        _owned: bool

    def __init__(self, device: Any, address: int, nbytes: int, release: Callable[[int], None]):
        # (Its fields set as C fields where this module is compiled: this runs per allocation.)
        _init_buffer(self, device, address, nbytes, release)

    def __del__(self) -> None:
        # Not weakref.finalize: one per buffer cost a registry entry, and at exit its atexit
        # hook iterated that registry while the waiter thread changed it. A view owns no
        # memory. Reads no module global: safe at interpreter shutdown.
        if self._owns():
            self._give()

    def _owns(self) -> bool:
        """Whether the memory is still this buffer's (always False for a view)."""
        return self._owned if cython.compiled else "_owned" in self.__dict__

    def _give(self) -> None:
        """Give the memory back, once: racing callers (any threads) give it once. Compiled,
        the flag is a C field, read and cleared with no Python call between (atomic under the
        GIL); interpreted, it is an entry of the instance dict, and a dict pop is atomic."""
        if cython.compiled:
            if not self._owned:
                return
            self._owned = False
        elif not self.__dict__.pop("_owned", None):
            return
        self._release(self.address)

    @property
    def released(self) -> bool:
        """Whether the memory went back to the allocator (a freed buffer's last user retired)."""
        return self._base is None and not self._owns()

    @classmethod
    def _view_of(cls, root: "Buffer", offset: int, nbytes: int, dtype: np.dtype | None,
                 shape: tuple[int, ...]) -> "Buffer":
        view = cls.__new__(cls)
        view.allocated_at = None
        view.device, view._base, view.offset = root.device, root, offset
        view.address, view.nbytes = root.address + offset, nbytes
        view.typed_dtype, view._shape = dtype, shape
        return view

    # -- what it is ----------------------------------------------------------------------------
    @property
    def root(self) -> "Buffer":
        """The allocation this is, or the one a view views. (Not an attribute referring to
        itself: that cycle would leave every Buffer to the cyclic garbage collector, and its
        memory unreturned until a collection.)"""
        base = self._base
        return self if base is None else base

    @property
    def is_view(self) -> bool:
        return self._base is not None

    @property
    def base(self) -> "Buffer | None":
        """The allocation a view views (None for an allocation), as NumPy's ``base``."""
        return self._base

    @property
    def dtype(self) -> np.dtype:
        """The element type: the view's, or uint8 for raw bytes."""
        return self.typed_dtype if self.typed_dtype is not None else _UINT8

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def __len__(self) -> int:
        """The length of the first axis: bytes for a raw buffer, elements for a 1-D view."""
        return self._shape[0]

    # -- views ---------------------------------------------------------------------------------
    def view(self, dtype: Any, shape: Any = None, offset: int = 0) -> "Buffer":
        """A typed view of this buffer's bytes from ``offset`` (bytes, relative to this buffer):
        ``shape`` elements of ``dtype`` (default: every whole element to the end), C order.

        No GPU work and no copy. Raises TypeError for a non-numeric dtype or non-integer offset
        or shape, ValueError for an offset or shape outside the buffer, an offset that is not a
        multiple of the item size (from the start of the allocation), or a freed buffer."""
        self._check_usable()
        dtype = host_dtype(dtype, "view")
        offset = _index(offset, "view offset")
        if not 0 <= offset < self.nbytes:
            raise ValueError(f"view offset {offset} is outside {self!r} (0 to {self.nbytes - 1})")
        start = self.offset + offset
        if start % dtype.itemsize:
            raise ValueError(f"view offset {offset} puts {dtype} elements at byte {start} of the "
                             f"allocation, not a multiple of their size {dtype.itemsize}")
        shape = _shape(shape, dtype.itemsize, self.nbytes - offset)
        return Buffer._view_of(self.root, start, math.prod(shape) * dtype.itemsize, dtype, shape)

    def __getitem__(self, key: Any) -> "Buffer":
        """``buf[a:b]``: a view of items ``a`` to ``b`` along the first axis (bytes of a raw
        buffer); ``view[i]`` of a view with two or more dimensions: its ``i``-th row.

        Bounds are checked, not clipped: IndexError outside the buffer, ValueError for an
        empty selection or a step other than 1, TypeError for other keys."""
        self._check_usable()
        n = self._shape[0]
        row = math.prod(self._shape[1:]) * self.dtype.itemsize
        if isinstance(key, slice):
            start, stop = _bound(key.start, 0, n), _bound(key.stop, n, n)
            if key.step not in (None, 1):
                raise ValueError(f"buffer slices are contiguous: step {key.step!r} is not supported")
            if stop <= start:
                raise ValueError(f"the slice [{start}:{stop}] of {self!r} is empty")
            shape = (stop - start, *self._shape[1:])
        elif isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)) and self.ndim > 1:
            start = _bound(key, 0, n)
            if start == n:
                raise IndexError(f"index {key} is out of bounds for length {n}")
            shape = self._shape[1:]
        else:
            raise TypeError(f"index a buffer with a slice (a row: an integer, for views of 2 or more "
                            f"dimensions), got {key!r}")
        return Buffer._view_of(self.root, self.offset + start * row, math.prod(shape) * self.dtype.itemsize,
                               self.typed_dtype, shape)

    def __iter__(self) -> Any:
        raise TypeError("a Buffer is device memory and cannot be iterated; read it with "
                        "`await buf.to_numpy()`")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self!r} is device memory; NumPy cannot read it in place. Copy it to the host "
                        f"with `await buf.to_numpy()` (or aiogpu.copy into an array)")

    # -- lifetime ------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        """Raise ValueError for a freed buffer (or a view of one), RuntimeClosedError for a
        closed runtime."""
        root = self if self._base is None else self._base
        if root.freed:
            what = f"{self!r} views a buffer that" if root is not self else f"{self!r}"
            raise ValueError(f"{what} was freed")
        if self.device.runtime.closed:
            raise RuntimeClosedError(f"{self!r}: its runtime is closed")

    def free(self) -> None:
        """Give the memory back once no pending GPU work uses it; the buffer, and every view
        of it, is unusable after. TypeError on a view (it owns no memory: free its ``base``)."""
        _free(self)

    def _unuse(self) -> None:
        """One operation using this allocation retired (under the runtime lock)."""
        self.users -= 1
        if self.users == 0 and self.freed:
            self._last_user_retired()

    def _last_user_retired(self) -> None:
        """The last operation using this freed allocation retired (under the runtime lock):
        the memory goes back now."""
        self._give()
        if self.device.memory.returned:
            self.device.memory.drain()

    # -- data ----------------------------------------------------------------------------------
    def to_numpy(self, dtype: Any = None) -> "GPUFuture[np.ndarray]":
        """A GPUFuture whose result is a new NumPy array holding a copy of the buffer.

        With no ``dtype``: the view's dtype and shape (uint8 bytes for a raw buffer); with one,
        a one-dimensional array of the bytes as ``dtype``. The array lives in the runtime's
        pinned host memory (so the copy needs no pinning); it stays valid after the runtime is
        closed. TypeError for a non-numeric dtype or inside a graph capture, ValueError when the
        buffer is not a whole number of elements or was freed."""
        return _to_numpy(self, dtype)

    def fill(self, value: int, *, after: Any = ()) -> "GPUFuture[None]":
        """Fill with a repeated 32-bit ``value`` (device-side; nbytes and, for a view, its offset
        must be multiples of 4)."""
        return self.device.runtime.fill(self, value, after=after)

    # -- interop: the buffer's dtype and shape (raw buffers: uint8 bytes) ------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        """CUDA Array Interface v3 with this buffer's dtype and shape (CUDA buffers only: an
        AttributeError elsewhere); its ``stream`` is the pending writer's lane."""
        device = self._interop("__cuda_array_interface__")
        typestr = array_typestr(self.dtype)
        rt = self.device.runtime
        with rt.lock:
            lane = writers_lane(self)
        return device.cuda_array_interface(self, typestr, lane)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        """A DLPack capsule with this buffer's dtype and shape; ``stream`` waits on the device
        for pending work. CUDA buffers only: NotOnCudaError (a TypeError) on HSA and the
        emulator, whose memory no DLPack consumer in this process can address."""
        return self._interop("__dlpack__").dlpack(self, stream=stream, max_version=max_version,
                                                 dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """(kDLCUDA, device index) on CUDA; NotOnCudaError elsewhere."""
        return self._interop("__dlpack_device__").dlpack_device(self)

    def _interop(self, what: str) -> Any:
        if getattr(self.device, "dlpack", None) is None:
            raise NotOnCudaError(f"{what}: {self!r} is on the {self.device.runtime.backend} backend; "
                                 f"only CUDA buffers export device memory")
        self._check_usable()
        return self.device

    def __repr__(self) -> str:
        if self.root is self:
            return f"<Buffer {self.nbytes} B on {self.device.name} at 0x{self.address:x}>"
        kind = f"{self.typed_dtype}{list(self._shape)}" if self.typed_dtype is not None else f"{self.nbytes} B"
        return f"<Buffer view {kind} at +{self.offset} of {self.root.nbytes} B on {self.device.name}>"


_UINT8 = np.dtype(np.uint8)


def array_typestr(dtype: np.dtype) -> str:
    """The array interface type string of a numeric dtype (BufferError for bfloat16 and
    other dtypes it cannot name: use DLPack)."""
    if dtype.kind not in "biufc":
        raise BufferError(f"the CUDA Array Interface has no type string for {dtype}; use DLPack")
    return dtype.str


def _bound(value: Any, default: int, n: int) -> int:
    """A slice bound or index in [0, n] (negative ones count from the end); IndexError outside."""
    if value is None:
        return default
    i = _index(value, "buffer indices")
    j = i + n if i < 0 else i
    if not 0 <= j <= n:
        raise IndexError(f"index {i} is out of bounds for length {n}")
    return j
