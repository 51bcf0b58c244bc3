"""Done-callbacks that raise: whatever a callback without an event loop raises (BaseException
included) is reported through the ``aiogpu`` logger and never stops the waiter; later futures
still complete. And where such a callback runs: on the waiter thread once the work completes,
inline when the future is done already."""
from __future__ import annotations

import asyncio
import logging
import textwrap
import threading

import pytest

from backends import on_fake_cuda, run_on_fake_cuda
from gpu_kernels import sleep_ms

RAISED = [asyncio.CancelledError, SystemExit, KeyboardInterrupt, GeneratorExit, ValueError]


@pytest.mark.parametrize("kind", RAISED, ids=lambda k: k.__name__)
def test_a_raising_callback_on_the_waiter_is_reported_and_stops_nothing(rt, caplog, kind):
    d0 = rt.devices[0]
    ran: list = []

    def bad(f):
        ran.append(("bad", threading.current_thread() is rt.hub._thread))
        raise kind("from a done-callback")

    with caplog.at_level(logging.ERROR, logger="aiogpu"):
        fut = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(50,))
        fut.add_done_callback(bad)                   # no loop here: the waiter runs it
        fut.add_done_callback(lambda f: ran.append("after"))
        assert fut.wait(10)
        for _ in range(500):
            if len(ran) == 2:
                break
            threading.Event().wait(0.01)
        assert ran == [("bad", True), "after"]
        later = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(20,))
        got = threading.Event()
        later.add_done_callback(lambda f: got.set())
        assert later.wait(10), "a future after the raising callback never completed"
        assert got.wait(10), "a callback after the raising one never ran"
        assert rt.hub._thread.is_alive()
    assert any(r.exc_info and r.exc_info[0] is kind for r in caplog.records), caplog.records


def test_a_callback_added_to_a_done_future_without_a_loop_runs_inline(rt):
    fut = rt.devices[0].launch(sleep_ms, grid=(1,), block=(1,), args=(1,))
    assert fut.wait(10)
    where: list = []
    fut.add_done_callback(lambda f: where.append(threading.current_thread()))
    assert where == [threading.current_thread()]     # before add_done_callback returned


def test_a_raising_callback_on_a_done_future_without_a_loop_raises_in_the_caller(rt):
    fut = rt.devices[0].launch(sleep_ms, grid=(1,), block=(1,), args=(1,))
    assert fut.wait(10)

    def bad(f):
        raise ValueError("inline")

    with pytest.raises(ValueError, match="inline"):
        fut.add_done_callback(bad)


CUDA_SCRIPT = r"""
import asyncio, logging, threading
import numpy as np
import fakecuda_controls as fc
import aiogpu

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)
logging.getLogger("aiogpu").addHandler(Keep())

rt = aiogpu.Runtime("cuda")
d0 = rt.devices[0]
buf = d0.alloc(4096)
data = np.arange(1024, dtype=np.float32)
for kind in (asyncio.CancelledError, SystemExit, KeyboardInterrupt, GeneratorExit):
    ran = []
    def bad(f, kind=kind):
        ran.append(threading.current_thread() is rt.hub._thread)
        raise kind("from a done-callback")
    fc.hold(d0.h2d.stream)                 # the copy is still running when the callback comes
    up = aiogpu.copy(buf, data)
    up.add_done_callback(bad)
    up.add_done_callback(lambda f: ran.append("after"))
    fc.release(d0.h2d.stream)
    for _ in range(500):
        if len(ran) == 2:
            break
        threading.Event().wait(0.01)
    print(kind.__name__, "ran", ran)
    later = aiogpu.copy(buf, data)
    print(kind.__name__, "later", later.wait(10), rt.hub._thread.is_alive())
buf.free()
print("reported", sorted({r.exc_info[0].__name__ for r in records if r.exc_info}))
print("leaks", rt.leaks(5))
rt.close()
"""


@on_fake_cuda
def test_a_raising_callback_on_the_cuda_waiter_is_reported_and_stops_nothing():
    proc = run_on_fake_cuda(textwrap.dedent(CUDA_SCRIPT))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    for kind in ("CancelledError", "SystemExit", "KeyboardInterrupt", "GeneratorExit"):
        assert f"{kind} ran [True, 'after']" in out, out + proc.stderr[-2000:]
        assert f"{kind} later True True" in out, out + proc.stderr[-2000:]
    assert "reported ['CancelledError', 'GeneratorExit', 'KeyboardInterrupt', 'SystemExit']" in out, out
    assert "leaks {}" in out, out


def test_a_keyboard_interrupt_from_a_callback_run_on_the_main_thread_propagates_after_the_rest(rt, caplog):
    """A callback without a loop that the main thread runs (its done() observed the completion
    first, the waiter being busy) and that raises KeyboardInterrupt: the other callbacks run,
    then the interrupt propagates from done() (it may be a real Ctrl-C: never swallowed)."""
    d0 = rt.devices[0]
    busy, go = threading.Event(), threading.Event()
    rt.hub.post_event(lambda: (busy.set(), go.wait(30)))
    assert busy.wait(10)
    ran: list = []
    try:
        fut = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(1,))

        def interrupted(f):
            ran.append("interrupted")
            raise KeyboardInterrupt

        fut.add_done_callback(interrupted)
        fut.add_done_callback(lambda f: ran.append("after"))
        for _ in range(1000):
            if rt.hub.is_complete(fut.signal):
                break
            threading.Event().wait(0.01)
        with caplog.at_level(logging.ERROR, logger="aiogpu"), pytest.raises(KeyboardInterrupt):
            fut.done()
        assert ran == ["interrupted", "after"] and fut.done()
    finally:
        go.set()
    assert d0.launch(sleep_ms, grid=(1,), block=(1,), args=(1,)).wait(10)
