# The runtime's and the device's per-operation fields as C slots (state.py is the source; this
# only types it). Runtime and Device derive from these in Python.
from aiogpu._core.interrupts cimport InterruptSafeLock

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


cdef class DeviceState:
    cdef public object runtime
    cdef public object memory
    cdef public object broken
    cdef public dict _kernels
    cdef public dict _shapes
    cdef public object _lane_order
