"""The fake libcuda.so.1 (tests/fakes/libcuda/): its entry points on their own, and aiogpu's C hot
path running on it beside the fake cuda.bindings (each backend test in a child process with the
library's folder on LD_LIBRARY_PATH): launches, copies, completion words and host functions go
through C, make the calls the cuda-bindings path makes, and obey the fake's controls."""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import textwrap

import pytest

from backends import ROOT, build_libcuda, needs_fake_libcuda, on_fake_cuda, run_on_fake_cuda

ORDER = ("launch", "memcpy", "write64", "wait64", "wait_event", "record", "query", "host_func")
# Every test here builds the fake library (or a scratch one) with the machine's C compiler.
pytestmark = needs_fake_libcuda


@pytest.fixture(scope="module")
def lib_dir() -> str:
    """The fake library's folder, built (and aiogpu's C extension with it) where missing."""
    path = build_libcuda.build()
    if importlib.util.find_spec("aiogpu.cuda._hotc") is None:
        from aiogpu.cuda import build_hotc
        build_hotc.build(verbose=False)
    return path


@pytest.fixture
def lib(lib_dir):
    """The library loaded in this process (by its path; its counters are this process's)."""
    lib = ctypes.CDLL(os.path.join(lib_dir, "libcuda.so.1"))
    lib.fakecuda_calls.restype = ctypes.c_ulonglong
    lib.fakecuda_forward.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    for name in ("cuStreamWriteValue64_v2", "cuStreamWriteValue64", "cuStreamWaitValue64_v2"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def test_the_entry_points_do_what_the_python_fake_does(lib):
    """Copies move bytes, writes land in the word (both names of the write), host functions
    run at once with their data, kernels, events and waits succeed; a null or misaligned word
    and a null host function are refused as the driver refuses them; every call is counted."""
    before = [lib.fakecuda_calls(i) for i in range(len(ORDER))]
    src, dst = ctypes.create_string_buffer(b"abcdefgh" * 4), ctypes.create_string_buffer(32)
    assert lib.cuMemcpyAsync(ctypes.addressof(dst), ctypes.addressof(src), 32, 0x1001) == 0
    assert dst.raw == src.raw[:32]
    word = ctypes.c_uint64(0)
    assert lib.cuStreamWriteValue64_v2(0x1001, ctypes.addressof(word), 7, 0) == 0
    assert word.value == 7
    assert lib.cuStreamWriteValue64(0x1001, ctypes.addressof(word), 9, 0) == 0
    assert word.value == 9
    assert lib.cuStreamWriteValue64_v2(0x1001, 0, 1, 0) == 1
    assert lib.cuStreamWriteValue64_v2(0x1001, ctypes.addressof(word) + 4, 1, 0) == 1
    assert word.value == 9
    assert lib.cuStreamWaitValue64_v2(0x1001, ctypes.addressof(word), 9, 0) == 0
    assert lib.cuStreamWaitValue64_v2(0x1001, 0, 9, 0) == 1
    seen = []
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda data: seen.append(data))
    assert lib.cuLaunchHostFunc(0x1001, ctypes.cast(fn, ctypes.c_void_p), 0x1234) == 0
    assert seen == [0x1234]
    assert lib.cuLaunchHostFunc(0x1001, None, 0x1234) == 1
    assert lib.cuLaunchKernel(0x2000, 1, 1, 1, 1, 1, 1, 0, 0x1001, None, None) == 0
    assert lib.cuEventRecord(0x3000, 0x1001) == 0 and lib.cuEventQuery(0x3000) == 0
    assert lib.cuStreamWaitEvent(0x1001, 0x3000, 0) == 0
    after = [lib.fakecuda_calls(i) for i in range(len(ORDER))]
    assert [a - b for a, b in zip(after, before)] == [1, 1, 4, 2, 1, 1, 1, 2]
    assert lib.fakecuda_calls(len(ORDER)) == 0 and lib.fakecuda_calls(-1) == 0


def test_a_forwarded_entry_point_calls_its_replacement_until_reset(lib):
    """fakecuda_forward(i, fn) routes entry point i to fn with the call's arguments and returns
    fn's result; NULL restores the library's own work; an index out of range is refused."""
    got = []
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)
    fn = proto(lambda s, w, v, f: got.append((s, w, v, f)) or 42)
    word = ctypes.c_uint64(0)
    assert lib.fakecuda_forward(ORDER.index("write64"), ctypes.cast(fn, ctypes.c_void_p)) == 0
    try:
        assert lib.cuStreamWriteValue64_v2(0x1001, ctypes.addressof(word), 5, 0) == 42
        assert got == [(0x1001, ctypes.addressof(word), 5, 0)] and word.value == 0
    finally:
        assert lib.fakecuda_forward(ORDER.index("write64"), None) == 0
    assert lib.cuStreamWriteValue64_v2(0x1001, ctypes.addressof(word), 5, 0) == 0 and word.value == 5
    assert lib.fakecuda_forward(len(ORDER), None) == 1 and lib.fakecuda_forward(-1, None) == 1


