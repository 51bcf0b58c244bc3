# Types for hostpool.py (the source, compiled by Cython 3 in pure-Python mode): the pool and its
# slabs as extension types with typed fields, the per-block methods as C calls.
cimport cython


cdef dict _OWNERS
cpdef object _owner_class(object size)


cdef class _GiveBack:
    cdef list returns
    cdef tuple token


@cython.locals(g=_GiveBack)
cdef _GiveBack _new_give_back(list returns, tuple token)


cdef class _Slab:
    cdef public object map, start, base, size, device


cdef class PinnedPool:
    cdef public object _pin, _unpin
    cdef public dict _slabs
    cdef public list _starts, _idle_small
    cdef public object _small, _large_free, _large_idle
    cdef public list _returns
    cdef public list _ready
    cdef public Py_ssize_t _handed_out
    cdef public bint closed

    @cython.locals(address=object, order=object, device=object, slab=_Slab, token=tuple)
    cpdef tuple empty_at(self, nbytes, dtype)
    @cython.locals(order=object, ready=list, slab=_Slab)
    cpdef tuple _carve(self, nbytes)
    @cython.locals(slab=_Slab)
    cpdef object device_pointer(self, address, nbytes=*)
    @cython.locals(i=Py_ssize_t, slab=_Slab)
    cpdef object _slab_of(self, address)
    @cython.locals(token=tuple, ready=list, returns=list)
    cpdef _take_returns(self)
