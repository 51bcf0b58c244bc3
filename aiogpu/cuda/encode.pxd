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

# The driver's entry points that a lane calls itself where its hot path gives them
# (``HotPath.direct``): the driver API's documented signatures, as aiogpu/cuda/_hotc.c declares
# them (CUresult an int, handles pointers, CUdeviceptr a 64-bit unsigned integer).
ctypedef int (*cu_launch_t)(void *, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                            unsigned int, unsigned int, void *, void **, void **) noexcept
ctypedef int (*cu_memcpy_t)(unsigned long long, unsigned long long, size_t, void *) noexcept
ctypedef int (*cu_memop64_t)(void *, unsigned long long, unsigned long long, unsigned int) noexcept

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
    cdef public long long written
    cdef public int lazy
    cdef public bint eager
    cdef public long long demanded
    cdef public long long armed
    cdef public long long wanted
    cdef public object pending
    cdef public object kind
    cdef public object word
    cdef public object dptr
    cdef public double spin
    cdef public object rate
    # (the hot path's handles: the stream, the word's device pointer, 0 or the word)
    cdef public unsigned long long sh
    cdef public unsigned long long wordp
    cdef public unsigned long long fused_word
    cdef readonly object hot
    cdef public int wait_geq
    # (the hot path's ``direct`` entry points, NULL where it gives none: ``use_hot``)
    cdef cu_launch_t _cu_launch
    cdef cu_memcpy_t _cu_memcpy
    cdef cu_memop64_t _cu_write64
    cdef cu_memop64_t _cu_wait64
    cdef readonly bint direct

cdef class ForeignLane(Lane):
    cdef public object arm_stream

cdef class LoadedCudaKernel:
    cdef public object kernel
    cdef public object func
    cdef public object module
    cdef public unsigned long long handle
    cdef public object writes
    cdef public object fmt
    cdef public tuple offsets
    cdef public bytes kinds
    cdef public unsigned long long base
    cdef public Py_ssize_t size
    cdef public object _block
    cdef public object _ptrs
    cdef public unsigned long long params
    cdef public object _pack
    cdef public object grid
    cdef public object block
    cdef public unsigned int gx, gy, gz, bx, by, bz

    cpdef unsigned long long pack(self, object values) except? 0


# The compiled lane's own driver calls (``Lane.direct``), as ``HotPath.launch``, ``memcpy``
# and ``wait64`` do them: the CUresult, the word written only after queued work.
cdef inline int set_direct(Lane lane, object direct) except -1:
    lane._cu_launch = <cu_launch_t><size_t>(<unsigned long long>direct[0] if direct else 0)
    lane._cu_memcpy = <cu_memcpy_t><size_t>(<unsigned long long>direct[1] if direct else 0)
    lane._cu_write64 = <cu_memop64_t><size_t>(<unsigned long long>direct[2] if direct else 0)
    lane._cu_wait64 = <cu_memop64_t><size_t>(<unsigned long long>direct[3] if direct else 0)
    lane.direct = lane._cu_launch != NULL
    return 0