def run_c(script: str, lib_dir: str, **env: str) -> dict:
    """``script`` in a child on the fake driver with the fake library found; its last line of
    output, as JSON."""
    proc = run_on_fake_cuda(textwrap.dedent(script), LD_LIBRARY_PATH=lib_dir, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


C_PATH = r"""
import asyncio, ctypes, json
import numpy as np
import aiogpu
import aiogpu.cuda.driver as D
from cuda.bindings import driver as cu
lib = ctypes.CDLL("libcuda.so.1")
lib.fakecuda_calls.restype = ctypes.c_ulonglong
ORDER = ("launch", "memcpy", "write64", "wait64", "wait_event", "record", "query", "host_func")
def refuse(*a):
    raise AssertionError("a cuda-bindings call on the C hot path")
cu.cuLaunchKernel = cu.cuMemcpyAsync = cu.cuStreamWriteValue64 = cu.cuLaunchHostFunc = refuse
rt = aiogpu.Runtime("cuda", spin_s=0.0005)
k = aiogpu.kernel("u32", cuda='extern "C" __global__ void noop(unsigned n) {}', name="noop")(lambda launch, n: None)
d0 = rt.devices[0]
start = [lib.fakecuda_calls(i) for i in range(8)]
async def main():
    buf, other = d0.alloc(1024), d0.alloc(1024)
    for i in range(50):
        f = d0.launch(k, (1,), (1,), (i,))
        await f
        assert f.exception() is None
        aiogpu.copy(buf, np.arange(256, dtype=np.float32) + i)
        aiogpu.copy(other, buf)
        out = await other.to_numpy(np.float32)
        assert (out == np.arange(256) + i).all(), (i, out[:4])
    buf.free(); other.free()
asyncio.run(main())
calls = {n: lib.fakecuda_calls(i) - start[i] for i, n in enumerate(ORDER)}
print(json.dumps({"hot": D.HOT.name, "write_path": rt.write_path, "describe": rt.describe(),
                  "calls": calls, "leaks": len(rt.leaks(5)),
                  "lanes": sum(lane.kind == "compute" for lane in d0.lanes)}))
rt.close()
"""


@on_fake_cuda
def test_the_c_hot_path_runs_on_the_fake_driver(lib_dir):
    """With the library found, aiogpu picks its C hot path on the fake by itself ("hot path:
    c"), and launches, uploads, device copies and downloads go through the library's entry
    points, none through cuda-bindings; bytes arrive; nothing leaks."""
    out = run_c(C_PATH, lib_dir)
    assert out["hot"] == "c" and out["write_path"] == "c", out
    assert "hot path: c " in out["describe"], out["describe"]
    calls = out["calls"]
    assert calls["launch"] == 50, calls
    assert calls["memcpy"] == 150, calls                 # upload, device copy, download each round
    # A completion word each: every copy writes its own; launches awaited one by one write
    # theirs at once once an await of one found it pending (``Lane.eager``), so each compute
    # lane's first may be covered by a later write instead.
    assert calls["write64"] >= calls["launch"] + calls["memcpy"] - out["lanes"], (calls, out["lanes"])
    assert out["leaks"] == 0, out


LOGGED = r"""
import asyncio, json
import fakecuda_controls as fc
import numpy as np
import aiogpu
import aiogpu.cuda.driver as D
rt = aiogpu.Runtime("cuda")
k = aiogpu.kernel("f32*, const f32*, u32", cuda='extern "C" __global__ void k2(float* a, const float* b, unsigned n) {}',
                  name="k2")(lambda launch, a, b, n: None)
d0 = rt.devices[0]
start = len(fc.log)
async def main():
    x, y = d0.alloc(1024), d0.alloc(1024)
    for i in range(5):
        aiogpu.copy(x, np.full(256, i, np.float32))
        d0.launch(k, (1,), (1,), (y, x, 256))
        out = await y.to_numpy(np.float32)
    tensor = fc.ForeignArray(256, stream=0x7777)         # ordered after another library's stream
    await d0.launch(k, (1,), (1,), (tensor, y, 256))
    x.free(); y.free()
asyncio.run(main())
def where(s):                   # which compute lane runs a launch depends on timing: not compared
    return "foreign" if int(s) == 0x7777 else "lane"
# The calls without their memory addresses (which staging buffers a copy uses depends on when
# the waiter thread retired the last one) and lane handles.
SHAPE = {"cuLaunchKernel": lambda f, gx, gy, gz, bx, by, bz, shm, s, p, e: (gx, gy, gz, bx, by, bz, shm, where(s)),
         "cuMemcpyAsync": lambda d, src, n, s: (n, where(s)),
         "cuEventRecord": lambda e, s: (where(s),),
         "cuStreamWaitEvent": lambda s, e, f: (where(s), f),
         "cuStreamWaitValue64": lambda s, w, v: (where(s),)}
calls = fc.log[start:]
log = [[c[0], *SHAPE[c[0]](*c[1:])] for c in calls]
# The launch after the foreign array waits, on its own stream, for the event recorded on the array's.
r = max(i for i, c in enumerate(calls) if c[0] == "cuEventRecord")
w, l = calls[r + 1], calls[r + 2]
ordered = w[0] == "cuStreamWaitEvent" and w[2] == calls[r][1] and l[0] == "cuLaunchKernel" and l[9] == w[1]
print(json.dumps({"hot": D.HOT.name, "log": log, "ordered": ordered, "c": fc.c_calls()}))
rt.close()
"""


@on_fake_cuda
def test_the_c_path_makes_the_calls_the_bindings_path_makes(lib_dir):
    """The same work on the C hot path and on the cuda-bindings one, the fake's controls
    logging both: the same driver calls with the same sizes and dimensions, in the same order,
    the launch after a foreign array waiting for the event recorded on the array's stream; on
    the C path they went through the library."""
    c = run_c(LOGGED, lib_dir)
    b = run_c(LOGGED, lib_dir, AIOGPU_CUDA_HOT="bindings")
    assert c["hot"] == "c" and b["hot"] == "cuda-bindings", (c["hot"], b["hot"])
    assert c["log"] == b["log"]
    assert c["ordered"] and b["ordered"], (c["ordered"], b["ordered"])
    assert {"cuLaunchKernel", "cuMemcpyAsync", "cuEventRecord", "cuStreamWaitEvent"} <= {call[0] for call in c["log"]}
    launches = sum(call[0] == "cuLaunchKernel" for call in c["log"])
    assert c["c"]["launch"] == launches and b["c"]["launch"] == 0, (c["c"], b["c"])


HELD = r"""
import asyncio, json
import fakecuda_controls as fc
import aiogpu
import aiogpu.cuda.driver as D
rt = aiogpu.Runtime("cuda")
k = aiogpu.kernel("u32", cuda='extern "C" __global__ void noop(unsigned n) {}', name="noop")(lambda launch, n: None)
d0 = rt.devices[0]
d0.launch(k, (1,), (1,), (0,)).wait(10)
async def main():
    streams = [lane.stream for lane in d0.lanes]
    for s in streams:                       # (which lane a launch takes depends on timing)
        fc.hold(s)
    f = d0.launch(k, (1,), (1,), (0,))
    await asyncio.sleep(0.05)
    held = f.done()
    for s in streams:
        fc.release(s)
    await asyncio.wait_for(f, 10)
    for s in streams:                       # still running ...
        fc.hold(s)
    fc.fail_queries(700, streams)           # ... and hits a sticky error
    g = d0.launch(k, (1,), (1,), (0,))
    try:
        await asyncio.wait_for(g, 10)
        failed = None
    except aiogpu.GPUError as exc:
        failed = type(exc).__name__
    return held, f.done(), failed
held, done, failed = asyncio.run(main())
print(json.dumps({"hot": D.HOT.name, "held": held, "done": done, "failed": failed, "c": fc.c_calls()}))
"""


@on_fake_cuda
def test_the_fakes_controls_hold_on_the_c_path(lib_dir):
    """``fakecuda_controls.hold`` keeps a launch's completion word from landing on the C path
    as on the cuda-bindings one (the launch stays pending until released; its parked awaiter
    armed the lane with a host function, through the library on the C path), and a sticky
    error from ``fail_queries`` fails the next launch waited on."""
    for env in ({}, {"AIOGPU_CUDA_HOT": "bindings"}):
        out = run_c(HELD, lib_dir, **env)
        assert out["hot"] == ("cuda-bindings" if env else "c"), out
        assert out["held"] is False and out["done"] is True, out
        assert out["failed"] is not None, out
        if not env:
            assert out["c"]["launch"] == 3 and out["c"]["host_func"] >= 1, out


@on_fake_cuda
def test_hostcost_runs_both_trees_of_an_ab_on_the_c_path(lib_dir):
    """``bench/hostcost.py --ab OLD_TREE`` (here this tree twice) measures each tree in a child
    on the fake driver with the fake library, both on the C hot path, says which core each
    ran (a stale build runs interpreted), and prints both tables and their ratio."""
    from aiogpu._core import summary
    core = summary().split(" (")[0].removeprefix("core: ")        # (the children inherit the mode)
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("AIOGPU_CUDA_HOT", "LD_LIBRARY_PATH")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "hostcost.py"), "--ab", str(ROOT), "--rounds", "1",
                           "--n", "20", "--runs", "1", "--shapes", "submit,service"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    rounds = [line for line in lines if line.startswith("[round 1 ")]
    assert len(rounds) == 2 and all("hot path c " in line for line in rounds), proc.stdout
    assert all(line.endswith(f", core {core}") for line in rounds), (core, proc.stdout)
    assert [line.split(":")[0] for line in lines if line.startswith(("old:", "new:"))] == ["old", "new"], proc.stdout
    ratios = lines[lines.index("new/old (best CPU per operation):") + 1:]
    assert [line.split()[0] for line in ratios] == ["submit", "service"], proc.stdout


