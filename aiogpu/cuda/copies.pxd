# Types for copies.py (the source): the copy record's fields read as C slots.
cimport cython
from aiogpu._core.copies cimport CopyOp, CopySide
from aiogpu._core.futures cimport GPUFuture
from aiogpu._core.state cimport RuntimeState
from aiogpu.cuda.encode cimport Lane, direct_memcpy, enter_lane, lane_completes

@cython.locals(dst=CopySide, src=CopySide, fusable=bint, foreign=bint, mapped=bint)
cpdef object encode_copy(object self, object fut, CopyOp op, object lane, object waits, list cleanup)

@cython.locals(code=cython.longlong, ticket=cython.longlong, word=cython.ulonglong)
cpdef memcpy_on_lane(object runtime, GPUFuture fut, Lane lane, object dptr, object sptr, object nbytes, object waits,
                     list cleanup, object on_complete, object staging)

@cython.locals(f=GPUFuture, lane=Lane, other=Lane)
cpdef object copy_lane(object self, CopyOp op, object deps)

cdef object _hot()

# (the hooks ``bind`` sets: the signatures of state.pxd's copy_lane_fn and encode_copy_fn)
@cython.locals(state=RuntimeState)
cpdef bind(object runtime)
cdef object _copy_lane_c(object runtime, object op, object deps)
cdef object _encode_copy_c(object runtime, object fut, object op, object lane, object waits, list cleanup)
