"""The C hot path (aiogpu.cuda._hotc) against fake driver entry points: Python ctypes callbacks
whose C addresses stand in for libcuda's. No GPU, no cuda-bindings needed.

Skipped where the extension is not built (no C compiler at install time); set
AIOGPU_REQUIRE_HOTC=1 to make that a failure (CI, where gcc exists).
"""
from __future__ import annotations

import ctypes
import os
import threading

import pytest

from backends import on_fake_cuda, run_on_fake_cuda

if os.environ.get("AIOGPU_REQUIRE_HOTC"):
    import aiogpu.cuda._hotc as hotc
else:
    hotc = pytest.importorskip("aiogpu.cuda._hotc", reason="the optional C extension is not built")

c_int, c_uint, vp, u64 = ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint64
PROTOS = {
    "launch": ctypes.CFUNCTYPE(c_int, vp, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, vp, vp, vp),
    "memcpy": ctypes.CFUNCTYPE(c_int, u64, u64, ctypes.c_size_t, vp),
    "write64": ctypes.CFUNCTYPE(c_int, vp, u64, u64, c_uint),
    "wait64": ctypes.CFUNCTYPE(c_int, vp, u64, u64, c_uint),
    "wait_event": ctypes.CFUNCTYPE(c_int, vp, vp, c_uint),
    "record": ctypes.CFUNCTYPE(c_int, vp, vp),
    "query": ctypes.CFUNCTYPE(c_int, vp),
    "host_func": ctypes.CFUNCTYPE(c_int, vp, vp, vp),
}
ORDER = ("launch", "memcpy", "write64", "wait64", "wait_event", "record", "query", "host_func")


