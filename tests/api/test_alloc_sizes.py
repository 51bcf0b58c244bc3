"""``Device.alloc``'s front: a size the device cannot hold is an OutOfMemoryError (with
``requested`` and ``free``) raised before the driver is called, whatever its magnitude (past the
device's memory, past a 64-bit address space); sizes that are no byte count are TypeError or
ValueError. The device stays usable afterwards."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from backends import on_fake_cuda, run_on_fake_cuda

HUGE = [2**64, 2**64 + 1, 2**70, 2**63, 2**64 - 1, np.uint64(2**64 - 1), np.int64(2**62)]


def _counting_driver(dev):
    calls = []
    raw = dev.memory._raw_alloc

    def counted(size):
        calls.append(size)
        return raw(size)
    dev.memory._raw_alloc = counted
    return calls


@pytest.mark.parametrize("nbytes", HUGE, ids=lambda n: f"{int(n):#x}")
def test_a_size_past_the_device_memory_is_out_of_memory_before_the_driver(rt, nbytes):
    dev = rt.devices[0]
    calls = _counting_driver(dev)
    with pytest.raises(aiogpu.OutOfMemoryError) as info:
        dev.alloc(nbytes)
    err = info.value
    assert isinstance(err, MemoryError) and isinstance(err, aiogpu.GPUError)
    assert err.requested >= int(nbytes)
    assert err.free is not None and 0 <= err.free < int(nbytes)
    assert dev.name in str(err) and str(int(nbytes)) in str(err) and str(err.requested) in str(err)
    assert calls == []                          # refused in front: the driver never saw it
    assert dev.alloc(4096).nbytes == 4096       # and the device still allocates


def test_one_byte_more_than_the_device_has_is_refused_in_front(rt):
    dev = rt.devices[0]
    total = dev.memory_size
    assert total == 16 << 30                    # the emulator's device pool
    calls = _counting_driver(dev)
    with pytest.raises(aiogpu.OutOfMemoryError) as info:
        dev.alloc(total + 1)
    assert info.value.free <= total and calls == []


def test_what_the_device_has_free_shrinks_with_what_this_runtime_holds(rt):
    dev = rt.devices[0]
    held = dev.alloc(64 << 20)
    with pytest.raises(aiogpu.OutOfMemoryError) as info:
        dev.alloc(2**64)
    assert info.value.free <= dev.memory_size - held.nbytes


@pytest.mark.parametrize("nbytes, error", [
    (0, ValueError), (-1, ValueError), (-(2**64), ValueError), (np.int64(-5), ValueError),
    (True, TypeError), (np.bool_(True), TypeError), (1.0, TypeError), (np.float64(16), TypeError),
    ("16", TypeError), (None, TypeError), (float("inf"), TypeError),
])
def test_sizes_that_are_no_byte_count(rt, nbytes, error):
    dev = rt.devices[0]
    calls = _counting_driver(dev)
    with pytest.raises(error):
        dev.alloc(nbytes)
    assert calls == []


def test_numpy_integer_sizes_are_byte_counts(rt):
    dev = rt.devices[0]
    for n in (np.int32(256), np.uint64(4096), np.int64(3 << 20)):
        buf = dev.alloc(n)
        assert type(buf.nbytes) is int and buf.nbytes == int(n)


@on_fake_cuda
def test_the_cuda_backend_refuses_in_front_too():
    out = run_on_fake_cuda("""
import aiogpu
from cuda.bindings import driver as cu
calls = []
real = cu.cuMemAlloc
cu.cuMemAlloc = lambda size: (calls.append(size), real(size))[1]
rt = aiogpu.Runtime("cuda")
dev = rt.devices[0]
for n in (2**64, 2**70, dev.memory_size + 1):
    try:
        dev.alloc(n)
    except aiogpu.OutOfMemoryError as e:
        assert e.requested >= n and e.free is not None and e.free < n, (e.requested, e.free)
    else:
        raise AssertionError(n)
assert calls == [], calls
assert dev.alloc(4096).nbytes == 4096
rt.close()
print("ok")
""")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
