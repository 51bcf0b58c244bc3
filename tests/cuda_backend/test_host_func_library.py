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