class FakeDriver:
    """Entry points that record each call (None pointers as 0) and return ``codes[name]``."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.codes = dict.fromkeys(ORDER, 0)
        self.threads: list[int] = []
        self._keep = {name: PROTOS[name](self._entry(name)) for name in ORDER}
        self.addresses = {name: ctypes.cast(fn, vp).value for name, fn in self._keep.items()}

    def _entry(self, name: str):
        def entry(*args):
            self.calls.append((name, *(0 if a is None else a for a in args)))
            self.threads.append(threading.get_ident())
            return self.codes[name]
        return entry


@pytest.fixture
def fake():
    saved = hotc.entry_points()
    drv = FakeDriver()
    hotc.init(*(drv.addresses[n] for n in ORDER))
    try:
        yield drv
    finally:
        hotc.init(*saved)     # (on a GPU machine: the real driver's, for the tests after this one)


STREAM, FUNC, PARAMS, WORD, EVENT = 0x5000, 0x7000, 0x9000, 0xAB00, 0xE000


def test_launch_passes_every_argument_then_writes_the_word(fake):
    assert hotc.launch(FUNC, 3, 4, 5, 64, 2, 1, 128, STREAM, PARAMS, WORD, 42) == 0
    assert fake.calls == [("launch", FUNC, 3, 4, 5, 64, 2, 1, 128, STREAM, PARAMS, 0),
                          ("write64", STREAM, WORD, 42, 0)]


def test_launch_takes_the_largest_values():
    """Full unsigned ranges arrive unchanged (no sign or width loss)."""
    drv = FakeDriver()
    saved = hotc.entry_points()
    hotc.init(*(drv.addresses[n] for n in ORDER))
    try:
        top = 2**64 - 1
        assert hotc.launch(FUNC, 2**32 - 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS, top - 7, top) == 0
        assert drv.calls[0][2] == 2**32 - 1
        assert drv.calls[1] == ("write64", STREAM, top - 7, top, 0)
    finally:
        hotc.init(*saved)


def test_launch_without_a_word_writes_nothing(fake):
    assert hotc.launch(FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS) == 0
    assert hotc.launch(FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, 0, 0, 9) == 0
    assert [c[0] for c in fake.calls] == ["launch", "launch"]
    assert fake.calls[1][10] == 0       # params 0 arrives as NULL


def test_a_failed_launch_skips_the_write_and_returns_its_error(fake):
    fake.codes["launch"] = 701
    assert hotc.launch(FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS, WORD, 1) == 701
    assert [c[0] for c in fake.calls] == ["launch"]


def test_a_failed_write_returns_its_error(fake):
    fake.codes["write64"] = 999
    assert hotc.launch(FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS, WORD, 1) == 999
    assert [c[0] for c in fake.calls] == ["launch", "write64"]


def test_memcpy_then_write(fake):
    big = 5 << 32        # a size beyond 32 bits
    assert hotc.memcpy(0x10, 0x20, big, STREAM, WORD, 7) == 0
    assert fake.calls == [("memcpy", 0x10, 0x20, big, STREAM), ("write64", STREAM, WORD, 7, 0)]
    fake.calls.clear()
    assert hotc.memcpy(0x10, 0x20, 8, STREAM) == 0
    assert fake.calls == [("memcpy", 0x10, 0x20, 8, STREAM)]


def test_a_failed_memcpy_skips_the_write(fake):
    fake.codes["memcpy"] = 1
    assert hotc.memcpy(0x10, 0x20, 8, STREAM, WORD, 7) == 1
    assert [c[0] for c in fake.calls] == ["memcpy"]
    fake.codes["memcpy"], fake.codes["write64"] = 0, 3
    assert hotc.memcpy(0x10, 0x20, 8, STREAM, WORD, 7) == 3


def test_event_calls_and_host_function(fake):
    assert hotc.wait_event(STREAM, EVENT) == 0
    assert hotc.record(EVENT, STREAM) == 0
    fake.codes["query"] = 600
    assert hotc.query(EVENT) == 600
    assert hotc.host_func(STREAM, 0x1234, 0x5678) == 0
    assert hotc.write64(STREAM, WORD, 11) == 0
    assert hotc.wait64(STREAM, WORD, 12, 0) == 0
    assert fake.calls == [("wait_event", STREAM, EVENT, 0), ("record", EVENT, STREAM), ("query", EVENT),
                          ("host_func", STREAM, 0x1234, 0x5678), ("write64", STREAM, WORD, 11, 0),
                          ("wait64", STREAM, WORD, 12, 0)]


def test_handle_objects_and_index_types_are_accepted(fake):
    """cuda-bindings' handle objects convert through __int__; numpy integers through __index__."""
    np = pytest.importorskip("numpy")

    class Handle:                    # like cuda-bindings' CUstream: __int__, no __index__
        def __init__(self, v: int) -> None:
            self.v = v

        def __int__(self) -> int:
            return self.v

    assert hotc.launch(Handle(FUNC), np.uint32(2), 1, 1, np.int64(32), 1, 1, 0, Handle(STREAM), PARAMS,
                       Handle(WORD), np.uint64(5)) == 0
    assert hotc.record(Handle(EVENT), Handle(STREAM)) == 0
    assert fake.calls == [("launch", FUNC, 2, 1, 1, 32, 1, 1, 0, STREAM, PARAMS, 0),
                          ("write64", STREAM, WORD, 5, 0), ("record", EVENT, STREAM)]


@pytest.mark.parametrize("args, exc", [
    (("f", 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS), TypeError),           # a string handle
    ((FUNC, 1.0, 1, 1, 1, 1, 1, 0, STREAM, PARAMS), TypeError),        # a float dimension
    ((1.5, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS), TypeError),           # a float handle
    ((FUNC, 1, 1, 1, 1, 1, 1, 0, None, PARAMS), TypeError),            # None
    ((FUNC, 2**32, 1, 1, 1, 1, 1, 0, STREAM, PARAMS), OverflowError),  # a dimension beyond 32 bits
    ((FUNC, -1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS), OverflowError),
    ((-FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS), OverflowError),     # a negative handle
    ((FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS, 2**64, 1), OverflowError),
    ((FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS, WORD, -1), OverflowError),
    ((FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM), TypeError),                  # too few
    ((FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS, WORD), TypeError),    # a word without a ticket
    ((FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS, WORD, 1, 2), TypeError),
])
def test_bad_launch_arguments_raise_before_any_call(fake, args, exc):
    with pytest.raises(exc):
        hotc.launch(*args)
    assert fake.calls == []


