# lanehub.py compiled (it is the source): LaneHub is a part of the Python class CudaHub, so its
# methods are compiled functions over Python attributes; the helpers they call are C functions.
from aiogpu._core.futures cimport GPUFuture

cdef bint _completed_now(object hub, GPUFuture fut) except -1
cdef int _hit(object hub, object lane, GPUFuture fut, double waited) except -1
