"""The CUDA driver API through cuda-bindings: checked calls, error names, contexts, and the
few calls on the submission hot path.

Every call of ``cuda.bindings.driver`` returns ``(CUresult, *values)``; ``check`` turns a failure
into ``CudaError`` (a ``GPUError`` whose ``status`` is the CUresult). The hot path (launch, event
record/query/wait, async copy, the completion-word write) goes through ``HOT``, one of:
- ``_CHot`` ("c"): the compiled module ``aiogpu.cuda._hotc`` calling libcuda's entry points
  directly, a launch or copy and its completion-word write in one C call. The default where the
  module was built (``pip install -e .``, or ``python -m aiogpu.cuda.build_hotc``) and libcuda
  loads;
- ``_BindingsHot`` ("cuda-bindings"): cuda-bindings with cached handle objects; the fallback;
- ``_CtypesHot`` ("ctypes"): libcuda through ctypes.
``AIOGPU_CUDA_HOT=c|bindings|ctypes`` forces one (falling back to cuda-bindings if it cannot
load); ``HOT_REASON`` says why the one in use was chosen. All three call the same entry points
as cuda-bindings (e.g. ``cuStreamWriteValue64_v2``) and return the same CUresult codes.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from cuda.bindings import driver as cu

from ..errors import CudaError  # noqa: F401 - re-exported: the backend raises D.CudaError

SUCCESS = 0
NOT_READY = int(cu.CUresult.CUDA_ERROR_NOT_READY)
ALREADY_REGISTERED = int(cu.CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
PEER_ALREADY_ENABLED = int(cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
OUT_OF_MEMORY = int(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)

A = cu.CUdevice_attribute
EVENT_DISABLE_TIMING = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
EVENT_BLOCKING_SYNC = int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
STREAM_NON_BLOCKING = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
HOSTREGISTER_PORTABLE = int(cu.CU_MEMHOSTREGISTER_PORTABLE)
HOSTREGISTER_DEVICEMAP = int(cu.CU_MEMHOSTREGISTER_DEVICEMAP)
HOSTALLOC_PORTABLE = 1
HOSTALLOC_DEVICEMAP = int(cu.CU_MEMHOSTALLOC_DEVICEMAP)
WAIT_GEQ = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)

# Errors after which the context is unusable (CUDA errors are sticky per context).
STICKY = {int(getattr(cu.CUresult, n)) for n in (
    "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ASSERT", "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_ECC_UNCORRECTABLE", "CUDA_ERROR_CONTEXT_IS_DESTROYED") if hasattr(cu.CUresult, n)}


def error_name(code: Any) -> str:
    try:
        err, text = cu.cuGetErrorName(code)
        if int(err) == 0 and text:
            return text.decode()
    except Exception:  # noqa: BLE001
        pass
    return f"CUresult {int(code)}"


def check(result: Any, what: str) -> Any:
    """The values of a cuda-bindings call, or CudaError naming ``what`` and the CUresult."""
    err = result[0]
    if err != 0:
        raise CudaError(f"{what}: {error_name(err)}", status=int(err))
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def attribute(dev: Any, name: str) -> int:
    return check(cu.cuDeviceGetAttribute(getattr(A, name), dev), f"cuDeviceGetAttribute({name})")


# -- contexts --------------------------------------------------------------------------------------
_tls = threading.local()
_generation = [0]


def make_current(ctx: Any, handle: int) -> None:
    """Make ``ctx`` current on this thread (a no-op when it already is, in this generation:
    closing a runtime starts a new one, since a released primary context may come back)."""
    key = (handle, _generation[0])
    if getattr(_tls, "ctx", None) != key:
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        _tls.ctx = key


def forget_current() -> None:
    """Every thread sets its context again before its next call."""
    _generation[0] += 1


# -- the hot path ------------------------------------------------------------------------------------
class _BindingsHot:
    """Hot calls through cuda-bindings (handles are the cached CU* objects)."""

    name = "cuda-bindings"

    def __init__(self) -> None:
        self.launch = cu.cuLaunchKernel
        self._record, self._query, self._wait = cu.cuEventRecord, cu.cuEventQuery, cu.cuStreamWaitEvent
        self._memcpy = cu.cuMemcpyAsync

    def record(self, event: Any, stream: Any) -> int:
        return self._record(event, stream)[0]

    def query(self, event: Any) -> int:
        return self._query(event)[0]

    def wait(self, stream: Any, event: Any) -> int:
        return self._wait(stream, event, 0)[0]

    def memcpy(self, dst: int, src: int, n: int, stream: Any) -> int:
        return self._memcpy(dst, src, n, stream)[0]

    def kernel(self, func: Any, grid: tuple, block: tuple, stream: Any, params: int) -> int:
        return self.launch(func, grid[0], grid[1], grid[2], block[0], block[1], block[2], 0, stream,
                           params, 0)[0]


class _CtypesHot:
    """The same calls straight into libcuda through ctypes (handles as CU* objects; their int
    values are taken once per object and cached by the caller)."""

    name = "ctypes"

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u, sz = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
        self._launch = lib.cuLaunchKernel
        self._launch.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
        self._record = lib.cuEventRecord
        self._record.argtypes = [vp, vp]
        self._query = lib.cuEventQuery
        self._query.argtypes = [vp]
        self._wait = lib.cuStreamWaitEvent
        self._wait.argtypes = [vp, vp, u]
        self._memcpy = lib.cuMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, sz, vp]

    def record(self, event: Any, stream: Any) -> int:
        return self._record(int(event), int(stream))

    def query(self, event: Any) -> int:
        return self._query(int(event))

    def wait(self, stream: Any, event: Any) -> int:
        return self._wait(int(stream), int(event), 0)

    def memcpy(self, dst: int, src: int, n: int, stream: Any) -> int:
        return self._memcpy(dst, src, n, int(stream))

    def kernel(self, func: Any, grid: tuple, block: tuple, stream: Any, params: int) -> int:
        return self._launch(int(func), grid[0], grid[1], grid[2], block[0], block[1], block[2], 0,
                            int(stream), params, None)


# The entry points of the C hot path, in the order _hotc.init takes them, each with the driver
# symbols to try: the versions cuda-bindings calls (its cuStreamWriteValue64 is the _v2 entry
# point; the others are unversioned); the plain name where an older driver lacks _v2.
C_ENTRY_POINTS = (
    ("launch", ("cuLaunchKernel",)),
    ("memcpy", ("cuMemcpyAsync",)),
    ("write64", ("cuStreamWriteValue64_v2", "cuStreamWriteValue64")),
    ("wait64", ("cuStreamWaitValue64_v2", "cuStreamWaitValue64")),
    ("wait_event", ("cuStreamWaitEvent",)),
    ("record", ("cuEventRecord",)),
    ("query", ("cuEventQuery",)),
    ("host_func", ("cuLaunchHostFunc",)),
)


def driver_entry_points(lib: Any = None) -> dict[str, int]:
    """The addresses of ``C_ENTRY_POINTS`` in libcuda (OSError where it does not load,
    AttributeError naming a missing one). With cuda-bindings' per-thread default stream
    (``CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM``) the ``_ptsz`` variants come first, as
    cuda-bindings uses them then: stream 0 means the same stream on both paths."""
    lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
    ptds = os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")
    out = {}
    for key, names in C_ENTRY_POINTS:
        tried = [v for n in names for v in ((n + "_ptsz", n) if ptds else (n,))]
        for sym in tried:
            try:
                out[key] = ctypes.cast(getattr(lib, sym), ctypes.c_void_p).value or 0
                break
            except AttributeError:
                continue
        else:
            raise AttributeError(f"libcuda has none of {', '.join(tried)}")
    return out


class _CHot:
    """Hot calls through the C extension ``aiogpu.cuda._hotc`` (ImportError where it was not
    built). Its functions take handles as ints (fastest: callers cache ``int(handle)``) or as
    cuda-bindings objects (converted through ``__int__`` in C), and return the CUresult as an int.

    ``launch`` and ``memcpy`` take, beyond the driver call's arguments, the completion word's
    device pointer and the ticket to write there once the work is queued (skipped when the
    launch or copy failed): the submission's driver work in one call.

    ``entry_points`` (tests) replaces libcuda's addresses; by default they come from libcuda,
    and only where the cuda-bindings in use are the real ones (bench/fakecuda's fake has no
    ``cuGetProcAddress``, and its handles mean nothing to a real driver)."""

    name = "c"

    def __init__(self, entry_points: dict[str, int] | None = None) -> None:
        from . import _hotc
        if entry_points is None:
            if not hasattr(cu, "cuGetProcAddress"):
                raise OSError("the cuda.bindings in use are not the real ones")
            entry_points = driver_entry_points()
        _hotc.init(*(int(entry_points.get(key) or 0) for key, _ in C_ENTRY_POINTS))
        # The GIL stays held in the calls unless AIOGPU_HOTC_RELEASE_GIL=1 (see _hotc.c).
        _hotc.set_release_gil(os.environ.get("AIOGPU_HOTC_RELEASE_GIL", "") == "1")
        self.module = _hotc
        # The C functions have the argument order of the methods they stand for.
        self.launch = _hotc.launch          # (func, gx, gy, gz, bx, by, bz, shmem, stream, params[, word, ticket])
        self.memcpy = _hotc.memcpy          # (dst, src, nbytes, stream[, word, ticket])
        self.record = _hotc.record          # (event, stream)
        self.query = _hotc.query            # (event)
        self.wait = _hotc.wait_event        # (stream, event)
        self.write64 = _hotc.write64        # (stream, word, value)
        self.wait64 = _hotc.wait64          # (stream, word, value, flags)
        self.host_func = _hotc.host_func    # (stream, fn, data)

    def kernel(self, func: Any, grid: tuple, block: tuple, stream: Any, params: int) -> int:
        return self.launch(func, grid[0], grid[1], grid[2], block[0], block[1], block[2], 0, stream, params)


def _hot() -> tuple[Any, str]:
    """(the hot-path implementation, why it was chosen)."""
    want = os.environ.get("AIOGPU_CUDA_HOT", "").strip().lower()
    if want == "bindings":
        return _BindingsHot(), "AIOGPU_CUDA_HOT=bindings"
    if want == "ctypes":
        try:
            return _CtypesHot(), "AIOGPU_CUDA_HOT=ctypes"
        except OSError as exc:
            return _BindingsHot(), f"AIOGPU_CUDA_HOT=ctypes, but libcuda did not load ({exc})"
    try:
        hot = _CHot()
        return hot, "AIOGPU_CUDA_HOT=c" if want == "c" else "the C extension loaded (the default)"
    except (ImportError, OSError, AttributeError) as exc:
        return _BindingsHot(), f"the C hot path is unavailable ({type(exc).__name__}: {exc})"


HOT, HOT_REASON = _hot()


# -- the completion-word write: cuda-bindings or ctypes, whichever is cheaper here ---------------
def _bindings_write64(stream: Any, dptr: Any, value: int) -> int:
    return cu.cuStreamWriteValue64(stream, dptr, value, 0)[0]


write64: Any = _bindings_write64
write64_python: Any = _bindings_write64   # the cheaper Python way, once calibrate_python_write64 ran
_write_path: list[str] = []
_python_path: list[str] = []


def calibrate_write64(stream: Any, dptr: Any) -> str:
    """Choose ``write64``, the completion-word write outside the fused C calls, once per
    process: the C call on the C hot path (cheaper than either Python way; nothing to
    measure), else the cheaper Python way (``calibrate_python_write64``). Its name."""
    global write64
    if _write_path:
        return _write_path[0]
    if type(HOT) is _CHot:
        write64, path = HOT.write64, "c"
    else:
        path = calibrate_python_write64(stream, dptr)
        write64 = write64_python
    _write_path.append(path)
    return path


def calibrate_python_write64(stream: Any, dptr: Any) -> str:
    """Pick the cheaper way to call ``cuStreamWriteValue64`` from Python (cuda-bindings converts
    the value through an object each call; ctypes does not) as ``write64_python``, once per
    process. Writes 0 to ``dptr`` a few hundred times."""
    global write64_python
    import time
    if _python_path:
        return _python_path[0]
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        # the entry point cuda-bindings calls (_v2), where the driver has it
        f = getattr(lib, "cuStreamWriteValue64_v2", None) or lib.cuStreamWriteValue64
        f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        raw = int(dptr)

        def ctypes_write64(stream: Any, _dptr: Any, value: int) -> int:
            return f(int(stream), raw if _dptr is dptr else int(_dptr), value, 0)

        cands = {"bindings": _bindings_write64, "ctypes": ctypes_write64}
    except (OSError, AttributeError):
        _python_path.append("bindings")
        return "bindings"
    best, best_t = "bindings", None
    for name, fn in cands.items():
        fn(stream, dptr, 0)
        t = time.perf_counter()
        for _ in range(300):
            fn(stream, dptr, 0)
        t = time.perf_counter() - t
        if best_t is None or t < best_t:
            best, best_t = name, t
    if best == "ctypes":
        def ctypes_any(stream: Any, dptr_: Any, value: int) -> int:
            return f(int(stream), int(dptr_), value, 0)
        write64_python = ctypes_any
    cu.cuStreamSynchronize(stream)
    _python_path.append(best)
    return best


# -- host functions without Python: libc's sem_post as the CUhostFn ---------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
SEM_POST = ctypes.cast(_libc.sem_post, ctypes.c_void_p).value
_sem_post = _libc.sem_post
_sem_post.argtypes = [ctypes.c_void_p]
_sem_wait = _libc.sem_timedwait
_sem_wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_sem_trywait = _libc.sem_trywait
_sem_trywait.argtypes = [ctypes.c_void_p]
_clock_gettime = _libc.clock_gettime
_clock_gettime.argtypes = [ctypes.c_int, ctypes.c_void_p]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Semaphore:
    """A POSIX semaphore in memory that C code (the driver's callback thread) posts with
    ``sem_post`` and the waiter thread waits on with the GIL released (ctypes drops it)."""

    def __init__(self) -> None:
        self._mem = ctypes.create_string_buffer(64)   # sizeof(sem_t) is 32 on x86-64 glibc
        self.address = ctypes.addressof(self._mem)
        if _libc.sem_init(ctypes.c_void_p(self.address), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self._ts = _Timespec()

    def post(self) -> None:
        _sem_post(self.address)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds (GIL released); True if posted."""
        ts = self._ts
        _clock_gettime(0, ctypes.byref(ts))   # CLOCK_REALTIME, as sem_timedwait wants
        ns = ts.tv_nsec + int(timeout * 1e9)
        ts.tv_sec += ns // 1_000_000_000
        ts.tv_nsec = ns % 1_000_000_000
        return _sem_wait(self.address, ctypes.byref(ts)) == 0

    def drain(self) -> int:
        n = 0
        while _sem_trywait(self.address) == 0:
            n += 1
        return n

    def destroy(self) -> None:
        _libc.sem_destroy(ctypes.c_void_p(self.address))


_launch_host_func = None


def launch_host_func(stream: Any, fn: int, data: int) -> int:
    """``cuLaunchHostFunc(stream, fn, data)`` with a C function pointer: straight into libcuda,
    so that the driver thread calls ``fn`` (e.g. sem_post) and never enters Python."""
    global _launch_host_func
    hot = HOT
    if type(hot) is _CHot:
        return hot.host_func(stream, fn, data)
    if _launch_host_func is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            f = lib.cuLaunchHostFunc
            f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            _launch_host_func = lambda s, fn_, d: f(int(s), fn_, d)  # noqa: E731
        except OSError:   # the driver library under another name: cuda-bindings' C trampoline
            _launch_host_func = lambda s, fn_, d: cu.cuLaunchHostFunc(s, cu.CUhostFn(fn_), d)[0]  # noqa: E731
    return _launch_host_func(stream, fn, data)
