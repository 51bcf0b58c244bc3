"""The CUDA backend keeps each thread's current context right (on the fake driver, in a child
process): a launch sets its device's context on a thread that has not set it, and only then;
a new generation (``driver.forget_current``: a runtime closed) sets it again."""
from __future__ import annotations

import textwrap

from backends import on_fake_cuda, run_on_fake_cuda

pytestmark = on_fake_cuda

SCRIPT = r"""
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
