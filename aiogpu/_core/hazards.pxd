# Types for the compiled build of hazards.py (Cython 3, pure-Python mode): the range state as
# extension types with typed fields, the per-operation functions as C calls to one another.
# Integer positions stay Python ints (no C integer fields): a C integer converts True and 1.5
# silently, and bytes are compared and bisected as Python ints anyway.
cimport cython
from aiogpu._core.futures cimport GPUFuture, preds_list
from aiogpu._core.state cimport DeviceState


cdef class HostRange:
    cdef public Hazards hazards
    cdef public object start, end, buffer

    cpdef list writers(self)
    cpdef list readers(self)
    cpdef bint written_by(self, fut)


cdef class _Segment:
    cdef public object start, end, last_write
    cdef public list reads
    cdef public object seq


cdef class Hazards:
    # (lists, left untyped: a typed list field takes no subclass, and the tests count a
    # lookup's reads through one)
    cdef public object _starts, _segs
    cdef public object _seq
    cdef public bint keep_failed

    cpdef HostRange host(self, address, nbytes)
    cpdef prune_host(self, HostRange state)
    @cython.locals(i=Py_ssize_t)
    cpdef tuple _span(self, start, end)
    @cython.locals(seg=_Segment, reads=list, i=Py_ssize_t, j=Py_ssize_t, k=Py_ssize_t)
    cpdef prune(self, start, end)
    cpdef _split(self, at)
    cpdef list _collect(self, start, end, bint writers)
    cpdef _newest_writer(self, start, end)
    cpdef bint _written_by(self, start, end, fut)
    @cython.locals(seg=_Segment)
    cpdef _record(self, start, end, fut, bint write)


@cython.locals(r=HostRange)
cdef HostRange _range(Hazards hazards, start, end, buffer)
@cython.locals(seg=_Segment)
cdef _Segment _segment(start, end, last_write, list reads, seq)


cdef class BufferState:
    cdef public object _base
    cdef public Hazards ranges
    cdef public GPUFuture last_write
    cdef public list reads
    cdef public Py_ssize_t users
    cdef public bint freed
    # (what submissions read of any Buffer: Python ints and objects, set by memory.Buffer)
    cdef public DeviceState device
    cdef public object address, nbytes, offset, typed_dtype, _shape
    cpdef _last_user_retired(self)


cpdef state_of(obj)
cpdef prune(state)
@cython.locals(reads=list)
cdef _prune_fields(state)
cpdef tuple touching(obj)
# (a Buffer's fields hold GPUFutures only: a capture orders by ranges, never by them)
@cython.locals(deps=dict, buf=BufferState, last=GPUFuture, reader=GPUFuture)
cpdef dict dependencies(reads, writes, after)
cdef _order_after(dict deps, fut)
@cython.locals(fut=GPUFuture)
cpdef object failed_dependency(dict deps)
@cython.locals(buf=BufferState, d=GPUFuture, preds=list, r=HostRange)
cpdef record(fut, reads, writes, deps=*)
cdef bint _among(obj, list objs)
