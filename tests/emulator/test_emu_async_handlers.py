"""hsa_amd_signal_async_handler as ROCr runs it (Runtime::SetAsyncSignalHandler,
Runtime::AsyncEventsLoop): the handler runs on the runtime's events thread with the value that
met its condition; False unregisters it, True keeps it; a destroyed signal's handler is dropped
uncalled; ROCr's argument checks."""
from __future__ import annotations

import ctypes
import threading
import time

import pytest

from aiogpu.hsa_bindings import types as T

from emu_helpers import ok


def _until(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.002)
    return pred()


def _handler(calls: list, keep: bool):
    @T.signal_handler_t
    def handler(value, arg):
        calls.append((value, arg, threading.current_thread().name))
        return keep
    return handler


def test_a_one_shot_handler_runs_once_on_the_events_thread_with_the_value(hsa):
    sig, calls = hsa.signal(1), []
    handler = _handler(calls, keep=False)
    ok(hsa.api.hsa_amd_signal_async_handler(sig, T.HSA_SIGNAL_CONDITION_LT, 1, handler, 42))
    time.sleep(0.05)
    assert calls == [], "called before its condition held"
    hsa.api.hsa_signal_store_screlease(sig, 0)
    assert _until(lambda: calls)
    value, arg, thread = calls[0]
    assert (value, arg) == (0, 42) and "async-events" in thread and thread != threading.current_thread().name
    hsa.api.hsa_signal_store_screlease(sig, 1)
    hsa.api.hsa_signal_store_screlease(sig, -5)
    time.sleep(0.05)
    assert len(calls) == 1, "a handler that returned False ran again"
    assert hsa.emu._state.async_handlers.registered == 0


def test_a_handler_that_returns_true_stays_registered(hsa):
    sig, calls = hsa.signal(0), []
    handler = _handler(calls, keep=True)
    ok(hsa.api.hsa_amd_signal_async_handler(sig, T.HSA_SIGNAL_CONDITION_GTE, 10, handler, None))
    hsa.api.hsa_signal_store_screlease(sig, 10)
    assert _until(lambda: calls)
    hsa.api.hsa_signal_store_screlease(sig, 0)        # condition off ...
    seen = len(calls)
    hsa.api.hsa_signal_store_screlease(sig, 11)       # ... and on again: called again
    assert _until(lambda: len(calls) > seen and calls[-1][0] == 11)
    assert calls[0][1] is None
    hsa.api.hsa_signal_store_screlease(sig, 0)
    ok(hsa.api.hsa_signal_destroy(sig))
    assert _until(lambda: hsa.emu._state.async_handlers.registered == 0)


def test_a_destroyed_signals_handler_is_dropped_uncalled(hsa):
    sig, calls = hsa.signal(1), []
    handler = _handler(calls, keep=False)
    ok(hsa.api.hsa_amd_signal_async_handler(sig, T.HSA_SIGNAL_CONDITION_LT, 1, handler, 7))
    ok(hsa.api.hsa_signal_destroy(sig))
    assert _until(lambda: hsa.emu._state.async_handlers.registered == 0)
    assert calls == []


def test_rocrs_argument_checks(hsa):
    calls: list = []
    handler = _handler(calls, keep=False)
    busy = T.hsa_signal_t()
    ok(hsa.api.hsa_amd_signal_create(1, 0, None, T.HSA_AMD_SIGNAL_AMD_GPU_ONLY, ctypes.byref(busy)))
    assert hsa.api.hsa_amd_signal_async_handler(busy, T.HSA_SIGNAL_CONDITION_LT, 1, handler, None) \
        == T.HSA_STATUS_ERROR_INVALID_SIGNAL, "a signal without an interrupt event"
    sig = hsa.signal(1)
    assert hsa.api.hsa_amd_signal_async_handler(sig, T.HSA_SIGNAL_CONDITION_LT, 1, T.signal_handler_t(), None) \
        == T.HSA_STATUS_ERROR_INVALID_ARGUMENT
    assert hsa.api.hsa_amd_signal_async_handler(T.hsa_signal_t(12345), T.HSA_SIGNAL_CONDITION_LT, 1, handler,
                                                None) == T.HSA_STATUS_ERROR_INVALID_SIGNAL
    assert hsa.api.hsa_amd_signal_async_handler(sig, 99, 1, handler, None) == T.HSA_STATUS_ERROR_INVALID_ARGUMENT
    assert calls == [] and hsa.emu._state.async_handlers.registered == 0


def test_shut_down_stops_the_events_thread_and_drops_what_is_registered(make_hsa):
    h = make_hsa()
    sig, calls = h.signal(1), []
    handler = _handler(calls, keep=False)
    ok(h.api.hsa_amd_signal_async_handler(sig, T.HSA_SIGNAL_CONDITION_LT, 1, handler, None))
    assert any("async-events" in t.name for t in threading.enumerate())
    h.close()
    assert not any("async-events" in t.name and t.is_alive() for t in threading.enumerate())
    assert calls == []


def test_not_initialised_is_refused():
    from aiogpu.hsa_bindings.loader import make_emulator
    api = make_emulator("cold")
    while api.emulator.initialized:
        ok(api.hsa_shut_down())
    calls: list = []
    status = api.hsa_amd_signal_async_handler(T.hsa_signal_t(1), T.HSA_SIGNAL_CONDITION_LT, 1,
                                             _handler(calls, keep=False), None)
    assert status == T.HSA_STATUS_ERROR_NOT_INITIALIZED