# ``LoadedCudaKernel.pack``'s block write in C: each value stored at its offset as its struct
# format character (``kinds``) says, as ``struct.pack_into(fmt)`` stores it; what C refuses (a
# value out of its type's range, which validation excludes) goes to struct itself, which then
# raises its own error (or stores what C was stricter about).
cdef inline int pack_direct(LoadedCudaKernel k, object values) except -1:
    cdef tuple offsets = k.offsets
    cdef const unsigned char *kinds = k.kinds
    cdef Py_ssize_t i, n = len(offsets)
    cdef char *base = <char *><size_t>k.base
    cdef char *at
    cdef unsigned char kind
    cdef double d
    if len(values) != n:
        k._pack(k._block, 0, *values)          # (raises struct.error, as pack does)
        return 0
    try:
        for i in range(n):
            v = values[i]
            at = base + <Py_ssize_t>offsets[i]
            kind = kinds[i]
            if kind != 102 and kind != 100 and type(v) is not int:
                v = v.__index__()               # (as struct takes an integer: floats refused)
            if kind == 81:                      # Q
                (<unsigned long long *>at)[0] = v
            elif kind == 73:                    # I
                (<unsigned int *>at)[0] = v
            elif kind == 105:                   # i
                (<int *>at)[0] = v
            elif kind == 102:                   # f
                d = v
                if (d > 3.4028234663852886e38 or d < -3.4028234663852886e38) and d - d == 0:
                    raise OverflowError(d)      # (finite, beyond float32: struct's error)
                (<float *>at)[0] = <float>d
            elif kind == 100:                   # d
                (<double *>at)[0] = v
            elif kind == 113:                   # q
                (<long long *>at)[0] = v
            elif kind == 72:                    # H
                (<unsigned short *>at)[0] = v
            elif kind == 104:                   # h
                (<short *>at)[0] = v
            elif kind == 66:                    # B
                (<unsigned char *>at)[0] = v
            else:                               # b
                (<signed char *>at)[0] = v
    except Exception:
        k._pack(k._block, 0, *values)
    return 0

cdef inline int direct_launch(Lane lane, LoadedCudaKernel k, unsigned long long word,
                              unsigned long long ticket) noexcept:
    cdef void *stream = <void *><size_t>lane.sh
    cdef int rc = lane._cu_launch(<void *><size_t>k.handle, k.gx, k.gy, k.gz, k.bx, k.by, k.bz, 0, stream,
                                  <void **><size_t>k.params, NULL)
    if rc == 0 and word != 0:
        rc = lane._cu_write64(stream, word, ticket, 0)
    return rc

cdef inline int direct_memcpy(Lane lane, unsigned long long dst, unsigned long long src, unsigned long long nbytes,
                              unsigned long long word, unsigned long long ticket) noexcept:
    cdef void *stream = <void *><size_t>lane.sh
    cdef int rc = lane._cu_memcpy(dst, src, <size_t>nbytes, stream)
    if rc == 0 and word != 0:
        rc = lane._cu_write64(stream, word, ticket, 0)
    return rc

cdef inline int direct_write64(Lane lane, unsigned long long value) noexcept:
    return lane._cu_write64(<void *><size_t>lane.sh, lane.wordp, value, 0)

cdef inline int direct_wait64(Lane lane, unsigned long long word, unsigned long long value) noexcept:
    return lane._cu_wait64(<void *><size_t>lane.sh, word, value, <unsigned int>lane.wait_geq)

@cython.locals(dep=GPUFuture, cur=GPUFuture, other=Lane, newest=dict, code=cython.longlong)
cpdef long long wait_on_device(Lane lane, object waits) except? -1

@cython.locals(gap=cython.longlong)
cpdef int awaited(Lane lane, GPUFuture fut) except -1

@cython.locals(newest=cython.longlong, code=cython.longlong)
cpdef long long flush_word(Lane lane, long long ticket) except? -1

@cython.locals(code=cython.longlong, ticket=cython.longlong, word=cython.ulonglong, write=cython.ulonglong)
cpdef launch_on_lane(object device, GPUFuture fut, Lane lane, LoadedCudaKernel loaded, object grid, object block,
                     object values, object waits, list cleanup)

cpdef long long enter_lane(object device, Lane lane, object waits) except? -1

cpdef lane_completes(object runtime, GPUFuture fut, Lane lane, list cleanup, long long code, unsigned long long word,
                     long long ticket, bint wrote=*)

cpdef object encode_kernel(object device, object fut, object lane, object loaded, object grid, object block,
                           object values, object lengths, object waits, list cleanup, object copy=*, object foreign=*)

# (the hook ``bind`` sets: the signature of state.pxd's encode_kernel_fn)
@cython.locals(state=DeviceState)
cpdef bind(object device)
cdef object _encode_kernel_c(object device, object fut, object lane, object loaded, object grid, object block,
                             object values, object lengths, object waits, list cleanup, object copy, object foreign)
