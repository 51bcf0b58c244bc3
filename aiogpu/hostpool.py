"""Pinned host memory owned by the runtime: results of ``to_numpy`` and staging for small copies.

Pinning (``cuMemHostRegister``, ``hsa_amd_memory_lock``) and unpinning a fresh array per copy is
what made a service slow: each costs a driver call, unpinning can synchronise the device, and it
runs on the event loop. The pool pins memory once and reuses it:

- **Slabs** are the runtime's own anonymous mappings (``mmap``), pinned once through the
  backend's ``pin(address, size) -> device pointer`` and unpinned only at ``close``. Because the
  memory is the pool's and not the driver's, an array handed to the user stays valid host memory
  after the runtime closed (it is merely no longer pinned).
- **Blocks** up to ``SMALL_LIMIT`` come from a buddy allocator over 2 MiB slabs; larger ones get
  slabs of their own, rounded to 2 MiB and cached by size for reuse. Small blocks given back
  wait by size (``READY_PER_SIZE`` of each) and are handed out again as they were: a service's
  staging blocks and results take no allocator or slab lookup per request.
- ``empty(nbytes, dtype)`` gives a NumPy array in a block; the block returns to the pool when the
  array (and every view of it) is gone. ``block(nbytes)`` gives a staging block and its release.
- ``device_pointer(address, nbytes)`` says whether memory lies in the pool (copies then use it in
  place: no pinning per copy).

Releases may come from any thread (garbage collection): they are queued lock-free and taken back
under the runtime lock at the next allocation. Not otherwise thread-safe: the runtime lock guards
it.
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import mmap
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .memory import BLOCK, MIN_ORDER, MIN_PIECE, SMALL_LIMIT, BuddyAllocator, round_up

# Idle large slabs kept for reuse beyond which the oldest are unpinned and unmapped.
LARGE_CACHE_BYTES = 1 << 30
# Block sizes whose owner class (see ``_owner_class``) is kept; others get a class per call.
OWNER_CLASSES = 64
# Small blocks given back and kept, per size, ready to hand out again as they were (no buddy
# allocator or slab lookup): a service takes and gives back the same sizes per request.
READY_PER_SIZE = 64


_OWNERS: dict = {}       # size -> owner class (``_owner_class``)
_frombuffer = np.frombuffer      # (one module lookup, not two, per download)


def _owner_class(size: int) -> Any:
    """A ctypes array type of ``size`` bytes whose instances give their block back when they
    die (``__del__``): the owner an ``empty`` array's ``base`` holds.

    Not weakref.finalize: a finalizer per array cost a registry entry, and at interpreter exit
    its atexit hook iterated that registry while the waiter thread changed it. An owner made by
    ``from_buffer`` holds an export of the slab's mapping, so the mapping outlives ``close``
    while an array uses it (as the memoryview the arrays held before)."""
    cls = _OWNERS.get(size)
    if cls is None:
        cls = type("PinnedBlock", (ctypes.c_char * size,), {"__slots__": ("returns", "token"),
                                                             "__del__": _give_back})
        if len(_OWNERS) < OWNER_CLASSES:
            _OWNERS[size] = cls
    return cls


def _give_back(owner) -> None:
    # (Any thread, at any time, interpreter shutdown included: a list append, no global.)
    owner.returns.append(owner.token)


class _GiveBack:
    """A pinned block's release, as ``block`` hands it out: calling it gives the block back
    (its token to the pool's returns: any thread, a list append)."""

    __slots__ = ("returns", "token")
    if TYPE_CHECKING:
        returns: list
        token: tuple

    def __call__(self) -> None:
        self.returns.append(self.token)


def _new_give_back(returns: Any, token: tuple) -> _GiveBack:
    """A ``_GiveBack`` (made without a call to ``__init__``: one per staged copy)."""
    g = _GiveBack.__new__(_GiveBack)
    g.returns, g.token = returns, token
    return g


class _Slab:
    __slots__ = ("map", "start", "base", "size", "device")

    def __init__(self, size: int, pin: Callable[[int, int], int]):
        # Map one block more than asked, so that a 2 MiB-aligned region of ``size`` fits (the
        # buddy allocator's arithmetic needs aligned blocks; untouched pages cost no memory).
        self.map = mmap.mmap(-1, size + BLOCK)
        self.start = np.frombuffer(self.map, np.uint8).__array_interface__["data"][0]
        self.base = round_up(self.start, BLOCK)
        self.size = size
        self.device = pin(self.base, size)

    def view(self, address: int, nbytes: int) -> memoryview:
        off = address - self.start
        return memoryview(self.map)[off:off + nbytes]


class PinnedPool:
    """Page-locked host blocks of one runtime (see the module doc)."""

    def __init__(self, pin: Callable[[int, int], int], unpin: Callable[[int], None]):
        self._pin, self._unpin = pin, unpin
        self._slabs: dict[int, _Slab] = {}      # base -> slab
        self._starts: list[int] = []            # sorted slab bases (lookup by address)
        self._idle_small: list[int] = []        # fully free 2 MiB slabs, kept pinned for reuse
        self._small = BuddyAllocator(self._small_slab, self._idle_small.append)
        self._large_free: dict[int, list[int]] = collections.defaultdict(list)
        self._large_idle: collections.OrderedDict[int, int] = collections.OrderedDict()
        # Tokens of blocks handed out and given back, from any thread: (address, order, device
        # pointer, slab), order -1 for a large block. A list: ``append`` from any thread and
        # the holder's ``pop`` are each atomic (the GIL), and their order does not matter.
        self._returns: list = []
        # Small blocks given back, by order: their tokens, ready to hand out again.
        self._ready: list[list[tuple]] = [[] for _ in range(SMALL_LIMIT.bit_length())]
        self._handed_out = 0
        self.closed = False

    @property
    def blocks_in_use(self) -> int:
        """Blocks handed out and not yet given back."""
        return self._handed_out - len(self._returns)

    # -- allocation ------------------------------------------------------------------------------
    def block(self, nbytes: int) -> tuple[int, int, Callable[[], None]]:
        """(host address, device pointer, release) of a pinned block of at least ``nbytes``."""
        token = self._carve(nbytes)
        return token[0], token[2], _new_give_back(self._returns, token)

    def empty(self, nbytes: int, dtype: Any) -> np.ndarray:
        """A one-dimensional array of ``nbytes // itemsize`` elements in pinned memory; its
        block returns to the pool when the array and its views are gone."""
        return self.empty_at(nbytes, np.dtype(dtype))[0]

    def empty_at(self, nbytes: int, dtype: np.dtype) -> tuple[np.ndarray, int, int]:
        """``empty(nbytes, dtype)`` of a ``numpy.dtype`` (the caller converts: an isinstance
        test against NumPy's dtype metaclass costs more than the rest of the checks of a
        download), the host address and the device pointer of its first byte (the address:
        reading it back through ``__array_interface__`` costs microseconds)."""
        token = self._carve(nbytes)
        address, order, device, slab = token
        size = (1 << order) if order >= 0 else slab.size
        owner = _owner_class(size).from_buffer(slab.map, address - slab.start)
        owner.returns, owner.token = self._returns, token
        return _frombuffer(owner, dtype, nbytes // dtype.itemsize), address, device

    def _carve(self, nbytes: int) -> tuple:
        """The token (address, order (-1: large), device pointer, slab) of a block of at least
        ``nbytes``, counted handed out."""
        if self._returns:
            self._take_returns()
        self._handed_out += 1
        if nbytes <= SMALL_LIMIT:
            order = MIN_ORDER if nbytes <= MIN_PIECE else (nbytes - 1).bit_length()
            ready = self._ready[order]
            if ready:
                return ready.pop()
            address = self._small.alloc(nbytes)
        else:
            order, address = -1, self._large(round_up(nbytes, BLOCK))
        slab = self._slab_of(address)
        assert slab is not None                  # the block was just carved from a slab
        return address, order, slab.device + (address - slab.base), slab

    def device_pointer(self, address: int, nbytes: int = 1) -> int | None:
        """The device pointer of ``address`` if ``[address, address + nbytes)`` lies in one of
        the pool's slabs, else None."""
        slab = self._slab_of(address)
        if slab is None or address + nbytes > slab.base + slab.size:
            return None
        return slab.device + (address - slab.base)

    # -- slabs -----------------------------------------------------------------------------------
    def _small_slab(self) -> int:
        return self._idle_small.pop() if self._idle_small else self._add_slab(BLOCK)

    def _large(self, size: int) -> int:
        free = self._large_free[size]
        if free:
            address = free.pop()
            self._large_idle.pop(address, None)
            return address
        return self._add_slab(size)

    def _add_slab(self, size: int) -> int:
        slab = _Slab(size, self._pin)
        self._slabs[slab.base] = slab
        bisect.insort(self._starts, slab.base)
        return slab.base

    def _slab_of(self, address: int) -> _Slab | None:
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        slab = self._slabs[self._starts[i]]
        return slab if address < slab.base + slab.size else None

    def _take_returns(self) -> None:
        returns = self._returns
        while returns:
            token = returns.pop()
            self._handed_out -= 1
            if self.closed:
                continue
            order = token[1]
            if order >= 0:
                ready = self._ready[order]
                if len(ready) < READY_PER_SIZE:
                    ready.append(token)
                else:
                    self._small.free(token[0])
                continue
            address = token[0]
            size = self._slabs[address].size
            self._large_free[size].append(address)
            self._large_idle[address] = size
            self._trim_large()

    def _trim_large(self) -> None:
        idle = sum(self._large_idle.values())
        while idle > LARGE_CACHE_BYTES and self._large_idle:
            address, size = self._large_idle.popitem(last=False)
            self._large_free[size].remove(address)
            self._drop(address)
            idle -= size

    def _drop(self, base: int) -> None:
        slab = self._slabs.pop(base)
        self._starts.remove(base)
        self._unpin(base)
        try:
            slab.map.close()
        except BufferError:       # an array still uses it: the mapping lives on with it
            pass

    def close(self) -> None:
        """Unpin every slab (the runtime is closing). Arrays handed out stay valid memory."""
        self._take_returns()
        self.closed = True
        for ready in self._ready:
            ready.clear()
        for base in list(self._slabs):
            self._drop(base)
