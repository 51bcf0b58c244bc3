"""What a failing kernel body tells the user: the exception it raised (with its message and the
work-items it ran for) as the GPUError's cause; an out-of-bounds access is a memory fault, not a
silently shortened slice; a body that raises SystemExit or KeyboardInterrupt fails its future
like any other error instead of leaving it pending forever."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from aiogpu.futures import cause_chain
from aiogpu.hsa_bindings import types as T
from aiogpu.hsa_bindings.emulator import InjectedFault, KernelError, MemoryFault


@aiogpu.kernel("f32*, u32")
def divide(launch, y, n):
    y[:n] = 1 // (int(n) - int(n))            # a bug in the body: ZeroDivisionError


@aiogpu.kernel("f32*, const f32*, u32")
def total(launch, out, x, n):
    out[0] = x[:n].sum()         # NumPy would silently sum fewer elements when n > len(x)


@aiogpu.kernel("i32*, u32")
def poke(launch, y, i):
    y[i] = 7


@aiogpu.kernel("i32*, i32")
def leave(launch, out, how):
    if how == 1:
        raise SystemExit(3)
    if how == 2:
        raise KeyboardInterrupt
    out[0] = 1


def failure(fut: aiogpu.GPUFuture) -> aiogpu.GPUError:
    assert fut.wait(10), f"{fut!r} is still pending"
    err = fut.exception()
    assert isinstance(err, aiogpu.GPUError), err
    return err


def test_body_exception_is_the_cause_with_its_message_and_work_items(rt):
    d0 = rt.devices[0]
    y = d0.alloc(64 * 4)
    fut = d0.launch(divide, grid=(64,), block=(32,), args=(y, 64))
    err = failure(fut)
    assert err.status == T.HSA_STATUS_ERROR_EXCEPTION and err.queue == fut.queue
    kernel_error = err.__cause__
    assert isinstance(kernel_error, KernelError), err.__cause__
    assert isinstance(kernel_error.__cause__, ZeroDivisionError)
    text = str(kernel_error)
    assert "divide" in text and "ZeroDivisionError: integer division or modulo by zero" in text
    assert "work-items 0..63" in text and "grid (64,)" in text and "block (32,)" in text
    # A later operation that reads what the kernel wrote fails with the same root cause.
    later = aiogpu.copy(np.empty(64, np.float32), y)
    assert any(isinstance(e, ZeroDivisionError) for e in cause_chain(failure(later)))


def test_reading_past_the_end_of_a_buffer_is_a_memory_fault(rt):
    d0 = rt.devices[0]
    x, y = d0.alloc(16 * 4), d0.alloc(16 * 4)
    assert aiogpu.copy(x, np.ones(16, np.float32)).wait(10)
    err = failure(d0.launch(total, grid=(1,), block=(1,), args=(y, x, 17)))
    assert err.status == T.HSA_STATUS_ERROR_MEMORY_FAULT
    fault = err.__cause__
    assert isinstance(fault, MemoryFault), err.__cause__
    assert "total" in fault.reason and "argument 1" in fault.reason and "17" in fault.reason
    assert fault.address == x.address + 16 * 4       # the first byte past the buffer
    assert rt.memory_faults and rt.memory_faults[-1]["address"] == fault.address


def test_an_index_past_the_end_is_a_memory_fault(rt):
    d0 = rt.devices[0]
    y = d0.alloc(8 * 4)
    err = failure(d0.launch(poke, grid=(1,), block=(1,), args=(y, 8)))
    assert err.status == T.HSA_STATUS_ERROR_MEMORY_FAULT
    assert isinstance(err.__cause__, MemoryFault) and err.__cause__.address == y.address + 8 * 4
    assert d0.launch(poke, grid=(1,), block=(1,), args=(y, 7)).wait(10)   # in bounds: fine


@pytest.mark.parametrize("how, raised", [(1, SystemExit), (2, KeyboardInterrupt)])
def test_body_raising_system_exit_or_keyboard_interrupt_fails_its_future(rt, how, raised):
    d0 = rt.devices[0]
    out = d0.alloc(4)
    err = failure(d0.launch(leave, grid=(1,), block=(1,), args=(out, how)))
    assert err.status == T.HSA_STATUS_ERROR_EXCEPTION
    assert any(isinstance(e, raised) for e in cause_chain(err))
    assert not rt.api.emulator.api_errors            # not an emulator bug
    ok = d0.alloc(4)
    assert d0.launch(leave, grid=(1,), block=(1,), args=(ok, 0)).wait(10)   # the device goes on


def test_injected_queue_error_names_the_injected_fault(rt):
    d0 = rt.devices[0]
    out = d0.alloc(4)
    rt.api.emulator.faults.queue_error_at(1, status=T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT)
    fut = d0.launch(leave, grid=(1,), block=(1,), args=(out, 0))
    err = failure(fut)
    injected = err.__cause__
    assert isinstance(injected, InjectedFault), err.__cause__
    assert injected.record.kind == "queue_error" and injected.record.packet == fut.packet


def test_device_views_fault_exactly_outside_their_bounds():
    from aiogpu.hsa_bindings.emulator.dispatch import DeviceArray

    x = np.arange(8, dtype=np.int32).view(DeviceArray)
    base = x.__array_interface__["data"][0]
    for ok in (slice(None, 8), slice(-8, None), slice(None, None, -1), slice(5, 2), slice(8, 8), 7, -8):
        x[ok]                                                 # in bounds: plain NumPy
    x[:8] = x[::-1].copy()
    assert x.tolist() == [7, 6, 5, 4, 3, 2, 1, 0]
    for bad, first in ((slice(None, 9), 8), (slice(-9, None), -1), (8, 8), (-9, -1), (slice(10, 12), 10)):
        with pytest.raises(MemoryFault) as info:
            x[bad]
        assert info.value.address == base + 4 * first, bad
    with pytest.raises(MemoryFault):
        x[[1, 9]] = 0                                         # fancy index: NumPy's IndexError
    grid = x.reshape(2, 4)                                    # derived arrays are checked too
    assert grid[1, 3] == 0
    with pytest.raises(MemoryFault):
        grid[0, :5]
