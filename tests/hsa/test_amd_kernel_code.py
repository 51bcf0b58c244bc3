"""The kernels of the demo, the stress command and the every-backend tests carry AMD code
(OpenCL C): each compiles through comgr to a code object whose kernel symbol and argument
layout match the kernel's signature, so they run on an AMD GPU, not only on the emulator."""
from __future__ import annotations

import pytest

from aiogpu.cli import demo, stress
from aiogpu.hsa_bindings import codeobject, comgr
from aiogpu.hsa_bindings.signature import KernargLayout
from aiogpu.hsa.kernels import code_object
from tests import gpu_kernels

ok, why = comgr.available()
needs_comgr = pytest.mark.skipif(not ok or comgr.opencl_header_dir() is None,
                                 reason=f"needs libamd-comgr2, rocm-device-libs and clang's OpenCL headers ({why})")

KERNELS = [demo.saxpy, demo.scale, stress.add_const, stress.add_buf,
           gpu_kernels.saxpy, gpu_kernels.slow_increment, gpu_kernels.sleep_ms, gpu_kernels.fail_if,
           gpu_kernels.scale, gpu_kernels.add_into, gpu_kernels.add_const_n]
# Not on the list: gpu_kernels.wait_gate blocks on a host threading.Event, which device code
# cannot wait for; it has no CUDA code either, and the tests that use it run on the emulator.


def explicit_arguments(blob: bytes, name: str) -> list[dict]:
    doc = codeobject.unpackb(codeobject._metadata_note(blob))
    kernel = next(k for k in doc["amdhsa.kernels"] if k[".name"] == name)
    return [a for a in kernel[".args"] if not str(a[".value_kind"]).startswith("hidden_")]


def test_every_listed_kernel_has_opencl_source():
    missing = [k.name for k in KERNELS if k.opencl is None]
    assert not missing, f"kernels with no AMD code: {missing}"


@needs_comgr
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k.body.__module__.rsplit('.', 1)[-1]}.{k.name}")
@pytest.mark.parametrize("isa", ["gfx90a", "gfx1030"])
def test_kernel_compiles_with_the_signatures_argument_layout(kernel, isa):
    blob = code_object(kernel, "hsa", isa)
    assert f"{kernel.name}.kd".encode() in blob, "the kernel descriptor symbol the loader looks up"
    args = explicit_arguments(blob, kernel.name)
    layout = KernargLayout.of(kernel.args, hidden_lengths=False)
    assert [a[".offset"] for a in args] == list(layout.offsets)
    assert [a[".size"] for a in args] == [a.size for a in kernel.args]
    kinds = ["global_buffer" if a.pointer else "by_value" for a in kernel.args]
    assert [a[".value_kind"] for a in args] == kinds
    meta = codeobject.kernel_metadata(blob, kernel.name)
    assert meta.kernarg_size >= layout.offsets[-1] + kernel.args[-1].size
