"""Fake CUDA driver API (see tests/fakes/README.md): instant, synchronous, no GPU."""
import ctypes
import enum
import itertools


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_NOT_FOUND = 500


class CUevent_flags(enum.IntEnum):
    CU_EVENT_DISABLE_TIMING = 2
    CU_EVENT_BLOCKING_SYNC = 1


class CUstream_flags(enum.IntEnum):
    CU_STREAM_NON_BLOCKING = 1


class CUstreamWaitValue_flags(enum.IntEnum):
    CU_STREAM_WAIT_VALUE_GEQ = 0


class CUpointer_attribute(enum.IntEnum):
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2


class CUmemorytype(enum.IntEnum):
    CU_MEMORYTYPE_HOST = 1
    CU_MEMORYTYPE_DEVICE = 2
    CU_MEMORYTYPE_UNIFIED = 4


class _Attrs:
    def __getattr__(self, name):
        return name


CUdevice_attribute = _Attrs()
CU_MEMHOSTREGISTER_PORTABLE = 1
CU_MEMHOSTREGISTER_DEVICEMAP = 2
CU_MEMHOSTALLOC_DEVICEMAP = 2

_ATTR = {"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": 9, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": 0,
         "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X": 2**31 - 1, "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y": 65535,
         "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z": 65535}


class _Handle:
    __slots__ = ("v",)

    def __init__(self, v=0):
        self.v = int(v)

    def __int__(self):
        return self.v

    def __index__(self):
        return self.v


class CUstream(_Handle):
    pass


class CUevent(_Handle):
    pass


class CUdeviceptr(_Handle):
    pass


class CUhostFn(_Handle):
    pass


class CUDA_KERNEL_NODE_PARAMS:
    pass


class CUDA_MEMCPY3D:
    pass


_ids = itertools.count(0x1000)
_mem: dict = {}
_host_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_memmove = ctypes.memmove


def _alloc(size):
    buf = ctypes.create_string_buffer(max(size, 8))
    addr = ctypes.addressof(buf)
    _mem[addr] = buf
    return addr


def cuInit(flags): return (CUresult.CUDA_SUCCESS,)
def cuDeviceGetCount(): return (CUresult.CUDA_SUCCESS, 1)
def cuDriverGetVersion(): return (CUresult.CUDA_SUCCESS, 13000)
def cuDeviceGet(i): return (CUresult.CUDA_SUCCESS, i)
def cuDeviceGetName(n, dev): return (CUresult.CUDA_SUCCESS, b"Fake GPU\0")
def cuDeviceGetAttribute(attr, dev): return (CUresult.CUDA_SUCCESS, _ATTR.get(attr, 1))
def cuGetErrorName(code): return (CUresult.CUDA_SUCCESS, f"CUDA_ERROR_{int(code)}".encode())
def cuDevicePrimaryCtxRetain(dev): return (CUresult.CUDA_SUCCESS, _Handle(0x100 + int(dev)))
def cuStreamGetCtx(s): return (CUresult.CUDA_SUCCESS, _Handle(0x100))   # every stream: device 0
def cuDevicePrimaryCtxRelease(dev): return (CUresult.CUDA_SUCCESS,)
def cuDevicePrimaryCtxReset(dev): return (CUresult.CUDA_SUCCESS,)
def cuCtxSetCurrent(ctx): return (CUresult.CUDA_SUCCESS,)
def cuCtxSynchronize(): return (CUresult.CUDA_SUCCESS,)
def cuDeviceCanAccessPeer(a, b): return (CUresult.CUDA_SUCCESS, 0)
def cuCtxEnablePeerAccess(ctx, f): return (CUresult.CUDA_SUCCESS,)
def cuStreamCreateWithPriority(flags, prio): return (CUresult.CUDA_SUCCESS, CUstream(next(_ids)))
def cuStreamCreate(flags): return (CUresult.CUDA_SUCCESS, CUstream(next(_ids)))
def cuStreamDestroy(s): return (CUresult.CUDA_SUCCESS,)
def cuStreamSynchronize(s): return (CUresult.CUDA_SUCCESS,)
def cuStreamQuery(s): return (CUresult.CUDA_SUCCESS,)
def cuEventCreate(flags): return (CUresult.CUDA_SUCCESS, CUevent(next(_ids)))
def cuEventDestroy(e): return (CUresult.CUDA_SUCCESS,)
def cuEventRecord(e, s): return (CUresult.CUDA_SUCCESS,)
def cuEventQuery(e): return (CUresult.CUDA_SUCCESS,)
def cuEventSynchronize(e): return (CUresult.CUDA_SUCCESS,)
def cuStreamWaitEvent(s, e, f): return (CUresult.CUDA_SUCCESS,)
def cuStreamWaitValue64(s, p, v, f): return (CUresult.CUDA_SUCCESS,)


def cuStreamWriteValue64(stream, dptr, value, flags):
    ctypes.c_uint64.from_address(int(dptr)).value = value
    return (CUresult.CUDA_SUCCESS,)


