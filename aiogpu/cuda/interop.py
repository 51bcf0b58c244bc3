"""Interop with other CUDA libraries: ``__cuda_array_interface__`` and DLPack for Buffers, and
foreign CUDA arrays (torch, CuPy, ...) as sides of ``aiogpu.copy`` and pointer arguments of
``launch``.

A Buffer is exported with its dtype and shape: a raw buffer as one-dimensional ``uint8`` of
``nbytes``, a view (``buf.view(np.float32, (n, m))``, ``buf[a:b]``) as its dtype and shape, for
bool, every integer and float type (float16 included), complex64/128, and bfloat16 (DLPack only:
the CUDA Array Interface has no type string for it). Synchronisation:
- ``__cuda_array_interface__`` (v3) names in ``stream`` the lane of the pending writer of the
  exported bytes, if any (several writers on several lanes are first joined on one), so that a
  consumer that honours it waits for that write on the device;
- ``__dlpack__(stream=s)`` makes the consumer's stream ``s`` wait, on the device, for the pending
  work that writes or reads the exported bytes.
The export keeps the allocation alive until the consumer lets go of it (DLPack deleter) or, for
``__cuda_array_interface__``, for as long as the caller keeps the Buffer. Work the consumer then
queues is invisible to aiogpu's ordering: await what it needs before handing a Buffer back.

Foreign arrays (anything with ``__cuda_array_interface__``: torch tensors, CuPy arrays) must be
C-contiguous device memory of this runtime's GPUs, and on the launching device for ``launch``.
They are used in place (zero-copy) and ordered among aiogpu operations by their address range.
Against the other library: the copy or launch waits, on the device, for the work queued so far on
the array's CAI ``stream`` (v3); without one, on the legacy default stream (where torch and CuPy
queue work by default). Work the other library queues later, or on other streams, is not
ordered: the operation's future keeps the array alive; await it before using the array again in
the other library.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .._core import hazards
from .._core.submit import exported_work
from ..memory import Buffer
from . import driver as D
from .driver import cu

KDL_CUDA = 2
LEGACY_STREAM = 1
# DLPack type codes by NumPy kind (kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool; kDLBfloat = 4)
_DL_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}
KDL_BFLOAT = 4


def dl_dtype(dtype: np.dtype) -> tuple[int, int]:
    """(DLPack type code, bits) of a numeric dtype."""
    code = KDL_BFLOAT if dtype.name == "bfloat16" else _DL_CODES[dtype.kind]
    return code, dtype.itemsize * 8


# -- foreign arrays -------------------------------------------------------------------------------
def is_foreign(obj: Any) -> bool:
    return not isinstance(obj, (Buffer, np.ndarray)) and hasattr(type(obj), "__cuda_array_interface__")


def copy_streams(op: Any) -> list:
    """The foreign streams a copy's sides name (other libraries' arrays)."""
    return [s.stream for s in (op.dst, op.src) if s.stream is not None] if op is not None else []


def foreign_info(rt: Any, obj: Any, what: str, write: bool) -> tuple[int, int, Any, int | None]:
    """(pointer, nbytes, device, stream to wait on) of a CUDA array; ValueError if unusable."""
    try:
        cai = obj.__cuda_array_interface__
    except (AttributeError, TypeError, ValueError) as exc:     # e.g. a torch tensor on the CPU
        raise TypeError(f"{what}: the {type(obj).__name__} is not a CUDA array ({exc})") from None
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
            raise ValueError(f"{what}: the CUDA array must be C-contiguous")
    if nbytes == 0:
        raise ValueError(f"{what}: the array is empty")
    ptr = int(cai["data"][0])
    if write and cai["data"][1]:
        raise ValueError(f"{what}: the CUDA array is read-only")
    err, ordinal = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    if err != 0 or not 0 <= int(ordinal) < len(rt.devices):
        raise ValueError(f"{what}: {type(obj).__name__} is not device memory of this runtime's GPUs")
    stream = cai.get("stream", LEGACY_STREAM) if cai.get("version", 0) >= 3 else LEGACY_STREAM
    return ptr, nbytes, rt.devices[int(ordinal)], stream


# -- __cuda_array_interface__ ---------------------------------------------------------------------
def cuda_array_interface(buf: Buffer, typestr: str, lane: Any) -> dict:
    """CUDA Array Interface v3 of ``buf``; ``stream`` is ``lane``'s, the lane of its pending
    writers (``_core.submit.writers_lane``), None when none."""
    return {"shape": tuple(buf.shape), "typestr": typestr, "data": (buf.address, False),
            "strides": None, "version": 3, "stream": lane.handle if lane is not None else None}


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
            buf.root._unuse()


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
    """A DLPack capsule of ``buf`` (its dtype and shape, C order) for the consumer's ``stream``."""
    buf._check_usable()
    if copy:
        raise BufferError("aiogpu Buffers are exported without copying (copy=True is not supported)")
    if dl_device is not None and tuple(dl_device) != (KDL_CUDA, buf.device.index):
        raise BufferError(f"{buf!r} lives on CUDA device {buf.device.index}, not {tuple(dl_device)}")
    code, bits = dl_dtype(buf.dtype)
    rt = buf.device.runtime
    with rt.lock:
        if stream != -1:
            _consumer_waits(buf, LEGACY_STREAM if stream is None else int(stream))
        shape = (ctypes.c_int64 * buf.ndim)(*buf.shape)
        managed = DLManagedTensor()
        t = managed.dl_tensor
        t.data = buf.address
        t.device = DLDevice(KDL_CUDA, buf.device.index)
        t.ndim = buf.ndim
        t.dtype = DLDataType(code, bits, 1)
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = None             # compact, row-major
        t.byte_offset = 0
        managed.deleter = _delete
        address = ctypes.addressof(managed)
        _exports[address] = (managed, shape, buf)
        buf.root.users += 1
    return _PyCapsule_New(address, _NAME, _DESTRUCTOR)


def _consumer_waits(buf: Buffer, consumer: int) -> None:
    """Make the consumer's stream wait, on the device, for the pending work on ``buf``'s bytes."""
    writers, readers = hazards.touching(buf)
    pending: list[Any] = [f for f in map(exported_work, [*writers, *readers])
                          if not f.done() and getattr(f, "lane", None) is not None]
    if not pending:
        return
    buf.device.make_current()
    target = cu.CUstream(consumer)
    for f in pending:
        if f.event is not None:
            D.check(cu.cuStreamWaitEvent(target, f.event, 0), "cuStreamWaitEvent (DLPack)")
        else:
            D.check(cu.cuStreamWaitValue64(target, f.lane.dptr, f.ticket, D.WAIT_GEQ),
                    "cuStreamWaitValue64 (DLPack)")
