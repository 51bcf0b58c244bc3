"""Atomic loads and stores on raw addresses, with explicit memory order.

The AQL protocol needs a packet header published by one aligned 32-bit store with *release*
order after the packet body, and write/read indices read with *acquire* order. A ctypes field
assignment is a plain store with no ordering promise, so these go through libatomic's
``__atomic_*`` entry points, which emit the right instruction and fence for the CPU.
"""
from __future__ import annotations

import ctypes
import ctypes.util

RELAXED, ACQUIRE, RELEASE, ACQ_REL, SEQ_CST = 0, 2, 3, 4, 5


def _load_libatomic() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libatomic.so.1")
    except OSError:
        pass
    # Only now ask ctypes to search (find_library runs ``ldconfig -p``: a process per call).
    name = ctypes.util.find_library("atomic")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_lib = _load_libatomic()


def _bind(name: str, restype, argtypes):
    fn = getattr(_lib, name)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


if _lib is not None:
    _store4 = _bind("__atomic_store_4", None, [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int])
    _load4 = _bind("__atomic_load_4", ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_int])
    _store8 = _bind("__atomic_store_8", None, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int])
    _load8 = _bind("__atomic_load_8", ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_int])

    def store_u32_release(address: int, value: int) -> None:
        _store4(address, value, RELEASE)

    def load_u32_acquire(address: int) -> int:
        return _load4(address, ACQUIRE)

    def store_u64_release(address: int, value: int) -> None:
        _store8(address, value, RELEASE)

    def load_u64_acquire(address: int) -> int:
        return _load8(address, ACQUIRE)

    IMPLEMENTATION = "libatomic"
else:  # pragma: no cover - every Linux with gcc's runtime has libatomic
    # x86-64 is TSO: aligned stores are not reordered with earlier stores and aligned loads are
    # not reordered with later loads, so a plain aligned access has release/acquire semantics there.
    def store_u32_release(address: int, value: int) -> None:
        ctypes.c_uint32.from_address(address).value = value

    def load_u32_acquire(address: int) -> int:
        return ctypes.c_uint32.from_address(address).value

    def store_u64_release(address: int, value: int) -> None:
        ctypes.c_uint64.from_address(address).value = value

    def load_u64_acquire(address: int) -> int:
        return ctypes.c_uint64.from_address(address).value

    IMPLEMENTATION = "plain aligned access (x86-64 TSO)"
