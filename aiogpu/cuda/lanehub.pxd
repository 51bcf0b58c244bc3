# lanehub.py compiled (it is the source): LaneHub is a part of the Python class CudaHub, so its
# methods are compiled functions over Python attributes; the helpers they call are C functions
# over the hub's (a Hub) and the future's C fields.
cimport cython
from aiogpu._core.futures cimport GPUFuture
from aiogpu._core.hub cimport Hub
from aiogpu.cuda.encode cimport Lane

@cython.locals(h=Hub, lane=Lane)
cdef object _watch(object hub, GPUFuture fut)
cdef bint _first_poll(object hub, GPUFuture fut) except -1
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
@cython.locals(lane=Lane)
cdef int _wake_for(object hub, GPUFuture fut) except -1
