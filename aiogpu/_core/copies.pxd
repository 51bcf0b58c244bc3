# Types for copies.py (the source): the copy record and its sides as extension types with typed
# fields, the per-copy functions as C calls. Byte counts and addresses stay Python ints (a C
# integer would convert True and 1.5 silently).
cimport cython
from aiogpu._core.futures cimport GPUFuture
from aiogpu._core.hazards cimport BufferState, HostRange, Hazards, dependencies, failed_dependency
from aiogpu._core.state cimport DeviceState, RuntimeState, copy_lane, encode_copy
from aiogpu._core.hub cimport Hub
from aiogpu._core.interrupts cimport InterruptSafeLock
from aiogpu._core.submit cimport _refused, _submitted, any_deferred, guarded, launch, live, reap
from libc.string cimport memcpy
from libc.stdint cimport uintptr_t
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE


cdef class CopySide:
    cdef public object obj
    cdef public bint host
    cdef public object device, state, ptr, stream


cdef class CopyOp:
    cdef public RuntimeState rt
    cdef public CopySide dst, src
    cdef public object nbytes, direction, device, keep
    cdef public list cleanup
    cdef public object on_complete, staging
    cdef public bint staged, stage
    cdef object _label

    cpdef list writes(self)
    cpdef stage_source(self)


cdef inline object _buffer_address(object arr):
    cdef Py_buffer view
    PyObject_GetBuffer(arr, &view, PyBUF_SIMPLE)
    address = <uintptr_t>view.buf
    PyBuffer_Release(&view)
    return address


cdef inline _memcpy(object dst, object src, object nbytes):
    memcpy(<void*><uintptr_t>dst, <const void*><uintptr_t>src, <size_t>nbytes)


cdef dict _labels
cpdef str op_label(CopyOp op)
cdef str _where(CopySide side)
cpdef str label_of(CopySide src, CopySide dst, object nbytes)
@cython.locals(r=HostRange)
cpdef bint unwritten(object state)
cpdef object host_address(object arr)
cpdef host_memcpy(object dst, object src, object nbytes)
@cython.locals(buf=BufferState, hz=Hazards)
cpdef CopySide side(RuntimeState rt, object obj, object nbytes)
cdef tuple route(CopySide d, CopySide s)
@cython.locals(root=BufferState)
cpdef object plain_upload_bytes(RuntimeState rt, BufferState dst, object src, object host_dtypes)
@cython.locals(lock=InterruptSafeLock)
cpdef object upload_plain(RuntimeState rt, BufferState dst, object src, object host_dtypes)
@cython.locals(hz=Hazards)
cpdef object download(RuntimeState rt, BufferState buf, object out, object address, object ptr)
@cython.locals(op=CopyOp, reads=list, writes=list, device=DeviceState, deps=dict)
cpdef object submit(RuntimeState rt, CopySide d, CopySide s, object nbytes, list after, object keep, bint fresh_dst=*)

@cython.locals(src=CopySide, dst=CopySide, fut=GPUFuture)
cpdef object submit_copy(RuntimeState rt, CopyOp op, dict deps)
@cython.locals(fut=GPUFuture, waits=list, todo=list, hub=Hub)
cdef object _engine_copy(RuntimeState rt, CopyOp op, dict deps)
