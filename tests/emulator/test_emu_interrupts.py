"""Ctrl-C and other interrupts inside emulated HSA calls behave as with the real library: the call
completes (SIGINT cannot stop a C call halfway) and the interrupt is raised in the caller once the
call has returned; nothing is swallowed or recorded as an emulator bug. Blocking waits stop early."""
from __future__ import annotations

import _thread
import ctypes
import signal
import threading
import time

import pytest

from aiogpu.hsa_bindings import types as T
from aiogpu.hsa_bindings.emulator import queues as emu_queues

NS = 1_000_000_000


def call(fn, *args):
    """Call an HSA function; the interrupt it hands over is raised when this frame returns."""
    return fn(*args)


def test_sigint_inside_a_call_completes_it_then_reaches_the_caller(hsa, monkeypatch):
    q = hsa.queue(0)
    original = emu_queues.Queue.add_write_index

    def interrupted(self, delta):
        _thread.interrupt_main()          # SIGINT arrives while the emulator is mid-call
        return original(self, delta)

    monkeypatch.setattr(emu_queues.Queue, "add_write_index", interrupted)
    before = q.write_index()
    with pytest.raises(KeyboardInterrupt):
        call(hsa.api.hsa_queue_add_write_index_scacq_screl, q.ptr, 3)
    monkeypatch.undo()
    assert q.write_index() == before + 3          # the call took effect, exactly once
    assert not hsa.emu.api_errors
    assert call(hsa.api.hsa_queue_add_write_index_scacq_screl, q.ptr, 1) == before + 3


def test_system_exit_inside_a_call_reaches_the_caller(hsa, monkeypatch):
    def exits(*args):
        raise SystemExit(5)

    monkeypatch.setattr(hsa.emu, "_create_signal", exits)
    signal = T.hsa_signal_t()
    with pytest.raises(SystemExit) as info:
        call(hsa.api.hsa_signal_create, 1, 0, None, ctypes.byref(signal))
    assert info.value.code == 5
    assert not hsa.emu.api_errors


def test_a_blocking_wait_stops_on_sigint(hsa):
    never = hsa.signal(1)
    # A real SIGINT to the main thread (interrupt_main would not wake a blocked wait).
    timer = threading.Timer(0.1, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        call(hsa.api.hsa_signal_wait_scacquire, never, T.HSA_SIGNAL_CONDITION_EQ, 0, 30 * NS,
             T.HSA_WAIT_STATE_BLOCKED)
    timer.join()
    assert time.monotonic() - t0 < 10, "the wait ignored the interrupt"
    assert not hsa.emu.api_errors
