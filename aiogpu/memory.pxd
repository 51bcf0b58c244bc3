# Types for the compiled build of memory.py (Cython 3, pure-Python mode): the allocators as
# extension types with typed fields, their per-allocation methods as C calls to one another.
# Buffer is an extension type deriving from the core's typed BufferState (no instance dict: the
# flag that gives its memory back exactly once is a C field, see ``Buffer._give``).
# Each size class's cache list stays untyped (any list-like works; a test races a subclass).
# Byte counts and addresses stay Python ints (no C integer arguments: a C integer converts
# True and 1.5 silently, and sizes beyond 2**63 must raise what they raise interpreted).
cimport cython
from aiogpu._core.futures cimport GPUFuture
from aiogpu._core.hazards cimport BufferState
from aiogpu._core.interrupts cimport InterruptSafeLock
from aiogpu._core.state cimport DeviceState, RuntimeState
from aiogpu._core.submit cimport reap
from aiogpu._core.copies cimport download
from cpython.contextvars cimport get_value


cdef class BuddyAllocator:
    cdef public object _get_block, _put_block
    cdef public dict _free
    cdef public dict _used
    cdef public list _cache
    cdef public list _cap
    cdef public object blocks

    @cython.locals(order=Py_ssize_t, found=Py_ssize_t, free=dict)
    cpdef alloc(self, nbytes)
    @cython.locals(order=Py_ssize_t)
    cpdef take_cached(self, nbytes)
    @cython.locals(order=object)
    cpdef bint recycle(self, addr)
    @cython.locals(order=Py_ssize_t)
    cpdef free(self, addr)
    cpdef _merge(self, addr, order)
    @cython.locals(order=Py_ssize_t)
    cpdef flush(self)


cdef class DeviceMemory:
    cdef public object _raw_alloc, _raw_free
    cdef public dict _bases, _sizes, _cache
    cdef public object cached_bytes
    cdef public BuddyAllocator small
    cdef public dict large
    cdef public object returned
    cdef public bint destroyed

    cpdef give_back(self, address)
    cpdef take(self, nbytes)
    cpdef drain(self)
    cpdef alloc(self, nbytes)
    cpdef free(self, addr)
    cpdef _aligned(self, size)
    cpdef _from_driver(self, size)
    cpdef _release(self, addr)


cdef class Buffer(BufferState):
    cdef public object allocated_at
    cdef public object _release
    cdef bint _owned
    cdef object __weakref__
    cpdef bint _owns(self)
    cpdef _give(self)
    cpdef _last_user_retired(self)


# Buffer's per-allocation steps as C functions over its BufferState fields.

cdef _init_state(BufferState s, object device, object address, object nbytes)

@cython.locals(s=BufferState, memory=DeviceMemory, b=Buffer)
cpdef _free(object buf)

@cython.locals(buf=Buffer)
cdef Buffer _new_buffer(object device, object address, object nbytes, object release)

cdef _init_buffer(Buffer buf, object device, object address, object nbytes, object release)

@cython.locals(rt=RuntimeState, memory=DeviceMemory)
cpdef object alloc_plain(DeviceState device, object nbytes)

cdef dict _NUMPY_TYPES
cdef object _capture_active
@cython.locals(s=BufferState, rt=RuntimeState, fut=GPUFuture, lock=InterruptSafeLock)
cpdef object _to_numpy(object buf, object dtype)
