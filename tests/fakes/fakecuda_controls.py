"""Controls over the fake driver of tests/fakes for the CUDA host-path tests (imported by their child
processes before aiogpu, since aiogpu.cuda.driver binds some driver calls at import).

The fake runs every operation at once; these controls make the cases a real GPU produces:
- ``hold(stream)``: the stream's completion-word writes and host functions wait, in order,
  until ``release(stream)`` (or ``step(stream, n)`` runs the first ``n``), and queries of it say
  NOT_READY meanwhile (work that is still running on the device);
- ``log``: the driver calls named in ``LOGGED``, with their arguments, in call order;
- ``honour_waits()``: completion-word writes wait behind the stream's ``cuStreamWaitValue64``
  until the word waited on reaches its value (a thread plays the device);
- ``fail_queries(code, streams)``: stream (and event) queries return ``code`` (a sticky error);
- ``ForeignArray``: device memory of the fake with a ``__cuda_array_interface__`` (v3, with a
  stream), as a torch tensor or a CuPy array presents itself.
"""
from __future__ import annotations

import ctypes
import enum
import functools
import threading
from collections import deque

from cuda.bindings import driver as cu

LOGGED = ("cuEventRecord", "cuStreamWaitEvent", "cuLaunchKernel", "cuMemcpyAsync")   # (and the waits)
log: list[tuple] = []
_lock = threading.RLock()
_held: set[int] = set()
_query_code = [0]


def _logging(name):
    real = getattr(cu, name)

    def call(*args):
        log.append((name, *[_handle(a) for a in args]))
        return real(*args)

    return call


def _handle(arg):
    try:
        return int(arg)
    except (TypeError, ValueError):
        return arg


for _name in LOGGED:
    setattr(cu, _name, _logging(_name))

_real_write = cu.cuStreamWriteValue64
_real_wait = cu.cuStreamWaitValue64
# Per stream, what waits in it: ("wait", dptr, value) and ("write", dptr, value), in order.
_queues: dict[int, deque] = {}
_honour_waits = [False]


def _word(dptr) -> int:
    return ctypes.c_uint64.from_address(int(dptr)).value


def _write(stream, dptr, value, flags):
    with _lock:
        s = int(stream)
        if s in _held or _queues.get(s):
            _queues.setdefault(s, deque()).append(("write", dptr, value))
            return (cu.CUresult.CUDA_SUCCESS,)
    return _real_write(stream, dptr, value, flags)


def _wait(stream, dptr, value, flags):
    log.append(("cuStreamWaitValue64", int(stream), int(dptr), value))
    with _lock:
        s = int(stream)
        if _honour_waits[0] and (_queues.get(s) or _word(dptr) < value):
            _queues.setdefault(s, deque()).append(("wait", dptr, value))
    return _real_wait(stream, dptr, value, flags)


_real_host_func = cu.cuLaunchHostFunc


def _queued_host_func(stream, run) -> bool:
    """Queue ``run`` (a host function's call) behind what ``stream`` holds back, if it holds
    anything back: True if queued."""
    with _lock:
        s = int(stream)
        if s in _held or _queues.get(s):
            _queues.setdefault(s, deque()).append(("host", run, None))
            return True
    return False


def _host_func(stream, fn, data):
    if _queued_host_func(stream, functools.partial(_real_host_func, stream, fn, data)):
        return (cu.CUresult.CUDA_SUCCESS,)
    return _real_host_func(stream, fn, data)


cu.cuStreamWriteValue64 = _write
cu.cuStreamWaitValue64 = _wait
cu.cuLaunchHostFunc = _host_func


def pump() -> None:
    """Run what waits in each stream not held, as far as its waits allow (the device)."""
    with _lock:
        for s, q in _queues.items():
            if s in _held:
                continue
            _run_queued(s, q, len(q))


def _run_queued(s: int, q: deque, n: int) -> int:
    """Run up to ``n`` of ``q``'s first entries, as far as its waits allow (under ``_lock``)."""
    done = 0
    while q and done < n:
        kind, a, b = q[0]
        if kind == "wait":
            if _word(a) < b:
                break
        elif kind == "host":
            a()
        else:
            _real_write(cu.CUstream(s), a, b, 0)
        q.popleft()
        done += 1
    return done


def step(stream, n: int) -> int:
    """Run the first ``n`` entries (writes, waits, host functions) that ``stream`` holds back,
    and keep holding the rest; how many ran."""
    with _lock:
        q = _queues.get(int(stream))
        return _run_queued(int(stream), q, n) if q else 0


def honour_waits() -> None:
    """From now on a stream's completion-word writes wait behind its ``cuStreamWaitValue64``
    until the word waited on reaches the value (a thread plays the device, every 1 ms)."""
    _honour_waits[0] = True

    def device():
        while True:
            pump()
            threading.Event().wait(0.001)

    threading.Thread(target=device, daemon=True).start()


def hold(stream) -> None:
    """Completion words written on ``stream`` (a CUstream or a Lane's handle) wait from now on."""
    with _lock:
        _held.add(int(stream))


def release(stream) -> None:
    """Run what ``stream`` held back (writes, host functions), in order (as its waits allow),
    and stop holding it."""
    with _lock:
        _held.discard(int(stream))
    pump()


def _query(real, stream: bool):
    def call(handle):
        h = int(handle)
        code = _failing.get(h, _query_code[0]) if stream else _query_code[0]
        if code:
            return (cu.CUresult(code),)
        if stream and (h in _held or _queues.get(h)):     # (its work is still running)
            return (cu.CUresult.CUDA_ERROR_NOT_READY,)
        return real(handle)
    return call


