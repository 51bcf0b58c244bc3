"""Completions reach awaiters without the runtime lock; retirement is handed to its holder.

The waiter thread marks futures done and wakes their awaiters (loops, threads, done-callbacks)
while another thread holds the runtime lock (a submitter); retiring them (freeing buffers,
recycling signals) waits for the lock, and whoever holds it does it (at the latest when it lets
go). Races: submitters, awaiters and a lock hog on several threads, with the eager packet
processor and queue errors; every callback runs exactly once and nothing leaks.
"""
from __future__ import annotations

import asyncio
import re
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import aiogpu
from aiogpu.testing import Injector
from gpu_kernels import fail_if, scale, sleep_ms
from backends import on_fake_cuda, run_on_fake_cuda

ROOT = Path(__file__).resolve().parents[2]


def _loop_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def test_a_completion_is_delivered_while_the_runtime_lock_is_held(rt):
    d0 = rt.devices[0]
    fut = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(100,))
    called = threading.Event()
    fut.add_done_callback(lambda f: called.set())      # no loop here: the waiter thread runs it
    waited: list = []
    loop, thread = _loop_thread()
    with rt.lock:                                       # a submitter holding the lock throughout
        waiter = threading.Thread(target=lambda: waited.append(fut.wait(5)))
        waiter.start()
        awaited = asyncio.run_coroutine_threadsafe(_await(fut), loop)
        assert called.wait(5), "the done-callback waited for the runtime lock"
        assert awaited.result(5) == "done", "the awaiter on another loop waited for the lock"
        waiter.join(5)
        assert waited == [True], "wait() on another thread waited for the runtime lock"
        assert fut.done() and fut.exception() is None
        assert not fut.retired                          # retiring it needs the lock ...
    assert fut.retired                                  # ... and its holder did it on release
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


async def _await(fut):
    await fut
    return "done"


def test_retirement_left_behind_needs_no_further_submission(rt):
    """A completion observed while the lock was held retires even if nobody takes it again."""
    d0 = rt.devices[0]
    buf = d0.alloc(4096)
    fut = aiogpu.copy(buf, np.ones(1024, np.float32))
    called = threading.Event()
    fut.add_done_callback(lambda f: called.set())
    rt.lock.acquire()            # without ``with``: no drain at release, only the waiter's retry
    try:
        assert called.wait(5)
    finally:
        rt.lock.release()
    for _ in range(500):
        if fut.retired:
            break
        threading.Event().wait(0.01)
    assert fut.retired, "the waiter never retired what it left behind"
    buf.free()


def test_a_failure_reaches_its_dependents_once_the_lock_is_free(rt):
    """Failures spread under the lock (to dependents on any device); they settle exactly once."""
    d0, d1 = rt.devices[0], rt.devices[1]
    out, peer = d0.alloc(64), d1.alloc(64)
    bad = d0.launch(fail_if, grid=(1,), block=(1,), args=(out, 1))
    dep = aiogpu.copy(peer, out)                        # ordered after ``bad`` (reads ``out``)
    seen: list = []
    for f in (bad, dep):
        f.add_done_callback(seen.append)
    assert dep.wait(5) and bad.wait(5)
    assert isinstance(bad.exception(), aiogpu.GPUError)
    assert isinstance(dep.exception(), aiogpu.GPUError)
    for _ in range(100):
        if len(seen) == 2:
            break
        threading.Event().wait(0.01)
    assert sorted(map(id, seen)) == sorted(map(id, (bad, dep)))
    out.free()
    peer.free()


@pytest.mark.parametrize("eager", [False, True])
def test_submitters_awaiters_and_a_lock_hog_race(make_runtime, eager):
    rt = make_runtime()
    if eager:
        Injector(rt).eager(True)
    stop = threading.Event()

    def hog():                   # takes the lock now and then: the waiter must delegate
        while not stop.is_set():
            with rt.lock:
                stop.wait(0.002)
            stop.wait(0.0005)

    calls: dict[int, int] = {}
    calls_lock = threading.Lock()

    def count(f):
        with calls_lock:
            calls[id(f)] = calls.get(id(f), 0) + 1

    futures: list = []

    def one_request(d, i, n=256):
        x = d.alloc(n * 4)
        host = np.full(n, i, np.float32)
        f1 = aiogpu.copy(x, host)
        f2 = d.launch(scale, grid=(n,), block=(64,), args=(x, 2.0, n))
        for f in (f1, f2):
            f.add_done_callback(count)
        futures.extend((f1, f2))
        return x, f2

    def submitter(d, base):
        for i in range(30):
            x, f = one_request(d, base + i)
            out = np.empty(256, np.float32)
            g = aiogpu.copy(out, x)
            g.add_done_callback(count)
            futures.append(g)
            assert g.wait(10)
            assert (out == 2.0 * (base + i)).all()
            x.free()

    async def tasks(d, base):
        async def one(i):
            x, f = one_request(d, base + i)
            await f
            got = await x.to_numpy(np.float32)
            assert (got == 2.0 * (base + i)).all()
            x.free()
        await asyncio.gather(*(one(i) for i in range(40)))

    hogger = threading.Thread(target=hog)
    hogger.start()
    try:
        threads = [threading.Thread(target=submitter, args=(rt.devices[k % 2], 1000 * k)) for k in range(3)]
        errors: list = []
        for t in threads:
            t.run = _capturing(t.run, errors)
            t.start()
        asyncio.run(tasks(rt.devices[0], 10_000))
        for t in threads:
            t.join(60)
        assert not errors, errors
    finally:
        stop.set()
        hogger.join(5)
    for f in futures:
        assert f.wait(10) and f.exception() is None
    for _ in range(200):
        if len(calls) == len(futures):
            break
        threading.Event().wait(0.01)
    assert len(calls) == len(futures) and set(calls.values()) == {1}, "a callback ran twice or never"
    assert rt.leaks() == {}


