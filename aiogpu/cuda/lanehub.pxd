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
cdef bint _completed_now(object hub, GPUFuture fut) except -1
@cython.locals(h=Hub)
cdef int _hit(object hub, object lane, GPUFuture fut, double waited) except -1
