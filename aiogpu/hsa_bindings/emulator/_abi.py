"""Helpers shared by the emulator modules: status errors, typed out-parameter stores, handles.

HSA functions report failure as an ``hsa_status_t``; inside the emulator a failure is raised as
``StatusError`` and the entry-point decorator turns it into the return value, so the modules
read as straight-line Python. Out parameters are raw addresses (``void*``) or ctypes pointers.
"""
from __future__ import annotations

import ctypes
import itertools
import threading
import time
from typing import Any, Iterable

from .. import types as T

UINT64_MAX = (1 << 64) - 1
UINT32_MAX = (1 << 32) - 1
INT64_MIN = -(1 << 63)

_handle_lock = threading.Lock()
_handle_counter = itertools.count(1)
HANDLE_BASE = 0x7E_0000_0000


class StatusError(Exception):
    """An HSA call fails with ``status`` (returned to the caller, not recorded as a bug)."""

    def __init__(self, status: int, message: str = ""):
        self.status = status
        super().__init__(f"{T.status_name(status)}: {message}" if message else T.status_name(status))


def require(condition: Any, status: int, message: str = "") -> None:
    if not condition:
        raise StatusError(status, message)


def new_handle() -> int:
    """A process-wide unique, 64-byte aligned, non-zero handle value.

    Unique across emulator instances so that a handle from one emulator is unknown to another,
    as handles of one ROCr process mean nothing in another.
    """
    with _handle_lock:
        return HANDLE_BASE + next(_handle_counter) * 64


def now_ns() -> int:
    """The emulator's clock: HSA_SYSTEM_INFO_TIMESTAMP ticks are nanoseconds (frequency 1e9)."""
    return time.monotonic_ns()


def to_int64(value: int) -> int:
    """Wrap to the signed 64-bit range, as an ``hsa_signal_value_t`` does in C."""
    return ((value - INT64_MIN) & UINT64_MAX) + INT64_MIN


def address_of(pointer: Any) -> int:
    """The address held by a ctypes pointer (0 for NULL) or a ``void*`` argument (int/None)."""
    if pointer is None:
        return 0
    if isinstance(pointer, int):
        return pointer
    if isinstance(pointer, (ctypes._Pointer, ctypes.c_void_p, ctypes.c_char_p)):
        # The value read in place: ctypes.cast would store ``pointer`` in its own _objects
        # dict, a reference cycle per call (each call's argument is a new pointer object),
        # left to the cyclic garbage collector.
        return ctypes.c_void_p.from_address(ctypes.addressof(pointer)).value or 0
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0


def store(address: int | None, ctype: Any, value: Any) -> None:
    """Write one value of ``ctype`` at a caller's ``void*`` out parameter."""
    require(address, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL value pointer")
    ctype.from_address(address).value = value


def store_array(address: int | None, ctype: Any, values: Iterable[int]) -> None:
    values = list(values)
    require(address, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL value pointer")
    (ctype * len(values)).from_address(address)[:] = values


def store_chars(address: int | None, text: str, size: int = 64) -> None:
    """A NUL-padded ``char[size]`` attribute (agent NAME, PRODUCT_NAME, ...)."""
    require(address, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL value pointer")
    data = text.encode()[: size - 1].ljust(size, b"\0")
    ctypes.memmove(address, data, size)


def store_out(pointer: Any, value: Any) -> None:
    """``*pointer = value`` for a typed ctypes pointer out parameter; NULL is INVALID_ARGUMENT."""
    require(pointer, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL output pointer")
    pointer[0] = value


def store_handle(pointer: Any, handle: int) -> None:
    """``pointer->handle = handle`` for an ``hsa_*_t*`` out parameter."""
    require(pointer, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL output pointer")
    pointer[0].handle = handle


def join_thread(thread: threading.Thread | None, timeout: float = 10.0) -> bool:
    """Join ``thread`` unless it is the caller (a callback may tear down its own caller)."""
    if thread is None or thread is threading.current_thread() or not thread.is_alive():
        return True
    thread.join(timeout)
    return not thread.is_alive()