def _capturing(run, errors):
    def wrapped():
        try:
            run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
    return wrapped


def test_queue_errors_under_contention_settle_each_future_once(make_runtime):
    rt = make_runtime()
    inject = Injector(rt)
    d0 = rt.devices[0]
    stop = threading.Event()
    settled: dict[int, int] = {}

    def hog():
        while not stop.is_set():
            with rt.lock:
                stop.wait(0.001)
            stop.wait(0.0005)

    hogger = threading.Thread(target=hog)
    hogger.start()
    futures = []
    try:
        for round_ in range(10):
            out = d0.alloc(64)
            inject.queue_error(at=3)
            batch = [d0.launch(fail_if, grid=(1,), block=(1,), args=(out, 0)) for _ in range(6)]
            for f in batch:
                f.add_done_callback(lambda f: settled.__setitem__(id(f), settled.get(id(f), 0) + 1))
            futures += batch
            for f in batch:
                assert f.wait(10)
            out.free()
    finally:
        stop.set()
        hogger.join(5)
    assert any(f.exception() is not None for f in futures)
    for _ in range(200):
        if len(settled) == len(futures):
            break
        threading.Event().wait(0.01)
    assert len(settled) == len(futures) and set(settled.values()) == {1}
    assert rt.leaks() == {}


CUDA_SCRIPT = r"""
import asyncio, threading
import numpy as np
import aiogpu

rt = aiogpu.Runtime("cuda")
d0 = rt.devices[0]
buf = d0.alloc(4096)
out = np.empty(1024, np.float32)
called = threading.Event()
with rt.lock:                         # submitted, observed and delivered while it is held
    fut = aiogpu.copy(out, buf)       # (the fake driver completes work at submission)
    fut.add_done_callback(lambda f: called.set())
    ok = called.wait(5)
    retired_inside = fut.retired
print("delivered", ok, "retired_inside", retired_inside, "retired_after", fut.retired)
buf.free()
leaks = rt.leaks()
rt.close()
print("leaks", leaks)
"""


