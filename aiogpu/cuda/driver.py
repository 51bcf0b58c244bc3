"""The CUDA driver API through cuda-bindings: checked calls, error names, contexts, and the
few calls on the submission hot path.

Every call of ``cuda.bindings.driver`` returns ``(CUresult, *values)``; ``check`` turns a failure
into ``CudaError`` (a ``GPUError`` whose ``status`` is the CUresult). The hot path (launch, async
copy, the completion-word write and wait, event record/query/wait, host functions) goes through
``HOT``, one implementation of the interface ``HotPath`` (ints in, the CUresult as an int out):
- ``_CHot`` ("c"): the compiled module ``aiogpu.cuda._hotc`` calling libcuda's entry points
  directly, a launch or copy and its completion-word write in one C call. The default where the
  module was built (``pip install -e .``, or ``python -m aiogpu.cuda.build_hotc``) and libcuda
  loads;
- ``_BindingsHot`` ("cuda-bindings"): cuda-bindings, the fallback (the word write is a second
  call).
``AIOGPU_CUDA_HOT=bindings`` forces the fallback; ``HOT_REASON`` says why the one in use was
chosen. Both call the same entry points (e.g. ``cuStreamWriteValue64_v2``) and return the same
CUresult codes.
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

from cuda.bindings import driver as cu

from ..errors import CudaError  # noqa: F401 - re-exported: the backend raises D.CudaError
# The context current on each thread (kept with the launch encode, which tests it inline).
from .encode import forget_current as _forget_current

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


# -- contexts (which one is current per thread: encode.make_current) --------------------------------
def set_current(ctx: Any) -> None:
    """Make ``ctx`` current on this thread (``cuCtxSetCurrent``); raises CudaError."""
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def forget_current() -> None:
    """Every thread sets its context again before its next call."""
    _forget_current()


# -- the hot path ------------------------------------------------------------------------------------
class HotPath:
    """The driver calls of the submission hot path, declared once; ``HOT`` is the one in use.

    Every method takes handles (stream, event, function, device pointers) as ints and returns
    the CUresult as an int (0 on success); none raises for a driver error. ``launch`` and
    ``memcpy`` take, beyond the driver call's arguments, a completion word's device pointer and
    a ticket: with ``word != 0`` they write ``ticket`` to ``word`` on ``stream`` after the work
    (``cuStreamWriteValue64``), only if the work was queued; the result is then the first
    failure of the two calls. Implementations: ``_CHot`` (the C extension) and
    ``_BindingsHot`` (cuda-bindings, the fallback); both call the same entry points and
    return the same codes. ``write_path`` names how the completion word is written (stats).

    ``direct``: where compiled code may call the driver itself in this path's place, with the
    GIL held, the addresses of ``cuLaunchKernel``, ``cuMemcpyAsync``, ``cuStreamWriteValue64``
    and ``cuStreamWaitValue64`` as this path calls them (the lane's launch, copy, word write
    and cross-lane wait then cost no Python call: ``encode.Lane.use_hot``); None where every
    call must go through the methods."""

    name = "abstract"
    write_path = "none"
    direct: tuple[int, int, int, int] | None = None

    def launch(self, func: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int,
               stream: int, params: int, word: int = 0, ticket: int = 0) -> int:
        """``cuLaunchKernel`` (no ``extra``), then the word write where ``word != 0``."""
        raise NotImplementedError

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int, word: int = 0, ticket: int = 0) -> int:
        """``cuMemcpyAsync``, then the word write where ``word != 0``."""
        raise NotImplementedError

    def write64(self, stream: int, word: int, value: int) -> int:
        """``cuStreamWriteValue64(stream, word, value, 0)``."""
        raise NotImplementedError

    def wait64(self, stream: int, word: int, value: int, flags: int) -> int:
        """``cuStreamWaitValue64(stream, word, value, flags)``."""
        raise NotImplementedError

    def wait_event(self, stream: int, event: int) -> int:
        """``cuStreamWaitEvent(stream, event, 0)``."""
        raise NotImplementedError

    def record(self, event: int, stream: int) -> int:
        """``cuEventRecord(event, stream)``."""
        raise NotImplementedError

    def query(self, event: int) -> int:
        """``cuEventQuery(event)`` (``NOT_READY`` while pending)."""
        raise NotImplementedError

    def host_func(self, stream: int, fn: int, data: int) -> int:
        """``cuLaunchHostFunc(stream, fn, data)`` with ``fn`` a C function pointer: the driver's
        thread calls ``fn(data)`` without entering Python (e.g. libc's sem_post)."""
        raise NotImplementedError


class _BindingsHot(HotPath):
    """The hot calls through cuda-bindings (which turns an int handle into its handle type in
    each call): the fallback. The completion word after a launch or copy is a second call."""

    name = "cuda-bindings"
    write_path = "bindings"

    def __init__(self) -> None:
        # Bound once, when the driver module is imported (HOT is made then).
        self._launch, self._memcpy = cu.cuLaunchKernel, cu.cuMemcpyAsync
        self._write64, self._wait64 = cu.cuStreamWriteValue64, cu.cuStreamWaitValue64
        self._wait_event, self._record, self._query = cu.cuStreamWaitEvent, cu.cuEventRecord, cu.cuEventQuery
        self._host_func = _host_func_without_python()

    def launch(self, func: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int,
               stream: int, params: int, word: int = 0, ticket: int = 0) -> int:
        code = self._launch(func, gx, gy, gz, bx, by, bz, shmem, stream, params, 0)[0]
        if word and not code:
            return self._write64(stream, word, ticket, 0)[0]
        return code

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int, word: int = 0, ticket: int = 0) -> int:
        code = self._memcpy(dst, src, nbytes, stream)[0]
        if word and not code:
            return self._write64(stream, word, ticket, 0)[0]
        return code

    def write64(self, stream: int, word: int, value: int) -> int:
        return self._write64(stream, word, value, 0)[0]

    def wait64(self, stream: int, word: int, value: int, flags: int) -> int:
        return self._wait64(stream, word, value, flags)[0]

    def wait_event(self, stream: int, event: int) -> int:
        return self._wait_event(stream, event, 0)[0]

    def record(self, event: int, stream: int) -> int:
        return self._record(event, stream)[0]

    def query(self, event: int) -> int:
        return self._query(event)[0]

    def host_func(self, stream: int, fn: int, data: int) -> int:
        return self._host_func(stream, fn, data)


