"""Ctrl-C during a submission loop: the KeyboardInterrupt reaches the caller and the runtime stays
consistent: every operation it accepted runs and its future settles, nothing stays pending, and
later work runs. (The runtime lock holds SIGINT back while an operation is submitted; emulated HSA
calls complete before the interrupt is raised.)"""
from __future__ import annotations

import _thread
import asyncio
import signal
import threading
import time

import numpy as np
import pytest
import uvloop

import aiogpu
from aiogpu import _interrupts
from aiogpu.hsa_bindings.emulator import queues as emu_queues
from backends import wait_for_baseline


@aiogpu.kernel("i64*")
def bump(launch, counter):
    counter[0] += 1


def submission_loop(rt, counter, futs, seconds=10.0):
    """Launch until interrupted (the caller expects a KeyboardInterrupt)."""
    d0 = rt.devices[0]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        futs.append(d0.launch(bump, grid=(1,), block=(1,), args=(counter,)))


def check_consistent(rt, counter, futs):
    """Every accepted launch ran once, every future settled, nothing is pending; more work runs."""
    stats = wait_for_baseline(rt, timeout=10)
    assert stats["pending"] == 0 and stats["signals_in_use"] == 0 and stats["backlog"] == 0, stats
    assert all(f.wait(10) and f.exception() is None for f in futs)
    out = np.zeros(1, np.int64)
    assert aiogpu.copy(out, counter).wait(10)
    # The launch that was being submitted when the interrupt came either ran (the interrupt was
    # raised after it was submitted, before its future was handed back) or was never submitted.
    assert out[0] in (len(futs), len(futs) + 1), (out[0], len(futs))
    assert rt.devices[0].launch(bump, grid=(1,), block=(1,), args=(counter,)).wait(10)
    assert aiogpu.copy(out, counter).wait(10) and out[0] in (len(futs) + 1, len(futs) + 2)


def interrupt_on_call(monkeypatch, owner, name, nth):
    """Make the ``nth`` call of ``owner.name`` deliver SIGINT right after it did its work."""
    original = getattr(owner, name)
    count = [0]

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        count[0] += 1
        if count[0] == nth:
            _thread.interrupt_main()
        return result

    monkeypatch.setattr(owner, name, wrapper)


@pytest.fixture
def counter_rt(rt):
    counter = rt.devices[0].alloc(8)
    assert aiogpu.copy(counter, np.zeros(1, np.int64)).wait(10)
    return rt, counter


def test_sigint_inside_an_emulated_call_of_a_launch(counter_rt, monkeypatch):
    rt, counter = counter_rt
    # Inside the ring reservation: the emulator used to swallow the interrupt there.
    interrupt_on_call(monkeypatch, emu_queues.Queue, "add_write_index", 20)
    futs = []
    with pytest.raises(KeyboardInterrupt):
        submission_loop(rt, counter, futs)
    monkeypatch.undo()
    assert len(futs) >= 19
    check_consistent(rt, counter, futs)


def test_sigint_inside_the_runtime_while_it_submits(counter_rt, monkeypatch):
    rt, counter = counter_rt
    # Right after a future was registered, before its packet was written: used to orphan it.
    interrupt_on_call(monkeypatch, rt.hub, "watch", 20)
    futs = []
    with pytest.raises(KeyboardInterrupt):
        submission_loop(rt, counter, futs)
    monkeypatch.undo()
    check_consistent(rt, counter, futs)


@pytest.mark.parametrize("delay_ms", [3, 11, 29, 53])
def test_sigint_at_a_random_moment_of_a_submission_loop(counter_rt, delay_ms):
    rt, counter = counter_rt
    futs = []
    timer = threading.Timer(delay_ms / 1000, _thread.interrupt_main)
    with pytest.raises(KeyboardInterrupt):
        timer.start()
        try:
            submission_loop(rt, counter, futs)
        finally:
            timer.join()
    check_consistent(rt, counter, futs)


# -- on an event loop: the handler goes back once per loop iteration, not once per operation ----
class Stop(Exception):
    """What the test's own SIGINT handler raises."""


def recording_handler(calls):
    def handler(signum, frame):
        calls.append(signum)
        raise Stop
    return handler


@pytest.fixture
def own_handler():
    """A Python-level SIGINT handler of the test's own (asyncio.run keeps it: it installs its
    own only over the default one); the original is put back afterwards."""
    calls: list = []
    handler = recording_handler(calls)
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield handler, calls
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_operations_in_one_loop_iteration_swap_the_handler_once(counter_rt, own_handler, monkeypatch, loop):
    rt, counter = counter_rt
    handler, _ = own_handler
    swaps = []
    real = _interrupts._setsignal
    monkeypatch.setattr(_interrupts, "_setsignal", lambda s, h: (swaps.append(h), real(s, h))[1])

    async def main():
        await asyncio.sleep(0)
        first = len(swaps)
        futs = [rt.devices[0].launch(bump, grid=(1,), block=(1,), args=(counter,)) for _ in range(50)]
        during, burst = signal.getsignal(signal.SIGINT), swaps[first:]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        after = signal.getsignal(signal.SIGINT)
        for f in futs:
            await f
        return during, burst, after

    during, burst, after = (uvloop.run if loop == "uvloop" else asyncio.run)(main())
    assert during is not handler          # still held back within the iteration ...
    assert after is handler               # ... and given back once it ended
    assert len(burst) <= 1, burst         # 50 launches in one iteration: one swap (not 100)
    assert signal.getsignal(signal.SIGINT) is handler


