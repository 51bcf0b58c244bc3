# The runtime's and the device's per-operation fields as C slots (state.py is the source; this
# only types it). Runtime and Device derive from these in Python.
from aiogpu._core.interrupts cimport InterruptSafeLock

# The backend's per-operation hooks as C functions, which a compiled backend binds into the
# runtime's and the device's fields below (NULL: the core calls the hook's Python method). Their
# arguments are objects: the core's own types would make this file cimport the modules that
# cimport it.
ctypedef object (*copy_lane_fn)(object rt, object op, object deps)
ctypedef object (*encode_copy_fn)(object rt, object fut, object op, object lane, object waits, list cleanup)
ctypedef object (*encode_kernel_fn)(object device, object fut, object lane, object loaded, object grid,
                                    object block, object values, object lengths, object waits, list cleanup,
                                    object copy, object foreign)

cdef class RuntimeState:
    cdef public InterruptSafeLock lock
    cdef public object hub
    cdef public object hazards
    cdef public object pinned
    cdef public bint closed
    cdef public Py_ssize_t _replaying
    cdef public bint copy_engines
    cdef public Py_ssize_t shader_copies
    cdef public object track_allocations
    cdef copy_lane_fn _copy_lane_c
    cdef encode_copy_fn _encode_copy_c


cdef class DeviceState:
    cdef public object runtime
    cdef public object memory
    cdef public object broken
    cdef public dict _kernels
    cdef public dict _shapes
    cdef public tuple _last_launch
    cdef public object _lane_order
    cdef encode_kernel_fn _encode_kernel_c

cpdef object copy_lane(RuntimeState rt, object op, object deps)
cpdef object encode_copy(RuntimeState rt, object fut, object op, object lane, object waits, list cleanup)
cpdef object encode_kernel(DeviceState device, object fut, object lane, object loaded, object grid, object block,
                           object values, object lengths, object waits, list cleanup, object copy, object foreign)
