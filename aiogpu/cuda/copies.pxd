# Types for copies.py (the source): the copy record's fields read as C slots.
cimport cython
from aiogpu._core.copies cimport CopyOp, CopySide

@cython.locals(dst=CopySide, src=CopySide, fusable=bint)
cpdef object encode_copy(object self, object fut, CopyOp op, object lane, object waits, list cleanup)

cpdef object copy_lane(object self, CopyOp op, object deps)

cdef object _hot()