def _host_func_without_python() -> Any:
    """``(stream, fn, data) -> CUresult`` launching the C function ``fn`` as a host function:
    straight into libcuda through ctypes (the driver thread calls ``fn`` and never enters
    Python); where libcuda is under another name, or the bindings in use are not the driver's
    (no ``cuGetProcAddress``: the fake of tests/fakes on a machine whose libcuda.so.1 is a real
    driver, which must never get the fake's handles), cuda-bindings' C trampoline."""
    try:
        if not hasattr(cu, "cuGetProcAddress"):
            raise OSError("the cuda.bindings in use are not the real ones")
        f = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
    except (OSError, AttributeError):
        return lambda s, fn, d: cu.cuLaunchHostFunc(s, cu.CUhostFn(fn), d)[0]
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return f


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


class _CHot(HotPath):
    """The hot calls through the C extension ``aiogpu.cuda._hotc`` (ImportError where it was
    not built): each method is the C function itself, with the interface's argument order; a
    launch or copy and its completion-word write are one C call.

    ``entry_points`` (tests) replaces libcuda's addresses; by default they come from libcuda,
    and only where the cuda-bindings in use have ``cuGetProcAddress``: the real ones, or the
    fake of tests/fakes, which has it only to go with its own libcuda.so.1 (tests/fakes/libcuda;
    its handles mean nothing to a real driver)."""

    name = "c"
    write_path = "c"

    def __init__(self, entry_points: dict[str, int] | None = None) -> None:
        from . import _hotc
        if entry_points is None:
            if not hasattr(cu, "cuGetProcAddress"):
                raise OSError("the cuda.bindings in use are not the real ones")
            entry_points = driver_entry_points()
        points = {key: int(entry_points.get(key) or 0) for key, _ in C_ENTRY_POINTS}
        _hotc.init(*points.values())
        # The GIL stays held in the calls unless AIOGPU_HOTC_RELEASE_GIL=1 (see _hotc.c).
        release_gil = os.environ.get("AIOGPU_HOTC_RELEASE_GIL", "") == "1"
        _hotc.set_release_gil(release_gil)
        self.module = _hotc
        # The same entry points for the compiled launch and copy (``HotPath.direct``): only
        # with the GIL held, as _hotc calls them, and only where all four are set (an unset
        # one raises RuntimeError through the method instead).
        direct = (points["launch"], points["memcpy"], points["write64"], points["wait64"])
        self.direct = None if release_gil or not all(direct) else direct
        # The C functions as instance attributes, named as the interface's methods: a call is
        # one C call, no Python frame in between.
        for key, _ in C_ENTRY_POINTS:
            setattr(self, key, getattr(_hotc, key))


def _hot() -> tuple[HotPath, str]:
    """(the hot-path implementation, why it was chosen): the C extension where it loads and
    libcuda is the driver, else cuda-bindings; ``AIOGPU_CUDA_HOT=bindings`` forces the latter."""
    want = os.environ.get("AIOGPU_CUDA_HOT", "").strip().lower()
    if want == "bindings":
        return _BindingsHot(), "AIOGPU_CUDA_HOT=bindings"
    # (an unknown value is reported, not raised: the backend must still import)
    note = f"; AIOGPU_CUDA_HOT={want} names no hot path (c, bindings)" if want not in ("", "c") else ""
    try:
        hot = _CHot()
        return hot, ("AIOGPU_CUDA_HOT=c" if want == "c" else "the C extension loaded (the default)") + note
    except (ImportError, OSError, AttributeError) as exc:
        return _BindingsHot(), f"the C hot path is unavailable ({type(exc).__name__}: {exc}){note}"


HOT: HotPath
HOT, HOT_REASON = _hot()


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