def test_sigint_between_operations_on_a_loop_runs_the_handler_at_once(counter_rt, own_handler):
    rt, counter = counter_rt
    handler, calls = own_handler
    seen = []

    futs = []

    async def main():
        futs.append(rt.devices[0].launch(bump, grid=(1,), block=(1,), args=(counter,)))
        try:
            _thread.interrupt_main()          # between operations, in the same iteration
            for _ in range(100):              # (the handler runs at the next bytecodes)
                seen.append(len(calls))
        except Stop:
            seen.append("stopped")
        futs.append(rt.devices[0].launch(bump, grid=(1,), block=(1,), args=(counter,)))
        await futs[-1]

    asyncio.run(main())
    assert calls == [signal.SIGINT] and seen[-1] == "stopped" and len(seen) < 100
    assert signal.getsignal(signal.SIGINT) is handler
    check_consistent(rt, counter, futs)


def test_sigint_inside_a_submission_on_a_loop_arrives_after_it(counter_rt, own_handler, monkeypatch):
    rt, counter = counter_rt
    handler, calls = own_handler
    interrupt_on_call(monkeypatch, rt.hub, "watch", 5)
    futs = []

    async def main():
        with pytest.raises(Stop):
            for _ in range(20):
                futs.append(rt.devices[0].launch(bump, grid=(1,), block=(1,), args=(counter,)))
        for f in futs:
            await f

    asyncio.run(main())
    monkeypatch.undo()
    assert len(futs) == 4 and calls == [signal.SIGINT]       # the 5th was submitted, then raised
    assert signal.getsignal(signal.SIGINT) is handler
    stats = wait_for_baseline(rt, timeout=10)
    assert stats["pending"] == 0 and stats["backlog"] == 0, stats
    out = np.zeros(1, np.int64)
    assert aiogpu.copy(out, counter).wait(10) and out[0] == 5


def test_a_handler_installed_during_an_iteration_is_kept(counter_rt, own_handler):
    rt, counter = counter_rt
    _, calls = own_handler
    mine: list = []

    async def main():
        rt.devices[0].launch(bump, grid=(1,), block=(1,), args=(counter,))
        signal.signal(signal.SIGINT, recording_handler(mine))     # while ours is still in place
        fut = rt.devices[0].launch(bump, grid=(1,), block=(1,), args=(counter,))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        current = signal.getsignal(signal.SIGINT)
        await fut
        return current

    current = asyncio.run(main())
    assert getattr(current, "__code__", None) is recording_handler(mine).__code__
    with pytest.raises(Stop):
        _thread.interrupt_main()
        for _ in range(100):
            pass
    assert mine == [signal.SIGINT] and calls == []


def test_asyncio_run_gets_the_default_handler_back(counter_rt):
    rt, counter = counter_rt
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    async def main():
        return rt.devices[0].launch(bump, grid=(1,), block=(1,), args=(counter,))   # the last step

    fut = asyncio.run(main())
    assert fut.wait(10)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # asyncio.Runner's reset


def test_a_loop_closed_with_its_restore_queued_leaves_no_stale_state(counter_rt):
    rt, counter = counter_rt
    calls: list = []
    previous = signal.signal(signal.SIGINT, recording_handler(calls))
    futs = []
    try:
        loop = asyncio.new_event_loop()

        async def main():
            pass

        task = loop.create_task(main())
        # Work submitted in the iteration in which run_until_complete stops: the restore it
        # queues never runs (the loop is closed first).
        task.add_done_callback(lambda t: futs.append(rt.devices[0].launch(bump, grid=(1,), block=(1,),
                                                                          args=(counter,))))
        loop.run_until_complete(task)
        loop.close()
        with pytest.raises(Stop):            # whatever is installed still runs the test's handler
            _thread.interrupt_main()
            for _ in range(100):
                pass
        assert calls == [signal.SIGINT]
        futs.append(rt.devices[0].launch(bump, grid=(1,), block=(1,), args=(counter,)))   # no loop
        assert getattr(signal.getsignal(signal.SIGINT), "__code__", None) is recording_handler(calls).__code__

        async def again():                   # a later loop queues its own restore
            futs.append(rt.devices[0].launch(bump, grid=(1,), block=(1,), args=(counter,)))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            return signal.getsignal(signal.SIGINT)

        assert getattr(asyncio.run(again()), "__code__", None) is recording_handler(calls).__code__
    finally:
        signal.signal(signal.SIGINT, previous)
    assert all(f.wait(10) for f in futs)


# -- the lock itself ---------------------------------------------------------------------------
def test_a_sigint_held_back_by_the_lock_reaches_the_handler_with_the_frame_of_the_section(own_handler):
    """The handler runs as the ``with`` statement ends, given the frame that holds the section
    (compiled and interpreted alike; a section at the top of a shallow stack too)."""
    handler, calls = own_handler
    frames: list = []

    def recording(signum, frame):
        frames.append(frame)
        raise Stop

    signal.signal(signal.SIGINT, recording)
    lock = _interrupts.InterruptSafeLock()

    def section():
        with lock:
            _thread.interrupt_main()
            for _ in range(100):              # (held back: the handler does not run here)
                pass
            frames.append("inside done")

    with pytest.raises(Stop):
        section()
    assert frames[0] == "inside done" and len(frames) == 2
    assert frames[1] is not None and frames[1].f_code is section.__code__
    assert _interrupts.state() == (0, None, False)