def test_bad_arguments_of_the_other_calls(fake):
    class BadInt:
        def __int__(self):
            return "no"

    class Raises:
        def __int__(self):
            raise ValueError("boom")

    for call in (lambda: hotc.memcpy(1, 2, -3, STREAM), lambda: hotc.memcpy(1, 2, 3, "s"),
                 lambda: hotc.memcpy(1, 2, 3, STREAM, WORD), lambda: hotc.record(EVENT),
                 lambda: hotc.query(), lambda: hotc.query(b"x"), lambda: hotc.wait_event(STREAM, [1]),
                 lambda: hotc.host_func(STREAM, 0, 1), lambda: hotc.write64(STREAM, WORD, 1.0),
                 lambda: hotc.wait64(STREAM, WORD, 1, 2**33), lambda: hotc.record(BadInt(), STREAM),
                 lambda: hotc.launch(FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS, WORD, {})):
        with pytest.raises((TypeError, OverflowError, ValueError)):
            call()
    with pytest.raises(ValueError, match="boom"):
        hotc.query(Raises())
    with pytest.raises(TypeError):
        hotc.launch(FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS, ticket=1)   # positional only
    assert fake.calls == []


def test_init_checks_its_arguments_and_unset_entry_points_raise():
    saved = hotc.entry_points()
    try:
        with pytest.raises(TypeError):
            hotc.init(*([0] * 7))
        with pytest.raises(TypeError):
            hotc.init(*([0] * 7), "x")
        assert hotc.entry_points() == saved          # a refused init changes nothing
        hotc.init(*([0] * 8))
        assert hotc.entry_points() == (0,) * 8
        for call in (lambda: hotc.launch(FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS),
                     lambda: hotc.memcpy(1, 2, 3, STREAM), lambda: hotc.query(EVENT),
                     lambda: hotc.record(EVENT, STREAM), lambda: hotc.wait_event(STREAM, EVENT),
                     lambda: hotc.host_func(STREAM, 1, 2), lambda: hotc.write64(STREAM, WORD, 1),
                     lambda: hotc.wait64(STREAM, WORD, 1, 0)):
            with pytest.raises(RuntimeError, match="not given to init"):
                call()
        drv = FakeDriver()       # a launch entry point but no write: a launch with a word refuses
        hotc.init(drv.addresses["launch"], 0, 0, 0, 0, 0, 0, 0)
        with pytest.raises(RuntimeError):
            hotc.launch(FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS, WORD, 1)
        assert drv.calls == []
        assert hotc.launch(FUNC, 1, 1, 1, 1, 1, 1, 0, STREAM, PARAMS) == 0
    finally:
        hotc.init(*saved)


@pytest.mark.parametrize("release", [True, False])
def test_the_gil_is_held_in_driver_calls_unless_asked(release):
    """By default a driver call keeps the GIL (microseconds; letting go hands it to the waiter
    thread each time); after ``set_release_gil(True)`` a call that blocks lets other Python
    threads run. Here ``record`` is libc's sem_timedwait on a semaphore that only another
    Python thread posts: it is posted when the GIL is released, it times out when held."""
    libc = ctypes.CDLL(None, use_errno=True)
    sem = ctypes.create_string_buffer(64)
    assert libc.sem_init(sem, 0, 0) == 0

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    ts = Timespec()
    libc.clock_gettime(0, ctypes.byref(ts))            # CLOCK_REALTIME, as sem_timedwait's
    ts.tv_nsec += 300_000_000
    ts.tv_sec, ts.tv_nsec = ts.tv_sec + ts.tv_nsec // 10**9, ts.tv_nsec % 10**9
    saved = hotc.entry_points()
    timedwait = ctypes.cast(libc.sem_timedwait, vp).value
    hotc.init(0, 0, 0, 0, 0, timedwait, 0, 0)
    before = hotc.set_release_gil(release)
    poster = threading.Timer(0.05, lambda: libc.sem_post(sem))
    try:
        poster.start()
        got = hotc.record(ctypes.addressof(sem), ctypes.addressof(ts))
        assert (got == 0) == release, got       # posted meanwhile / timed out (-1)
    finally:
        hotc.set_release_gil(before)
        hotc.init(*saved)
        poster.join(5)                          # (when held: it posts once the call has returned)
        libc.sem_destroy(sem)
    assert before is False                      # the default


