"""The CUDA backend's host paths on the fake driver of tests/fakes (each test in a child process, with
``fakecuda_controls`` giving the fake what a GPU does: work still running, foreign arrays, sticky
errors): deferred launches with foreign arrays, the waiter's wake-ups, bounced downloads, sticky
errors across devices, and a failed construction."""
from __future__ import annotations

import textwrap

from backends import on_fake_cuda, run_on_fake_cuda

pytestmark = on_fake_cuda


def run(script: str, timeout: float = 120) -> str:
    proc = run_on_fake_cuda("import fakecuda_controls as fc\n" + textwrap.dedent(script), timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


DEFERRED_FOREIGN = r"""
import gc, threading, weakref
import aiogpu
from aiogpu.cuda.device import CudaDevice

gate = threading.Event()
real_compile = CudaDevice._compile
CudaDevice._compile = lambda self, k: (gate.wait(30), real_compile(self, k))[1]

@aiogpu.kernel("f32*, u32", cuda='extern "C" __global__ void bump(float* y, unsigned n) {}')
def bump(launch, y, n):
    y[:n] += 1

rt = aiogpu.Runtime("cuda")
tensor = fc.ForeignArray(16, stream=0x7777)
ref = weakref.ref(tensor)
fut = rt.devices[0].launch(bump, (16,), (16,), (tensor, 16))
print("deferred", type(fut).__name__, fut.done())
del tensor
gc.collect()
print("kept while compiling", ref() is not None)
start = len(fc.log)
gate.set()
print("done", fut.wait(10), fut.exception())
calls = fc.log[start:]
record = [i for i, c in enumerate(calls) if c[0] == "cuEventRecord" and c[2] == 0x7777]
launch = [i for i, c in enumerate(calls) if c[0] == "cuLaunchKernel"]
waited = [i for i, c in enumerate(calls) if c[0] == "cuStreamWaitEvent"]
print("ordered", bool(record and waited and launch and record[0] < waited[0] < launch[0]))
fut = None
gc.collect()
print("let go once done", ref() is None)
print("leaks", rt.leaks(5))
rt.close()
"""


def test_a_launch_deferred_by_its_compile_keeps_and_orders_after_a_foreign_array():
    """The first launch of a kernel still compiling, with another library's array as an
    argument: the array stays alive while the launch waits, and the launch is ordered after
    the array's stream (an event recorded there, waited for on the launch's stream)."""
    out = run(DEFERRED_FOREIGN)
    assert "deferred Deferred False" in out, out
    assert "kept while compiling True" in out, out
    assert "done True None" in out and "ordered True" in out, out
    assert "let go once done True" in out and "leaks {}" in out, out


UNAWAITED_RETIRES = r"""
import threading
import numpy as np
import aiogpu
from aiogpu.cuda import waiter

waiter.LOST_WAKEUP_GUARD_S = 30.0     # the idle waiter's sleep: only a wake-up ends it early
rt = aiogpu.Runtime("cuda")
d0 = rt.devices[0]
threading.Event().wait(0.3)           # the waiter is asleep, nothing pending
buf = d0.alloc(4096)
fut = aiogpu.copy(buf, np.ones(1024, np.float32))    # nobody awaits it
buf.free()                                           # freed once the copy retires
for _ in range(1000):                # (reading no counter that polls: stats() would scan)
    if fut.retired:
        break
    threading.Event().wait(0.01)
print("retired unawaited", fut.retired, d0.memory.small.used)
rt.close()
"""


def test_unawaited_work_retires_while_the_waiter_sleeps_its_long_guard():
    """Work nobody awaits, submitted while the waiter sleeps its long guard (nothing pending):
    the submission wakes it, so the work retires (its buffer is freed) at the next short scan,
    not when a long sleep ends (30 s here)."""
    out = run(UNAWAITED_RETIRES)
    assert "retired unawaited True 0" in out, out


FAILED_CONSTRUCTION = r"""
import collections, threading
from cuda.bindings import driver as cu
import aiogpu

counts = collections.Counter()
def counting(name, fail_at=None):
    real = getattr(cu, name)
    def call(*args):
        counts[name] += 1
        if fail_at is not None and counts[name] == fail_at[0]:
            return (cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
        return real(*args)
    setattr(cu, name, call)

cu.cuDeviceGetCount = lambda: (cu.CUresult.CUDA_SUCCESS, 2)
fail_at = [0]
for name in ("cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease", "cuStreamDestroy",
             "cuMemHostAlloc", "cuMemFreeHost", "cuEventCreate", "cuEventDestroy"):
    counting(name)
counting("cuStreamCreateWithPriority", fail_at)

import aiogpu.cuda.streams                      # (binds nothing: lanes call cu.* by name)
# Each device makes 12 streams: fail the second device's fifth, then the first device's last.
for at in (12 + 5, 12):
    counts.clear()
    fail_at[0] = at
    threads = threading.active_count()
    try:
        aiogpu.Runtime("cuda")
        print("constructed?!")
    except aiogpu.GPUError as exc:
        print("raised", type(exc).__name__)
    made = counts["cuStreamCreateWithPriority"] - 1          # (the failed one made none)
    print(at, "streams", made == counts["cuStreamDestroy"],
          "contexts", counts["cuDevicePrimaryCtxRetain"] == counts["cuDevicePrimaryCtxRelease"],
          "words", counts["cuMemHostAlloc"] == counts["cuMemFreeHost"],
          "threads", threading.active_count() == threads)
fail_at[0] = 0
rt = aiogpu.Runtime("cuda")
print("then", len(rt.devices))
rt.close()
"""


def test_a_failed_construction_releases_the_devices_it_made():
    """A CUDA runtime whose construction fails (a stream of its second device, then the last
    stream of its first, cannot be created) releases every stream, completion-word page and
    primary context it made, and leaves no waiter thread; the next runtime works."""
    out = run(FAILED_CONSTRUCTION)
    for at in (17, 12):
        assert f"{at} streams True contexts True words True threads True" in out, out
    assert "constructed?!" not in out and "then 2" in out, out


STICKY_ACROSS_DEVICES = r"""
import threading
from cuda.bindings import driver as cu
import aiogpu

cu.cuDeviceGetCount = lambda: (cu.CUresult.CUDA_SUCCESS, 2)
fc.honour_waits()

@aiogpu.kernel("f32*, u32", cuda='extern "C" __global__ void bump(float* y, unsigned n) {}')
def bump(launch, y, n):
    y[:n] += 1

rt = aiogpu.Runtime("cuda")
d0, d1 = rt.devices
for d in (d0, d1):
    assert d.load(bump).wait(10)
for lane in d0.lanes:
    fc.hold(lane.stream)                  # gpu0's work is still running ...
a, b = d0.alloc(64), d1.alloc(64)
k0 = d0.launch(bump, (16,), (16,), (a, 16))
dep = d1.launch(bump, (16,), (16,), (b, 16), after=[k0])     # waits on gpu0's word, on gpu1
fc.fail_queries(700, [lane.stream for lane in d0.lanes])      # ... and hits a sticky error
print("k0", k0.wait(10), type(k0.exception()).__name__)
print("dep", dep.wait(10), type(dep.exception()).__name__)
for _ in range(1000):
    if dep.retired:
        break
    threading.Event().wait(0.01)
print("dep retired", dep.retired)
cs = [d1.alloc(64) for _ in d1.compute]
later = [d1.launch(bump, (16,), (16,), (c, 16)) for c in cs]   # one on each gpu1 stream
print("gpu1 goes on", all(f.wait(10) for f in later), {type(f.exception()).__name__ if f.done() else "pending" for f in later})
for buf in (a, b, *cs):
    buf.free()
print("leaks", rt.leaks(5))
rt.close()
print("closed")
"""


def test_work_on_another_gpu_after_a_sticky_error_settles_and_its_stream_goes_on():
    """gpu0 hits a sticky error while gpu1 has work waiting (on the device) for gpu0's: that
    work fails as a dependent, and gpu0's completion word is completed on the host for the
    failed work, so gpu1's stream goes on: the dependent retires, later work on every gpu1
    stream completes, nothing leaks and close returns."""
    out = run(STICKY_ACROSS_DEVICES)
    assert "k0 True GPUError" in out and "dep True GPUError" in out, out
    assert "dep retired True" in out, out
    assert "gpu1 goes on True {'NoneType'}" in out, out
    assert "leaks {}" in out and "closed" in out, out


BOUNCED_THEN_UPLOADED = r"""
import numpy as np
import aiogpu

rt = aiogpu.Runtime("cuda")
d0 = rt.devices[0]
F = 1024                                   # floats per page
root = np.zeros(24 << 20, np.float32)      # > 64 MiB: a view registers only its own pages
# A pending download into w holds a registration of page 0 ...
w, v = root[0:F // 2], root[F // 2:2 * F]
fc.hold(d0.d2h.stream)                     # (downloads still running)
src_w, src_v = d0.alloc(w.nbytes), d0.alloc(v.nbytes)
assert aiogpu.copy(src_w, np.full(w.size, 5, np.float32)).wait(10)
assert aiogpu.copy(src_v, np.arange(v.size, dtype=np.float32) + 100).wait(10)
down_w = aiogpu.copy(w, src_w)
# ... so the download into v, whose pages 0-1 that registration does not cover, bounces.
bounced = rt.host.bounced
down_v = aiogpu.copy(v, src_v)
print("bounced", rt.host.bounced == bounced + 1, down_v.staging is not None)
# Uploads of host bytes the bounced download writes, before it has landed:
cases = {"inside at an offset": root[F:F + 256], "part of it and more": root[F // 4:3 * F]}
ups = {}
for name, u in cases.items():
    dst = d0.alloc(u.nbytes)
    ups[name] = (aiogpu.copy(dst, u), dst, u)
fc.release(d0.d2h.stream)
assert down_w.wait(10) and down_v.wait(10)
for name, (up, dst, u) in ups.items():
    assert up.wait(10), name
    got = dst.to_numpy(np.float32)
    assert got.wait(10)
    print(name, "matches", bool((got.result() == u).all()))
for buf in (src_w, src_v, *[dst for _, dst, _ in ups.values()]):
    buf.free()
print("leaks", rt.leaks(5))
rt.close()
"""


SHADER_UPLOAD_PATCHED = r"""
import numpy as np
import aiogpu

from aiogpu.kernels import copy_kernel

rt = aiogpu.Runtime("cuda", copy_engines=False)      # copies are shader copies
d0 = rt.devices[0]
assert d0.load(copy_kernel).wait(10)                 # (compiled: no copy waits for it)
F = 1024
root = np.zeros(24 << 20, np.float32)
w, v = root[0:F // 2], root[F // 2:2 * F]
for lane in d0.lanes:
    fc.hold(lane.stream)
src_w, src_v = d0.alloc(w.nbytes), d0.alloc(v.nbytes)
down_w, down_v = aiogpu.copy(w, src_w), aiogpu.copy(v, src_v)
print("bounced", down_v.staging is not None)
u = root[F // 4:3 * F]
dst = d0.alloc(u.nbytes)
start = len(fc.log)
up = aiogpu.copy(dst, u)
calls = [c[0] for c in fc.log[start:]]
patch = [c for c in fc.log[start:] if c[0] == "cuMemcpyAsync" and dst.address <= c[1] < dst.address + dst.nbytes]
print("patched after the shader copy", bool(patch) and calls.index("cuLaunchKernel") < calls.index("cuMemcpyAsync"),
      [(c[1] - dst.address, c[3]) for c in patch])
for lane in d0.lanes:
    fc.release(lane.stream)
print("done", all(f.wait(10) for f in (down_w, down_v, up)))
for buf in (src_w, src_v, dst):
    buf.free()
print("leaks", rt.leaks(5))
rt.close()
"""


def test_an_upload_reads_what_a_pending_bounced_download_writes():
    """A download into part of a host array bounces (its pages are held by a busy
    registration that does not cover it) and is still running; uploads of host bytes it
    writes, submitted before it landed, upload what it wrote: whether the upload lies inside
    the download's bytes at an offset, or covers part of them and more."""
    out = run(BOUNCED_THEN_UPLOADED)
    assert "bounced True True" in out, out
    assert "inside at an offset matches True" in out, out
    assert "part of it and more matches True" in out, out
    assert "leaks {}" in out, out


def test_a_shader_upload_is_patched_with_what_a_pending_bounced_download_writes():
    """The same with shader copies (``copy_engines=False``): the bytes of the pending bounced
    download are copied over the upload's destination after the copy kernel, on its stream
    (the fake runs no kernel, so the calls are checked, not the bytes)."""
    out = run(SHADER_UPLOAD_PATCHED)
    assert "bounced True" in out, out
    # v's bytes [2048, 8192) of the host array, from offset 1024 of u's: 6144 bytes
    assert "patched after the shader copy True [(1024, 6144)]" in out, out
    assert "done True" in out and "leaks {}" in out, out


# -- a busy loop whose waiter falls behind ----------------------------------------------------------
# The waiter thread is stalled outright here (its scan waits for a gate): what a loop busy with
# requests does to it by holding the GIL, taken to the limit.
STALLED_WAITER = r"""
import asyncio, threading
import numpy as np
import aiogpu
from aiogpu._core.submit import REAP_AT, REAP_MAX
from aiogpu.cuda.waiter import CudaHub

@aiogpu.kernel("f32*, const f32*, u32", cuda='extern "C" __global__ void k2(float* y, const float* x, unsigned n) {}')
def k2(launch, y, x, n):
    y[:n] = x[:n]

@aiogpu.kernel("u32", cuda='extern "C" __global__ void noop(unsigned n) {}')
def noop(launch, n):
    pass

rt = aiogpu.Runtime("cuda")
dev = rt.devices[0]
warm = dev.alloc(1024), dev.alloc(1024)
for k, args in ((noop, (0,)), (k2, (*warm, 256))):
    assert dev.launch(k, (256,), (256,), args).wait(10)   # (compiled: the fast paths from here)
for b in warm:
    b.free()
gate = threading.Event()
real_scan = CudaHub.scan
CudaHub.scan = lambda self: (gate.wait(60), real_scan(self))[1]
"""


def test_a_busy_loop_retires_its_requests_work_when_the_waiter_falls_behind():
    """Requests whose awaits find their work done at the first poll, with the waiter unable to
    run: the loop settles and retires what is done itself, in batches, so what is pending stays
    bounded (each request's buffers freed, its pinned block back) rather than growing until
    the waiter gets the GIL."""
    out = run(STALLED_WAITER + r"""
async def requests(n):
    host = np.ones(256, np.float32)
    most = 0
    for _ in range(n):
        x, y = dev.alloc(1024), dev.alloc(1024)
        aiogpu.copy(x, host)
        dev.launch(k2, (256,), (256,), (y, x, 256))
        await y.to_numpy(np.float32)
        x.free()
        y.free()
        most = max(most, rt.hub.pending_count)
    return most

most = asyncio.run(requests(10 * REAP_AT))
print("bounded", most <= REAP_AT + 3, most)
print("retired on the loop", rt.hub.pending_count < REAP_AT)
gate.set()
print("leaks", rt.leaks(5))
rt.close()
""")
    assert "bounded True" in out, out
    assert "retired on the loop True" in out, out
    assert "leaks {}" in out, out


def test_parked_awaiters_are_woken_by_the_loops_submissions_when_the_waiter_falls_behind():
    """Two tasks awaiting launches at once park (neither spins while the other waits); with
    the waiter unable to run, the next submission on the same loop settles what the device
    finished and wakes them, with no thread hand-off. Futures gathered as they are (their
    done-callbacks wait, no task awaits them) are woken once the waiter has fallen
    ``REAP_MAX`` futures behind."""
    out = run(STALLED_WAITER + r"""
async def woken_after(waited):
    for i in range(REAP_MAX + 8):
        if waited.done():
            return i
        await asyncio.sleep(0)
        dev.launch(noop, (1,), (1,), (3,))
    return None

async def main():
    async def awaiting(fut):
        return await fut
    for lane in dev.lanes:
        fc.hold(lane.stream)             # the work still runs while they start awaiting ...
    waited = asyncio.gather(awaiting(dev.launch(noop, (1,), (1,), (1,))),
                            awaiting(dev.launch(noop, (1,), (1,), (2,))))
    for _ in range(3):
        await asyncio.sleep(0)
    print("parked", rt.hub.awaiting == 2 and not waited.done())
    for lane in dev.lanes:
        fc.release(lane.stream)          # ... and is done now: nobody tells the waiter
    n = await woken_after(waited)
    print("awaiters woken", n is not None and n <= 4, n)
    gathered = asyncio.gather(dev.launch(noop, (1,), (1,), (1,)), dev.launch(noop, (1,), (1,), (2,)))
    n = await woken_after(gathered)
    print("callbacks woken", n is not None and n <= REAP_MAX + 4, n)

asyncio.run(main())
gate.set()
print("leaks", rt.leaks(5))
rt.close()
""")
    assert "parked True" in out and "awaiters woken True" in out, out
    assert "callbacks woken True" in out, out
    assert "leaks {}" in out, out
