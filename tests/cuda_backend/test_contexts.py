"""The CUDA backend keeps each thread's current context right (on the fake driver, in a child
process): a launch sets its device's context on a thread that has not set it, and only then;
a new generation (``driver.forget_current``: a runtime closed) sets it again; a new thread
sets it though it has the identifier of one that ended (threads' identifiers are reused)."""
from __future__ import annotations

import textwrap

from backends import on_fake_cuda, run_on_fake_cuda

pytestmark = on_fake_cuda

# Each script: the driver's cuCtxSetCurrent recorded (the calling thread per call), a no-op
# kernel launched once on the main thread.
RECORDING = r"""
import threading
import aiogpu
import aiogpu.cuda.driver as D

calls = []
real = D.cu.cuCtxSetCurrent
def recording(ctx):
    calls.append(threading.get_ident())
    return real(ctx)
D.cu.cuCtxSetCurrent = recording

@aiogpu.kernel("u32", cuda='extern "C" __global__ void noop(unsigned n) {}')
def noop(launch, n):
    pass

rt = aiogpu.Runtime("cuda")
dev = rt.devices[0]
dev.launch(noop, (1,), (1,), (0,)).wait(10)
"""

SCRIPT = RECORDING + r"""
main = threading.get_ident()
before = len(calls)
for _ in range(5):
    dev.launch(noop, (1,), (1,), (0,))
print("main again", len(calls) - before)

def other():
    dev.launch(noop, (1,), (1,), (0,)).wait(10)
    dev.launch(noop, (1,), (1,), (0,)).wait(10)
before = len(calls)
t = threading.Thread(target=other)
t.start(); t.join()
print("other thread", len(calls) - before, all(c != main for c in calls[before:]))
before = len(calls)
dev.launch(noop, (1,), (1,), (0,)).wait(10)
print("main after other", len(calls) - before)
D.forget_current()
before = len(calls)
dev.launch(noop, (1,), (1,), (0,)).wait(10)
dev.launch(noop, (1,), (1,), (0,)).wait(10)
print("new generation", len(calls) - before, calls[before:] == [main])
rt.close()
"""


def test_a_launch_sets_the_context_once_per_thread_and_generation():
    proc = run_on_fake_cuda(textwrap.dedent(SCRIPT))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "main again 0" in out                 # set already on this thread: no call
    assert "other thread 1 True" in out          # another thread sets it, once
    assert "main after other 0" in out           # the main thread's context is still current
    assert "new generation 1 True" in out        # a new generation sets it again, once


REUSED = RECORDING + r"""
seen, reused, unset = set(), 0, 0
def thread():
    me = threading.get_ident()
    before = len(calls)
    dev.launch(noop, (1,), (1,), (0,)).wait(10)
    dev.launch(noop, (1,), (1,), (0,))          # (its last launch: the thread's own, not awaited)
    global reused, unset
    reused += me in seen
    unset += calls[before:].count(me) != 1
    seen.add(me)
for _ in range(30):
    t = threading.Thread(target=thread)
    t.start(); t.join()
print("reused", reused, "unset", unset)
rt.close()
"""


def test_a_new_thread_with_a_reused_identifier_sets_the_context():
    proc = run_on_fake_cuda(textwrap.dedent(REUSED))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    reused, unset = (int(w) for w in proc.stdout.split()[1::2])
    assert reused > 0, proc.stdout        # (Python reuses an ended thread's identifier)
    assert unset == 0, proc.stdout        # every new thread made the context current once


SWITCHES = r"""
import queue, random, threading
import aiogpu.cuda.driver as D
from aiogpu.cuda import encode

set_on = []
D.set_current = lambda ctx: set_on.append((threading.get_ident(), ctx))

class Dev:                               # what make_current reads of a device
    def __init__(self, handle):
        self.ctx = self.ctx_handle = handle

devices = [Dev(1), Dev(2), Dev(3)]
model = {}                               # the context each worker thread has current
steps = [queue.Queue() for _ in range(3)]
done = queue.Queue()

def worker(q):
    while (dev := q.get()) is not None:
        encode.make_current(dev)
        done.put(threading.get_ident())

threads = [threading.Thread(target=worker, args=(q,)) for q in steps]
for t in threads:
    t.start()
rng = random.Random(7)
wrong = 0
for i in range(3000):
    w, dev = rng.randrange(3), rng.choice(devices)
    if i % 500 == 499:
        encode.forget_current(); model.clear()
    before = len(set_on)
    steps[w].put(dev)
    tid = done.get()
    expected = [] if model.get(tid) is dev else [(tid, dev.ctx)]
    model[tid] = dev
    wrong += set_on[before:] != expected
for q in steps:
    q.put(None)
print("calls", len(set_on), "wrong", wrong)
"""


def test_a_context_is_set_exactly_when_the_thread_has_another_current():
    # Three threads, three devices, in a random order, with new generations: make_current calls
    # the driver exactly when the calling thread's current context is not the device's.
    proc = run_on_fake_cuda(textwrap.dedent(SWITCHES))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    calls, wrong = (int(w) for w in proc.stdout.split()[1::2])
    assert calls > 1000 and wrong == 0, proc.stdout
