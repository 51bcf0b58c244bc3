# Types for encode.py (the source): a lane's and a loaded kernel's fields as C slots, read per
# operation by the launch encode and the device-side waits.
cimport cython
from aiogpu._core.futures cimport GPUFuture
from aiogpu._core.state cimport DeviceState

# The calling thread's state's identifier (never reused in the process, unlike its thread's).
cdef extern from "Python.h":
    """
    static unsigned long long aiogpu_thread_state_id(void) {
        return (unsigned long long)PyThreadState_GetID(PyThreadState_Get());
    }
    """
    unsigned long long thread_state_id "aiogpu_thread_state_id" ()

cdef unsigned long long _last_thread
cdef object _last_device

@cython.locals(me=cython.ulonglong)
cpdef int make_current(object device) except -1
cpdef int forget_current() except -1

cdef class Lane:
    cdef public object name
    cdef public object device
    cdef public object stream
    cdef public long long ticket
    cdef public long long armed
    cdef public long long wanted
    cdef public object pending
    cdef public object kind
    cdef public object word
    cdef public object dptr
    cdef public double spin
    cdef public object rate
    # (the hot path's handles stay Python ints: they are passed on as they are)
    cdef public object sh
    cdef public object wordp
    cdef public object fused_word
    cdef public object hot
    cdef public int wait_geq

cdef class ForeignLane(Lane):
    cdef public object arm_stream

cdef class LoadedCudaKernel:
    cdef public object kernel
    cdef public object func
    cdef public object module
    cdef public object handle
    cdef public object writes
    cdef public object fmt
    cdef public object offsets
    cdef public Py_ssize_t size
    cdef public object _block
    cdef public object _ptrs
    cdef public object params
    cdef public object _pack
    cdef public object grid
    cdef public object block
    cdef public object gx, gy, gz, bx, by, bz

@cython.locals(dep=GPUFuture, cur=GPUFuture, other=Lane, newest=dict, code=cython.longlong)
cpdef long long wait_on_device(Lane lane, object waits) except? -1

@cython.locals(code=cython.longlong, ticket=cython.longlong)
cpdef launch_on_lane(object device, GPUFuture fut, Lane lane, LoadedCudaKernel loaded, object grid, object block,
                     object values, object waits, list cleanup)

cpdef long long enter_lane(object device, Lane lane, object waits) except? -1

cpdef lane_completes(object runtime, GPUFuture fut, Lane lane, list cleanup, long long code, object word,
                     long long ticket)

cpdef object encode_kernel(object device, object fut, object lane, object loaded, object grid, object block,
                           object values, object lengths, object waits, list cleanup, object copy=*, object foreign=*)

# (the hook ``bind`` sets: the signature of state.pxd's encode_kernel_fn)
@cython.locals(state=DeviceState)
cpdef bind(object device)
cdef object _encode_kernel_c(object device, object fut, object lane, object loaded, object grid, object block,
                             object values, object lengths, object waits, list cleanup, object copy, object foreign)
