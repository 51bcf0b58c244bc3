# lanehub.py compiled (it is the source): LaneHub, the Hub of CUDA's per-operation hooks, as an
# extension type (the Python class CudaHub derives from it); the helpers its methods call are C
# functions over the hub's (a Hub) and the future's C fields.
cimport cython
from aiogpu._core.futures cimport GPUFuture
from aiogpu._core.hub cimport Hub
from aiogpu._core.interrupts cimport RawLock
from cpython.contextvars cimport get_value
from aiogpu.cuda.encode cimport Lane, awaited, flush_word

cdef extern from "<semaphore.h>" nogil:
    ctypedef struct sem_t:
        pass
    int sem_post(sem_t *sem)

cdef class LaneHub(Hub):
    # (counters written per operation: C fields, so that the instance's dict stays unchanged and
    # the core's calls of the hooks below find no Python override at the cost of a lookup)
    cdef public long long spin_hits, spin_misses, arms
    cdef public object sem, sem_post
    cpdef watch(self, GPUFuture fut)
    cpdef reap(self)
    cpdef _wake_for(self, GPUFuture fut)
    cpdef rearm(self)
    cpdef bint spin_poll(self, GPUFuture fut) except -1
    cpdef parked_done(self, GPUFuture fut)

@cython.locals(h=LaneHub, lane=Lane)
cdef object _watch(object hub, GPUFuture fut)
@cython.locals(h=LaneHub)
cdef int _post(object hub) except -1
cdef bint _first_poll(object hub, GPUFuture fut) except -1
@cython.locals(h=LaneHub, raw=RawLock, code=cython.longlong)
cdef int _cover(object hub, Lane lane, long long ticket, bint wait) except -1
@cython.locals(h=Hub, steps=bint, reaped=bint)
cdef bint _completed_now(object hub, GPUFuture fut) except -1
@cython.locals(h=Hub, lane=Lane, first=GPUFuture, upto=cython.longlong, found=list, item=tuple)
cdef bint _reap(object hub) except -1
@cython.locals(h=Hub)
cdef int _hit(object hub, object lane, GPUFuture fut, double waited) except -1
@cython.locals(h=Hub)
cdef int _observed(object hub, Lane lane, long long ticket, long long code) except -1
@cython.locals(f=GPUFuture, done=list)
cdef int _take(object hub, Lane lane, long long ticket, dict posts) except -1
@cython.locals(h=Hub, fut=GPUFuture, dep=GPUFuture, item=tuple)
cdef int _complete_each(object hub, list completed, dict posts) except -1
@cython.locals(h=Hub)
cdef int _settle_batch(object hub, list completed) except -1
@cython.locals(lane=Lane, h=LaneHub, raw=RawLock)
cdef int _wake_for(object hub, GPUFuture fut) except -1
@cython.locals(lane=Lane, h=LaneHub, raw=RawLock)
cdef int _rearm(object hub) except -1
@cython.locals(h=LaneHub)
cdef int _arm(object hub, Lane lane) except -1