@on_fake_cuda
def test_cuda_completion_is_delivered_while_the_runtime_lock_is_held():
    """The CUDA waiter's path, on the fake driver of tests/fakes (in a child process)."""
    proc = run_on_fake_cuda(textwrap.dedent(CUDA_SCRIPT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "delivered True retired_inside False retired_after True" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "leaks {}" in proc.stdout, proc.stdout


def test_the_lock_runs_work_left_for_its_holder_at_its_outermost_section_only():
    from collections import deque

    from aiogpu._interrupts import InterruptSafeLock

    lock, ran = InterruptSafeLock(), []
    backlog: deque = deque()
    lock.backlog = backlog

    def drain():
        while backlog:
            ran.append(backlog.popleft())

    lock.drain = drain
    held, go = threading.Event(), threading.Event()

    def holder():
        with lock:
            with lock:
                held.set()
                go.wait(5)
            assert ran == []              # not at the end of a nested section ...
        ran.append("released")            # ... but before the outermost one lets go

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(5)
    backlog.append("item")
    assert lock.try_run(drain) is False   # held elsewhere: it waits for nobody
    go.set()
    t.join(5)
    assert ran == ["item", "released"]
    backlog.append("next")
    assert lock.try_run(drain) is True and ran[-1] == "next"
    with lock:                            # held here: try_run runs at once, nested
        backlog.append("nested")
        assert lock.try_run(drain) is True and ran[-1] == "nested"


def test_deferred_work_is_delivered_while_the_lock_is_held(make_runtime, monkeypatch):
    """A launch deferred behind its kernel's compile mirrors its submitted work: that needs
    no lock either."""
    from aiogpu.hsa.device import HsaDevice

    compiled = threading.Event()
    monkeypatch.setattr(HsaDevice, "_needs_compile", lambda self, k: k.name.startswith("slow_")
                        and not compiled.is_set())
    monkeypatch.setattr(HsaDevice, "_compile", lambda self, k: compiled.set())

    @aiogpu.kernel("u32", name="slow_sleep")
    def slow_sleep(launch, ms):
        threading.Event().wait(ms / 1000)

    rt = make_runtime()
    fut = rt.devices[0].launch(slow_sleep, (1,), (1,), (150,))
    for _ in range(500):
        if getattr(fut, "real", None) is not None:
            break
        threading.Event().wait(0.01)
    assert fut.real is not None and not fut.done()       # submitted, still running
    called = threading.Event()
    with rt.lock:
        fut.add_done_callback(lambda f: called.set())
        assert called.wait(5), "the deferred future waited for the runtime lock"
        assert fut.done() and fut.exception() is None


def test_failures_across_devices_under_contention(make_runtime):
    """A failing kernel fails the copies and kernels after it on both devices, each once, while
    a thread keeps taking the lock; every buffer goes back."""
    rt = make_runtime()
    d0, d1 = rt.devices
    stop = threading.Event()

    def hog():
        while not stop.is_set():
            with rt.lock:
                stop.wait(0.002)
            stop.wait(0.0002)

    settled: dict[int, int] = {}
    count_lock = threading.Lock()

    def count(f):
        with count_lock:
            settled[id(f)] = settled.get(id(f), 0) + 1

    hogger = threading.Thread(target=hog)
    hogger.start()
    chains = []
    try:
        for i in range(20):
            out, peer = d0.alloc(64), d1.alloc(64)
            bad = d0.launch(fail_if, grid=(1,), block=(1,), args=(out, i % 2))
            copy = aiogpu.copy(peer, out)
            after = d1.launch(fail_if, grid=(1,), block=(1,), args=(peer, 0))
            joined = aiogpu.gather(bad, copy, after)
            chain = (bad, copy, after, joined)
            for f in chain:
                f.add_done_callback(count)
            chains.append((i, chain))
            out.free()
            peer.free()
        for i, chain in chains:
            bad = chain[0]
            assert bad.wait(10)
            # Odd chains fail; an even one only if its kernel was pending on the queue of a failing
            # one (a queue error fails every operation pending there: which queue independent work
            # takes depends on how busy the queues are), and then its error says so.
            mate = not i % 2 and bad.exception() is not None
            assert not mate or re.search(r"queue gpu0\.q\d failed .*before it (completed|was submitted)",
                                         str(bad.exception())), bad.exception()
            for f in chain:
                assert f.wait(10)
                assert (f.exception() is not None) == (bool(i % 2) or mate), (i, f)
    finally:
        stop.set()
        hogger.join(5)
    total = 4 * len(chains)
    for _ in range(300):
        if len(settled) == total:
            break
        threading.Event().wait(0.01)
    assert len(settled) == total and set(settled.values()) == {1}
    assert rt.leaks() == {}


CUDA_STRESS = r"""
import asyncio, threading, time
import numpy as np
import aiogpu

rt = aiogpu.Runtime("cuda")
d0 = rt.devices[0]
stop = threading.Event()
calls, calls_lock, errors = {}, threading.Lock(), []

def count(f):
    with calls_lock:
        calls[id(f)] = calls.get(id(f), 0) + 1

def hog():
    while not stop.is_set():
        with rt.lock:
            stop.wait(0.001)
        stop.wait(0.0002)

futures = []

def worker(k):
    try:
        for i in range(60):
            data = np.full(1024, k * 1000 + i, np.float32)
            buf = d0.alloc(data.nbytes)
            up = aiogpu.copy(buf, data)
            out = np.empty_like(data)            # not pinned: bounced, with a host step
            down = aiogpu.copy(out, buf)
            for f in (up, down):
                f.add_done_callback(count)
            futures.extend((up, down))
            assert down.wait(10) and (out == data).all()
            buf.free()
    except BaseException as exc:
        errors.append(exc)

async def tasks():
    async def one(i):
        buf = d0.alloc(4096)
        await aiogpu.copy(buf, np.full(1024, i, np.float32))
        got = await buf.to_numpy(np.float32)
        assert (got == i).all()
        buf.free()
    await asyncio.gather(*(one(i) for i in range(100)))

h = threading.Thread(target=hog); h.start()
threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
for t in threads: t.start()
asyncio.run(tasks())
for t in threads: t.join(60)
stop.set(); h.join(5)
for _ in range(3000):                  # (up to 30 s: a loaded machine schedules the waiter late;
    if len(calls) == len(futures): break   # a sleep, not stop.wait, which is set by now)
    time.sleep(0.01)
print("errors", errors)
print("once", len(calls) == len(futures) and all(calls.get(id(f)) == 1 for f in futures))
print("counts", len(calls), "of", len(futures), "times", sorted(set(calls.values())))
leaks = rt.leaks()
rt.close()
print("leaks", leaks)
"""


@on_fake_cuda
def test_cuda_submitters_awaiters_and_a_lock_hog_race():
    """The CUDA host paths (host steps of bounced downloads, spins, the waiter) on the fake
    driver, in a child process."""
    proc = run_on_fake_cuda(textwrap.dedent(CUDA_STRESS), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "errors []" in proc.stdout and "once True" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "leaks {}" in proc.stdout, proc.stdout
