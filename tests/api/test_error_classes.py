"""The exceptions the README names as causes of a GPUError can be imported from ``aiogpu.errors``
(and ``aiogpu``), and they are the very classes the emulator raises: one hierarchy, so that
``isinstance(err.__cause__, aiogpu.errors.KernelError)`` works in a user's code."""
from __future__ import annotations

import numpy as np

import aiogpu
import aiogpu.errors
from aiogpu.hsa_bindings import types as T


@aiogpu.kernel("f32*, u32")
def divide(launch, y, n):
    y[:n] = 1 // (int(n) - int(n))            # ZeroDivisionError in the body


@aiogpu.kernel("f32*, const f32*, u32")
def total(launch, out, x, n):
    out[0] = x[:n].sum()


@aiogpu.kernel("f32*")
def nothing(launch, y):
    pass


def _failure(fut: aiogpu.GPUFuture) -> aiogpu.GPUError:
    assert fut.wait(10), f"{fut!r} is still pending"
    err = fut.exception()
    assert isinstance(err, aiogpu.GPUError), err
    return err


def test_the_cause_classes_import_from_aiogpu_errors_and_aiogpu():
    from aiogpu.errors import InjectedFault, KernelError, MemoryFault
    for cls in (KernelError, MemoryFault, InjectedFault):
        assert getattr(aiogpu, cls.__name__) is cls
        assert cls.__name__ in aiogpu.__all__
        assert issubclass(cls, aiogpu.errors.DeviceFault)
    assert not issubclass(aiogpu.errors.DeviceFault, aiogpu.GPUError)   # a cause, not the failure


def test_the_emulator_raises_the_same_classes():
    import aiogpu.hsa_bindings.emulator as emulator
    from aiogpu.hsa_bindings.emulator import dispatch, memory
    assert emulator.KernelError is dispatch.KernelError is aiogpu.errors.KernelError
    assert emulator.MemoryFault is memory.MemoryFault is aiogpu.errors.MemoryFault
    assert emulator.InjectedFault is aiogpu.errors.InjectedFault


def test_a_kernel_body_error_is_caused_by_a_kernel_error(rt):
    d0 = rt.devices[0]
    y = d0.alloc(64 * 4)
    err = _failure(d0.launch(divide, grid=(64,), block=(32,), args=(y, 64)))
    assert isinstance(err.__cause__, aiogpu.errors.KernelError), err.__cause__
    assert isinstance(err.__cause__.__cause__, ZeroDivisionError)


def test_an_access_out_of_bounds_is_caused_by_a_memory_fault(rt):
    d0 = rt.devices[0]
    x, y = d0.alloc(16 * 4), d0.alloc(16 * 4)
    assert aiogpu.copy(x, np.ones(16, np.float32)).wait(10)
    err = _failure(d0.launch(total, grid=(1,), block=(1,), args=(y, x, 17)))
    assert isinstance(err.__cause__, aiogpu.errors.MemoryFault), err.__cause__


def test_an_injected_queue_error_is_caused_by_an_injected_fault(rt):
    d0 = rt.devices[0]
    y = d0.alloc(64)
    rt.api.emulator.faults.queue_error_at(1, status=T.HSA_STATUS_ERROR_EXCEPTION, agent=0)
    err = _failure(d0.launch(nothing, grid=(1,), block=(1,), args=(y,)))
    assert isinstance(err.__cause__, aiogpu.errors.InjectedFault), err.__cause__