def test_the_build_says_why_it_cannot_and_keeps_the_library_it_had(tmp_path, monkeypatch):
    """No compiler: RuntimeError saying so. A
    compile that fails: RuntimeError with the compiler's output, the library already there
    untouched and no temporary file left. An up-to-date library is not compiled again."""
    source, lib = tmp_path / "fake.c", tmp_path / "out" / "libcuda.so.1"
    source.write_text("int cuInit(unsigned flags) { return 0; }\n")
    assert build_libcuda.build(str(source), str(lib)) == str(lib.parent)
    good = lib.read_bytes()
    os.utime(lib, (1, 1))                                   # older than its source: rebuilt ...
    source.write_text("this is not C\n")
    with pytest.raises(RuntimeError, match="failed"):
        build_libcuda.build(str(source), str(lib))
    assert lib.read_bytes() == good and sorted(p.name for p in lib.parent.iterdir()) == ["libcuda.so.1"]
    os.utime(lib, None)                                     # ... newer: left alone, no compiler asked
    monkeypatch.setattr(build_libcuda, "compiler", lambda: None)
    assert build_libcuda.build(str(source), str(lib)) == str(lib.parent)
    os.utime(lib, (1, 1))
    with pytest.raises(RuntimeError, match="no C compiler"):
        build_libcuda.build(str(source), str(lib))
    monkeypatch.undo()
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert build_libcuda.compiler() is None