# -- the C path inside the CUDA backend, on the fake driver (tests/fakes) ------------------------
FAKE_C_SCRIPT = r"""
import asyncio, ctypes, aiogpu, numpy as np
import aiogpu.cuda.driver as D
from cuda.bindings import driver as cu
assert D.HOT.name == "cuda-bindings", D.HOT_REASON     # never chosen on the fake by itself
import sys; sys.path.insert(0, "tests/cuda_backend")
from test_hotc import PROTOS, ORDER
counts = dict.fromkeys(ORDER, 0)
def entry(name, fn):
    def call(*a):
        counts[name] += 1
        return fn(*a)
    return PROTOS[name](call)
held = []
def write(stream, word, value, flags):
    if stream == 0x7000:          # the foreign stream below: its work lands later, by hand
        held.append((word, value))
    else:
        ctypes.c_uint64.from_address(word).value = value
    return 0
HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
keep = {"launch": entry("launch", lambda *a: 0),
        "memcpy": entry("memcpy", lambda d, s, n, st: ctypes.memmove(d, s, n) and 0),
        "write64": entry("write64", write),
        "wait64": entry("wait64", lambda s, word, v, f: 0 if word else 1),   # a wait on address 0 fails
        "wait_event": entry("wait_event", lambda *a: 0), "record": entry("record", lambda *a: 0),
        "query": entry("query", lambda *a: 0),
        "host_func": entry("host_func", lambda s, fn, d: HOSTFN(fn)(d) or 0)}
D.HOT = D._CHot({k: ctypes.cast(f, ctypes.c_void_p).value for k, f in keep.items()})
def refuse(*a):
    raise AssertionError("a cuda-bindings call on the C hot path")
cu.cuLaunchKernel = cu.cuMemcpyAsync = cu.cuStreamWriteValue64 = refuse
rt = aiogpu.Runtime("cuda", spin_s=0.0005)
assert rt.write_path == "c", rt.write_path
assert "hot path: c" in rt.describe(), rt.describe()
k = aiogpu.kernel("u32", cuda='extern "C" __global__ void noop(unsigned n) {}', name="noop")(lambda launch, n: None)
d0 = rt.devices[0]
# Compiled, each lane calls these entry points itself (Lane.direct); interpreted, through _CHot.
import aiogpu.cuda.encode as E
assert [lane.direct for lane in d0.lanes] == [E.__file__.endswith(".so")] * len(d0.lanes), E.__file__
async def main():
    buf, other = d0.alloc(1024), d0.alloc(1024)
    for i in range(100):
        f = d0.launch(k, (1,), (1,), (i,))
        await f
        assert f.exception() is None
        aiogpu.copy(buf, np.full(256, i, np.float32))
        aiogpu.copy(other, buf)                       # device to device: after the upload
        out = await other.to_numpy(np.float32)
        assert (out == i).all(), (i, out[:4])
    await asyncio.sleep(0.05)                          # a parked awaiter: a host-function wake-up
    f = d0.launch(k, (1,), (1,), (0,))
    await f
    class TorchLikeStream:
        cuda_stream, device_index = 0x7000, 0
    ext = rt.stream_future(TorchLikeStream())          # a word written on the foreign stream ...
    waited = counts["wait64"]
    g = d0.launch(k, (1,), (1,), (0,), after=[ext])    # ... which this launch waits for
    assert counts["wait64"] == waited + 1, counts     # (on its word: a wait on address 0 fails)
    for word, value in held:
        ctypes.c_uint64.from_address(word).value = value
    await ext
    await g
    assert g.exception() is None, g
    buf.free(); other.free()
asyncio.run(main())
assert counts["launch"] == 102 and counts["memcpy"] == 300, counts
assert counts["write64"] == 403, counts    # one per launch and copy, in its fused call, one for the stream
assert rt.leaks(5) == {}, rt.leaks(0)
rt.close()
print("ok", counts)
"""


@on_fake_cuda
def test_the_backend_on_the_c_path_with_fake_entry_points():
    """Launches, uploads, device copies and downloads of the CUDA backend through _CHot (the
    fused launch+write and memcpy+write calls), on the fake driver (tests/fakes), with the fake entry points
    above; no cuda-bindings call on the hot path. Also: the C path is not chosen on the fake."""
    proc = run_on_fake_cuda(FAKE_C_SCRIPT, AIOGPU_CUDA_HOT="c")
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr
