"""Interop with other CUDA libraries: ``__cuda_array_interface__`` and DLPack for Buffers, and
foreign CUDA arrays (torch, CuPy, ...) as sides of ``aiogpu.copy``.

A Buffer is exported as a one-dimensional ``uint8`` array of ``nbytes`` (view it with the
consumer's own dtype, e.g. ``torch.from_dlpack(buf).view(torch.float32)``). Synchronisation:
- ``__cuda_array_interface__`` (v3) names in ``stream`` the lane of the buffer's pending writer,
  if any, so that a consumer that honours it waits for that write on the device;
- ``__dlpack__(stream=s)`` makes the consumer's stream ``s`` wait, on the device, for the pending
  work that writes or reads the buffer.
The export keeps the Buffer allocated until the consumer lets go of it (DLPack deleter) or, for
``__cuda_array_interface__``, for as long as the caller keeps the Buffer. Work the consumer then
queues is invisible to aiogpu's ordering: await what it needs before handing a Buffer back.

Foreign arrays in copies must be C-contiguous device memory of this runtime's GPUs. Their
``stream`` (CAI v3) is waited on, on the device, before the copy; without one, aiogpu waits on
the legacy default stream (where torch and CuPy queue work by default). The copy's future keeps
the foreign array alive; await it before using the array again in the other library.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..deferred import real
from ..memory import Buffer
from . import driver as D
from .driver import cu

KDL_CUDA = 2
KDL_UINT = 1
LEGACY_STREAM = 1


# -- foreign arrays -------------------------------------------------------------------------------
def is_foreign(obj: Any) -> bool:
    return not isinstance(obj, (Buffer, np.ndarray)) and hasattr(type(obj), "__cuda_array_interface__")


def foreign_info(rt: Any, obj: Any, name: str) -> tuple[int, int, Any, int | None]:
    """(pointer, nbytes, device, stream to wait on) of a CUDA array; ValueError if unusable."""
    cai = obj.__cuda_array_interface__
    shape = tuple(cai["shape"])
    itemsize = np.dtype(cai["typestr"]).itemsize
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize if shape else itemsize
    strides = cai.get("strides")
    if strides is not None and shape:
        expect, acc = [], itemsize
        for extent in reversed(shape):
            expect.append(acc)
            acc *= extent
        if tuple(reversed(expect)) != tuple(strides) and nbytes:
            raise ValueError(f"copy {name}: the CUDA array must be C-contiguous")
    if nbytes == 0:
        raise ValueError(f"copy {name}: the array is empty")
    ptr = int(cai["data"][0])
    if name == "dst" and cai["data"][1]:
        raise ValueError("copy dst: the CUDA array is read-only")
    err, ordinal = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    if err != 0 or not 0 <= int(ordinal) < len(rt.devices):
        raise ValueError(f"copy {name}: {type(obj).__name__} is not device memory of this runtime's GPUs")
    stream = cai.get("stream", LEGACY_STREAM) if cai.get("version", 0) >= 3 else LEGACY_STREAM
    return ptr, nbytes, rt.devices[int(ordinal)], stream


# -- __cuda_array_interface__ ---------------------------------------------------------------------
def _submitted(f: Any) -> Any:
    """The device work behind ``f`` (a deferred launch's submitted work); BufferError while it
    still waits for its kernel's compile (nothing on the device to wait for yet)."""
    got = real(f) if f is not None else None
    if f is not None and got is None:
        raise BufferError(f"{f!r} waits for its kernel's compile: await it (or dev.load(kernel)) "
                          f"before handing the buffer to another library")
    return got


def _pending_writer(buf: Buffer) -> Any:
    w = _submitted(buf.last_write)
    return w if w is not None and not w.retired and getattr(w, "lane", None) is not None else None


def cuda_array_interface(buf: Buffer) -> dict:
    buf.check_usable()
    with buf.device.runtime.lock:
        writer = _pending_writer(buf)
        stream = writer.lane.handle if writer is not None else None
    return {"shape": (buf.nbytes,), "typestr": "|u1", "data": (buf.address, False),
            "strides": None, "version": 3, "stream": stream}


# -- DLPack --------------------------------------------------------------------------------------
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


_NAME = b"dltensor"               # the capsule keeps this pointer: module-lifetime bytes
_exports: dict[int, tuple] = {}   # managed tensor address -> (struct, shape, buffer)


@_Deleter
def _delete(address: int) -> None:
    entry = _exports.pop(address, None)
    if entry is not None:
        buf = entry[2]
        with buf.device.runtime.lock:
            buf.unuse()


_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
# The destructor gets the capsule while it is being deallocated: take it as a raw pointer (a
# py_object argument would add and drop a reference to a dying object).
# Private prototypes (PYFUNCTYPE: called with the GIL held), not pythonapi's shared attributes.
_IsValidRaw = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_GetPointerRaw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule: int) -> None:
    # Not consumed (still named "dltensor"): the producer deletes it.
    if _IsValidRaw(capsule, _NAME):
        _delete(_GetPointerRaw(capsule, _NAME))


_DESTRUCTOR = ctypes.cast(_capsule_destructor, ctypes.c_void_p).value


def to_dlpack(buf: Buffer, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
              copy: Any = None) -> Any:
    """A DLPack capsule of ``buf`` (uint8, shape (nbytes,)) for the consumer's ``stream``."""
    buf.check_usable()
    if copy:
        raise BufferError("aiogpu Buffers are exported without copying (copy=True is not supported)")
    if dl_device is not None and tuple(dl_device) != (KDL_CUDA, buf.device.index):
        raise BufferError(f"{buf!r} lives on CUDA device {buf.device.index}, not {tuple(dl_device)}")
    rt = buf.device.runtime
    with rt.lock:
        if stream != -1:
            consumer = LEGACY_STREAM if stream is None else int(stream)
            pending = [f for f in map(_submitted, [buf.last_write, *buf.reads])
                       if f is not None and not f.done() and getattr(f, "lane", None) is not None]
            if pending:
                buf.device.make_current()
                target = cu.CUstream(consumer)
                for f in pending:
                    if f.event is not None:
                        D.check(cu.cuStreamWaitEvent(target, f.event, 0), "cuStreamWaitEvent (DLPack)")
                    else:
                        D.check(cu.cuStreamWaitValue64(target, f.lane.dptr, f.ticket, D.WAIT_GEQ),
                                "cuStreamWaitValue64 (DLPack)")
        shape = (ctypes.c_int64 * 1)(buf.nbytes)
        managed = DLManagedTensor()
        t = managed.dl_tensor
        t.data = buf.address
        t.device = DLDevice(KDL_CUDA, buf.device.index)
        t.ndim = 1
        t.dtype = DLDataType(KDL_UINT, 8, 1)
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = None
        t.byte_offset = 0
        managed.deleter = _delete
        address = ctypes.addressof(managed)
        _exports[address] = (managed, shape, buf)
        buf.users += 1
    return _PyCapsule_New(address, _NAME, _DESTRUCTOR)
