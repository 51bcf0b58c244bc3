"""Controls over bench/fakecuda's driver for the CUDA host-path tests (imported by their child
processes before aiogpu, since aiogpu.cuda.driver binds some driver calls at import).

The fake runs every operation at once; these controls make the cases a real GPU produces:
- ``hold(stream)``: the stream's completion-word writes wait until ``release(stream)``, and
  queries of it say NOT_READY meanwhile (work that is still running on the device);
- ``log``: the driver calls named in ``LOGGED``, with their arguments, in call order;
- ``fail_queries(code)``: stream and event queries return ``code`` (a sticky error);
- ``ForeignArray``: device memory of the fake with a ``__cuda_array_interface__`` (v3, with a
  stream), as a torch tensor or a CuPy array presents itself.
"""
from __future__ import annotations

import ctypes
import enum
import threading

from cuda.bindings import driver as cu

LOGGED = ("cuEventRecord", "cuStreamWaitEvent", "cuStreamWaitValue64", "cuLaunchKernel", "cuMemcpyAsync")
log: list[tuple] = []
_lock = threading.Lock()
_held: dict[int, list] = {}
_query_code = [0]


def _logging(name):
    real = getattr(cu, name)

    def call(*args):
        log.append((name, *[_handle(a) for a in args]))
        return real(*args)

    return call


def _handle(arg):
    try:
        return int(arg)
    except (TypeError, ValueError):
        return arg


for _name in LOGGED:
    setattr(cu, _name, _logging(_name))

_real_write = cu.cuStreamWriteValue64


def _write(stream, dptr, value, flags):
    with _lock:
        held = _held.get(int(stream))
        if held is not None:
            held.append((dptr, value))
            return (cu.CUresult.CUDA_SUCCESS,)
    return _real_write(stream, dptr, value, flags)


cu.cuStreamWriteValue64 = _write


def hold(stream) -> None:
    """Completion words written on ``stream`` (a CUstream or a Lane's handle) wait from now on."""
    with _lock:
        _held.setdefault(int(stream), [])


def release(stream) -> None:
    """Write what ``stream`` held back, in order, and stop holding it."""
    with _lock:
        writes = _held.pop(int(stream), [])
    for dptr, value in writes:
        _real_write(stream, dptr, value, 0)


def _query(real, stream: bool):
    def call(handle):
        code = _query_code[0]
        if code:
            return (cu.CUresult(code),)
        if stream and int(handle) in _held:       # (its work is still running)
            return (cu.CUresult.CUDA_ERROR_NOT_READY,)
        return real(handle)
    return call


cu.cuStreamQuery = _query(cu.cuStreamQuery, True)
cu.cuEventQuery = _query(cu.cuEventQuery, False)


def fail_queries(code: int) -> None:
    """Stream and event queries return ``code`` from now on (0: success again)."""
    _query_code[0] = code


# The fake knows no device ordinal attribute: memory from its cuMemAlloc is device 0's.
class CUpointer_attribute(enum.IntEnum):
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


cu.CUpointer_attribute = CUpointer_attribute
_device_memory: dict[int, int] = {}
_real_attr = cu.cuPointerGetAttribute


def _pointer_attribute(attr, addr):
    if int(attr) == CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        for start, n in _device_memory.items():
            if start <= int(addr) < start + n:
                return (cu.CUresult.CUDA_SUCCESS, 0)
    return _real_attr(attr, addr)


cu.cuPointerGetAttribute = _pointer_attribute


class ForeignArray:
    """``n`` float32 of fake device memory, exported as another library's CUDA array whose work
    runs on ``stream`` (an int handle)."""

    def __init__(self, n: int, stream: int):
        err, ptr = cu.cuMemAlloc(4 * n)
        self.ptr, self.n, self.stream = int(ptr), n, stream
        _device_memory[self.ptr] = 4 * n

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.n,), "typestr": "<f4", "data": (self.ptr, False), "version": 3,
                "stream": self.stream}

    def values(self) -> list:
        return list((ctypes.c_float * self.n).from_address(self.ptr))