cu.cuStreamQuery = _query(cu.cuStreamQuery, True)
cu.cuEventQuery = _query(cu.cuEventQuery, False)
_failing: dict[int, int] = {}


def fail_queries(code: int, streams=None) -> None:
    """Queries return ``code`` from now on (0: success again): of ``streams`` only (stream
    handles; a sticky error of their device), else of every stream and event."""
    if streams is None:
        _query_code[0] = code
    else:
        for s in streams:
            _failing[int(s)] = code


# The fake knows no device ordinal attribute: memory from its cuMemAlloc is device 0's.
class CUpointer_attribute(enum.IntEnum):
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


cu.CUpointer_attribute = CUpointer_attribute
_device_memory: dict[int, int] = {}
_real_attr = cu.cuPointerGetAttribute


def _pointer_attribute(attr, addr):
    if int(attr) == CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        for start, n in _device_memory.items():
            if start <= int(addr) < start + n:
                return (cu.CUresult.CUDA_SUCCESS, 0)
    return _real_attr(attr, addr)


cu.cuPointerGetAttribute = _pointer_attribute


class ForeignArray:
    """``n`` float32 of fake device memory, exported as another library's CUDA array whose work
    runs on ``stream`` (an int handle)."""

    def __init__(self, n: int, stream: int):
        err, ptr = cu.cuMemAlloc(4 * n)
        self.ptr, self.n, self.stream = int(ptr), n, stream
        _device_memory[self.ptr] = 4 * n

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.n,), "typestr": "<f4", "data": (self.ptr, False), "version": 3,
                "stream": self.stream}

    def values(self) -> list:
        return list((ctypes.c_float * self.n).from_address(self.ptr))


# -- the same controls on the C path: the fake libcuda.so.1 (tests/fakes/libcuda/), where it is
# loaded, forwards its entry points to the driver calls above, so that holds, the log, honoured
# waits and failing queries hold for aiogpu's C hot path (and for ctypes callers) too.
_c_function = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _c_host_func(stream, fn, data):
    """The C path's ``cuLaunchHostFunc``: the C function ``fn(data)`` at once (as the fake
    libcuda.so.1 runs it), or behind what the stream holds back."""
    if not fn:
        return (cu.CUresult.CUDA_ERROR_INVALID_VALUE,)
    run = functools.partial(_c_function(fn), data)
    if not _queued_host_func(stream, run):
        run()
    return (cu.CUresult.CUDA_SUCCESS,)


C_ORDER = ("launch", "memcpy", "write64", "wait64", "wait_event", "record", "query", "host_func")
_c_lib = cu._c_library() if hasattr(cu, "_c_library") else None
_vp, _u, _u64 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint64
_C_PROTOS = {
    "launch": (ctypes.CFUNCTYPE(ctypes.c_int, _vp, _u, _u, _u, _u, _u, _u, _u, _vp, _vp, _vp),
               lambda f, gx, gy, gz, bx, by, bz, shm, s, p, e:
               cu.cuLaunchKernel(f or 0, gx, gy, gz, bx, by, bz, shm, s or 0, p or 0, e or 0)),
    "memcpy": (ctypes.CFUNCTYPE(ctypes.c_int, _u64, _u64, ctypes.c_size_t, _vp),
               lambda d, src, n, s: cu.cuMemcpyAsync(d, src, n, s or 0)),
    "write64": (ctypes.CFUNCTYPE(ctypes.c_int, _vp, _u64, _u64, _u),
                lambda s, w, v, f: cu.cuStreamWriteValue64(s or 0, w, v, f)),
    "wait64": (ctypes.CFUNCTYPE(ctypes.c_int, _vp, _u64, _u64, _u),
               lambda s, w, v, f: cu.cuStreamWaitValue64(s or 0, w, v, f)),
    "wait_event": (ctypes.CFUNCTYPE(ctypes.c_int, _vp, _vp, _u),
                   lambda s, e, f: cu.cuStreamWaitEvent(s or 0, e or 0, f)),
    "record": (ctypes.CFUNCTYPE(ctypes.c_int, _vp, _vp), lambda e, s: cu.cuEventRecord(e or 0, s or 0)),
    "query": (ctypes.CFUNCTYPE(ctypes.c_int, _vp), lambda e: cu.cuEventQuery(e or 0)),
    "host_func": (ctypes.CFUNCTYPE(ctypes.c_int, _vp, _vp, _vp), lambda s, fn, d: _c_host_func(s or 0, fn, d)),
}
_c_forwarders = []        # (the ctypes callbacks must outlive every call into the library)


def _forwarding(call):
    def forward(*args):
        try:
            return int(call(*args)[0])
        except BaseException:         # noqa: BLE001 - nothing may unwind through C
            import traceback
            traceback.print_exc()
            return 999                # CUDA_ERROR_UNKNOWN
    return forward


if _c_lib is not None:
    _c_lib.fakecuda_forward.argtypes = [ctypes.c_int, ctypes.c_void_p]
    _c_lib.fakecuda_calls.argtypes = [ctypes.c_int]
    _c_lib.fakecuda_calls.restype = ctypes.c_ulonglong
    for _name, (_proto, _call) in _C_PROTOS.items():
        _cb = _proto(_forwarding(_call))
        _c_forwarders.append(_cb)
        _c_lib.fakecuda_forward(C_ORDER.index(_name), ctypes.cast(_cb, ctypes.c_void_p))


def c_calls() -> dict[str, int]:
    """How many times each entry point of the fake libcuda.so.1 was called (all 0 where it is
    not loaded): what went through the C path."""
    if _c_lib is None:
        return dict.fromkeys(C_ORDER, 0)
    return {name: int(_c_lib.fakecuda_calls(i)) for i, name in enumerate(C_ORDER)}
