"""``Runtime.leaks``, the one leak check: it waits for pending work, not for buffers a program
still holds (those are reported at once), names each held buffer and, with allocation tracking
on, where it was allocated; on the thread of a running event loop it refuses to block
(BlockingCallError, as ``GPUFuture.wait`` does) and ``await rt.leaks_async()`` is the form to use."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import anyio
import pytest

import aiogpu
from aiogpu.runtime import Runtime

GATE = threading.Event()


@aiogpu.kernel("u32")
def gated(launch, n):
    GATE.wait(30)          # the work stays pending until the test opens the gate


def allocate_here(dev, n=4096):
    return dev.alloc(n)


def _count_stats(monkeypatch):
    calls = []
    real = Runtime.stats

    def counted(self):
        calls.append(1)
        return real(self)
    monkeypatch.setattr(Runtime, "stats", counted)
    return calls


def test_a_held_buffer_is_reported_at_once_not_after_the_timeout(rt, monkeypatch):
    buf = rt.devices[0].alloc(4096)
    calls = _count_stats(monkeypatch)
    assert rt.leaks(3.0) == {"buffers": 1}
    assert len(calls) <= 3          # the old code polled for the whole timeout (about 300 calls)
    buf.free()
    assert rt.leaks(3.0) == {}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_leaks_refuses_to_block_a_running_loop(rt, backend):
    async def main():
        with pytest.raises(aiogpu.BlockingCallError, match="leaks_async"):
            rt.leaks(1.0)

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_leaks_async_waits_for_pending_work_without_blocking_the_loop(rt, backend):
    GATE.clear()
    held = allocate_here(rt.devices[0])

    async def main():
        fut = rt.devices[0].launch(gated, grid=(1,), block=(1,), args=(1,))
        ticks = 0
        result = None

        async def ticker():
            nonlocal ticks
            while result is None:
                ticks += 1
                if ticks == 20:
                    GATE.set()          # only a loop that keeps running gets here
                await anyio.sleep(0.001)

        async def check():
            nonlocal result
            result = await rt.leaks_async(20.0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            tg.start_soon(check)
        assert fut.done()
        return result, ticks

    try:
        result, ticks = anyio.run(main, backend=backend)
    finally:
        GATE.set()
    assert ticks >= 20
    assert result == {"buffers": 1}
    assert [h.nbytes for h in result.held] == [4096]
    held.free()


def test_the_report_names_each_held_buffer_and_where_it_was_allocated(rt):
    rt.track_allocations = 8
    dev = rt.devices[1]
    a, b = allocate_here(dev, 4096), allocate_here(dev, 8 << 20)
    views = [a[0:16], b.view("f4")]             # views are no allocations
    found = rt.leaks(2.0)
    assert found == {"buffers": 2}
    assert sorted(h.nbytes for h in found.held) == [4096, 8 << 20]
    for h in found.held:
        assert h.device == "gpu1" and h.address in (a.address, b.address)
        assert h.allocated_at is not None
        assert "allocate_here" in [f.name for f in h.allocated_at]
        assert __file__ in [f.filename for f in h.allocated_at]
    text = found.describe()
    assert repr(a) in text and repr(b) in text
    assert "allocate_here" in text and "return dev.alloc(n)" in text     # the source line
    del views
    a.free(), b.free()
    assert rt.leaks(2.0) == {}


def test_without_tracking_the_report_says_how_to_turn_it_on(rt):
    assert not rt.track_allocations
    buf = rt.devices[0].alloc(64)
    found = rt.leaks(1.0)
    assert [h.allocated_at for h in found.held] == [None]
    assert "AIOGPU_TRACK_ALLOCS" in found.describe()
    buf.free()


def test_the_environment_turns_tracking_on():
    script = ("import aiogpu; rt = aiogpu.Runtime('emulator', gpus=1); "
              "b = rt.devices[0].alloc(64); r = rt.leaks(1.0); "
              "print(rt.track_allocations, r.held[0].allocated_at is not None); b.free(); rt.close()")
    env = {**os.environ, "AIOGPU_TRACK_ALLOCS": "3"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["3", "True"], out.stdout + out.stderr


def test_an_empty_report_is_an_empty_dict(rt):
    found = rt.leaks(1.0)
    assert found == {} and not found and found.held == [] and found.describe() == "nothing leaked"


def test_buffers_false_reports_no_buffers(rt):
    buf = rt.devices[0].alloc(64)
    assert rt.leaks(1.0, buffers=False) == {}
    buf.free()


def test_a_bad_tracking_variable_is_named(monkeypatch):
    monkeypatch.setenv("AIOGPU_TRACK_ALLOCS", "yes")
    with pytest.raises(ValueError, match="AIOGPU_TRACK_ALLOCS"):
        aiogpu.Runtime("emulator", gpus=1)