def cuStreamWriteValue32(stream, dptr, value, flags):
    ctypes.c_uint32.from_address(int(dptr)).value = value
    return (CUresult.CUDA_SUCCESS,)


def cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shm, stream, params, extra):
    return (CUresult.CUDA_SUCCESS,)


def cuLaunchHostFunc(stream, fn, data):
    # The C function ``fn(data)`` at once, on the calling thread (as the fake libcuda.so.1 runs
    # it): aiogpu's own is sem_post, the GPU bench's a ctypes callback of its own.
    if not int(fn):
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    _host_fn(int(fn))(data)
    return (CUresult.CUDA_SUCCESS,)


def cuMemcpyAsync(dst, src, n, stream):
    _memmove(int(dst), int(src), n)
    return (CUresult.CUDA_SUCCESS,)


cuMemcpyHtoDAsync = cuMemcpyDtoHAsync = cuMemcpyDtoDAsync = cuMemcpyAsync


def cuMemcpyPeerAsync(dst, dctx, src, sctx, n, stream):
    _memmove(int(dst), int(src), n)
    return (CUresult.CUDA_SUCCESS,)


def cuMemsetD32Async(ptr, word, count, stream):
    (ctypes.c_uint32 * count).from_address(int(ptr))[:] = [word] * count
    return (CUresult.CUDA_SUCCESS,)


def cuMemAlloc(size):
    if size > 1 << 33:
        return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
    return (CUresult.CUDA_SUCCESS, CUdeviceptr(_alloc(size)))
def cuMemFree(p): _mem.pop(int(p), None); return (CUresult.CUDA_SUCCESS,)
def cuMemGetInfo(): return (CUresult.CUDA_SUCCESS, 1 << 34, 1 << 34)
def cuMemHostAlloc(size, flags): return (CUresult.CUDA_SUCCESS, _alloc(size))
def cuMemFreeHost(p): _mem.pop(int(p), None); return (CUresult.CUDA_SUCCESS,)
def cuMemHostRegister(addr, size, flags): return (CUresult.CUDA_SUCCESS,)
def cuMemHostUnregister(addr): return (CUresult.CUDA_SUCCESS,)
def cuMemHostGetDevicePointer(addr, flags): return (CUresult.CUDA_SUCCESS, CUdeviceptr(int(addr)))
def cuPointerGetAttribute(attr, addr): return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
def cuModuleLoadData(code): return (CUresult.CUDA_SUCCESS, _Handle(next(_ids)))
def cuModuleGetFunction(mod, name): return (CUresult.CUDA_SUCCESS, _Handle(next(_ids)))
def cuModuleUnload(mod): return (CUresult.CUDA_SUCCESS,)
def cuFuncLoad(f): return (CUresult.CUDA_SUCCESS,)
def cuGraphCreate(f): return (CUresult.CUDA_SUCCESS, _Handle(next(_ids)))
def cuGraphAddKernelNode(g, deps, n, p): return (CUresult.CUDA_SUCCESS, _Handle(next(_ids)))
def cuGraphAddMemcpyNode(g, deps, n, p, ctx): return (CUresult.CUDA_SUCCESS, _Handle(next(_ids)))
def cuGraphAddEmptyNode(g, deps, n): return (CUresult.CUDA_SUCCESS, _Handle(next(_ids)))
def cuGraphInstantiate(g, f): return (CUresult.CUDA_SUCCESS, _Handle(next(_ids)))
def cuGraphExecKernelNodeSetParams(e, n, p): return (CUresult.CUDA_SUCCESS,)
def cuGraphLaunch(e, s): return (CUresult.CUDA_SUCCESS,)
def cuGraphExecDestroy(e): return (CUresult.CUDA_SUCCESS,)
def cuGraphDestroy(g): return (CUresult.CUDA_SUCCESS,)


# The C entry points: the fake libcuda.so.1 (tests/fakes/libcuda/, built there by build_libcuda.py)
# where the loader finds it (LD_LIBRARY_PATH). Its handles are this module's ints, and its
# calls do what this module's do.
def _c_library():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if hasattr(lib, "fakecuda_calls") else None   # only the fake fits this fake


# Only where the loader's libcuda.so.1 is the fake: aiogpu's C hot path loads libcuda.so.1 itself
# once the bindings offer cuGetProcAddress, and a real driver must never get this fake's handles
# (on a GPU machine the fake then runs the cuda-bindings path, as it always did).
if _c_library() is not None:
    def cuGetProcAddress(symbol, cudaVersion, flags):
        """(CUresult, the symbol's address in the fake libcuda.so.1, its status): NOT_FOUND where
        that library is not loadable or lacks the symbol, as the real call answers for a symbol the
        driver lacks."""
        lib = _c_library()
        name = symbol.decode() if isinstance(symbol, bytes) else str(symbol)
        fn = getattr(lib, name, None) if lib is not None else None
        if fn is None:
            return (CUresult.CUDA_ERROR_NOT_FOUND, 0, 1)
        return (CUresult.CUDA_SUCCESS, ctypes.cast(fn, ctypes.c_void_p).value, 0)
