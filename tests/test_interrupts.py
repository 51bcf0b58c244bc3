"""Ctrl-C during a submission loop: the KeyboardInterrupt reaches the caller and the runtime stays
consistent: every operation it accepted runs and its future settles, nothing stays pending, and
later work runs. (The runtime lock holds SIGINT back while an operation is submitted; emulated HSA
calls complete before the interrupt is raised.)"""
from __future__ import annotations

import _thread
import threading
import time

import numpy as np
import pytest

import aiogpu
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