REFUSED_COPIES = r"""
import json
import numpy as np
import aiogpu
import aiogpu.cuda.driver as D
import fakecuda_controls as fc

rt = aiogpu.Runtime("cuda")
d0 = rt.devices[0]
x, y = d0.alloc(1024), d0.alloc(1024)
host = np.arange(256, dtype=np.float32)
assert aiogpu.copy(y, host).wait(10) and y.to_numpy().wait(10)      # (lanes made, pools warm)
# (cuda-bindings' hot path bound the entry point when it was made; the C one calls the fake's)
owner, attr = (D.HOT, "_memcpy") if hasattr(D.HOT, "_memcpy") else (fc.cu, "cuMemcpyAsync")
real = getattr(owner, attr)
out = {"hot": D.HOT.name}
for name, lane, submit in (("upload", d0.h2d, lambda: aiogpu.copy(x, host)),
                           ("download", d0.d2h, lambda: y.to_numpy(np.float32))):
    ticket = lane.ticket
    setattr(owner, attr, lambda *a: (1,))          # CUDA_ERROR_INVALID_VALUE: refused, not sticky
    try:
        fut = submit()
    finally:
        setattr(owner, attr, real)
    exc = fut.exception() if fut.wait(10) else None
    out[name] = {"error": type(exc).__name__, "status": getattr(exc, "status", None),
                 "ticket_kept": lane.ticket == ticket, "broken": d0.broken is not None,
                 "pending": rt.stats()["pending"]}
again = aiogpu.copy(x, host)
back = x.to_numpy(np.float32)
out["after"] = [again.wait(10) and again.exception() is None, back.wait(10) and bool(np.array_equal(back.result(), host))]
x.free()
y.free()
out["leaks"] = rt.leaks(5)
rt.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("hot", ["c", "bindings"])
def test_a_copy_the_driver_refuses_fails_alone_and_releases_what_it_held(lib_dir, hot):
    """cuMemcpyAsync refusing an upload (staged through a pinned block) or a download (into
    a new pinned array; of another buffer: the failed upload leaves its destination failed,
    and a download of it would fail as a dependency): the copy's future fails with the
    driver's status, the lane's ticket
    does not move (nothing was queued), the device stays usable, nothing is left pending or
    held, and the next copies run. On the C hot path and on cuda-bindings."""
    out = run_c(REFUSED_COPIES, lib_dir, AIOGPU_CUDA_HOT=hot)
    assert out["hot"] == ("c" if hot == "c" else "cuda-bindings"), out
    for name in ("upload", "download"):
        assert out[name] == {"error": "CudaError", "status": 1, "ticket_kept": True, "broken": False,
                             "pending": 0}, out
    assert out["after"] == [True, True] and out["leaks"] == {}, out
