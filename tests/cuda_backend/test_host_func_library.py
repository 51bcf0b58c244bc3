"""A host function (the waiter's wake-up) is launched straight through libcuda.so.1 only where
the cuda.bindings in use are the driver's own: bindings without ``cuGetProcAddress`` (the fake
driver on a machine whose libcuda.so.1 is a real one) go through the bindings, so that a real
driver never gets a fake stream (on the H200 that crashed the test process)."""
from __future__ import annotations

import json

import pytest

from backends import build_libcuda, needs_fake_libcuda, run_on_fake_cuda

SCRIPT = r"""
import ctypes, json
import cuda.bindings.driver as fake
if {hide}:
    del fake.cuGetProcAddress           # as where the loader's libcuda.so.1 is a real driver
import aiogpu.cuda.driver as D
f = D._host_func_without_python()
print(json.dumps({{"ctypes": isinstance(f, ctypes._CFuncPtr), "hot": D.HOT.name}}))
"""


@needs_fake_libcuda
@pytest.mark.parametrize("hide", [True, False])
def test_host_functions_go_through_libcuda_only_for_the_drivers_own_bindings(hide):
    proc = run_on_fake_cuda(SCRIPT.format(hide=hide), LD_LIBRARY_PATH=build_libcuda.build())
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # The fake libcuda.so.1 is the loader's here: it stands in for a real driver when hidden.
    assert got["ctypes"] is (not hide), got
    if hide:
        assert got["hot"] == "cuda-bindings", got


CALLBACK = r"""
import ctypes, json
import aiogpu
import aiogpu.cuda.driver as D
rt = aiogpu.Runtime("cuda")
seen = []
callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda data: seen.append(data))
fn = ctypes.cast(callback, ctypes.c_void_p).value
lane = rt.devices[0].lanes[0]
for key in (1, 7, 0xDEAD0000):
    assert D.HOT.host_func(lane.sh, fn, key) == 0
print(json.dumps({"seen": seen, "hot": D.HOT.name}))
rt.close()
"""


def test_a_host_function_of_any_c_function_runs_with_its_data_on_the_fake_driver():
    """The fake runs ``fn(data)`` as the fake libcuda.so.1 does, whatever ``fn`` is (the GPU
    bench launches a ctypes callback of its own, with a key as its data), not only the
    waiter's sem_post: a key taken for a semaphore crashed ``aiogpu bench`` on the fake."""
    proc = run_on_fake_cuda(CALLBACK)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["seen"] == [1, 7, 0xDEAD0000], got
