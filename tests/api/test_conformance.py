"""Backend conformance: what the core promises holds on every backend (the emulator here; CUDA
where an NVIDIA GPU answers). The public-API behaviour tests live in test_backends.py and run on
the same backends; this file checks the contract itself: classes, options, exception types."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import aiogpu
from aiogpu.runtime import LEAK_KEYS
from gpu_kernels import saxpy


def test_runtime_device_and_graph_exec_are_the_core_classes(any_rt):
    assert isinstance(any_rt, aiogpu.Runtime)
    assert type(any_rt) is not aiogpu.Runtime            # a registered backend subclass
    assert all(isinstance(d, aiogpu.Device) for d in any_rt.devices)
    d0 = any_rt.devices[0]
    buf = d0.alloc(64)
    with aiogpu.Graph() as g:
        d0.launch(saxpy, (16,), (16,), (buf, buf, 1.0, 16))
    exe = g.instantiate()
    assert isinstance(exe, aiogpu.GraphExec)
    exe.launch().wait(20)


def test_unknown_options_raise_type_error(any_backend):
    with pytest.raises(TypeError, match="no_such_option"):
        aiogpu.Runtime(any_backend, no_such_option=1)


def test_the_shared_options_have_one_name_on_every_backend(make_any):
    rt = make_any(copy_engines=False)           # copies become shader copies
    assert rt.copy_engines is False
    rt2 = make_any(queues_per_device=1)
    assert len(rt2.devices[0].compute) == 1


@pytest.mark.parametrize("option,value,exc", [
    ("queues_per_device", 0, ValueError), ("queues_per_device", "2", (TypeError, ValueError)),
])
def test_bad_option_values_raise_before_anything_starts(any_backend, option, value, exc):
    import threading
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(exc):
        aiogpu.Runtime(any_backend, **{option: value})
    after = {t.ident for t in threading.enumerate() if t.is_alive()}
    assert after <= before, "a failed construction left a thread running"


def test_emulator_only_options_are_refused_by_other_backends():
    from backends import CUDA_OK
    if CUDA_OK:
        with pytest.raises(TypeError, match="gpus"):
            aiogpu.Runtime("cuda", gpus=2)
    from aiogpu.hsa.runtime import HsaRuntime
    with pytest.raises(TypeError, match="emulator-only"):
        HsaRuntime.check_options("hsa", {"gpus": 2})


def test_exception_hierarchy():
    assert issubclass(aiogpu.HsaError, aiogpu.GPUError)
    assert issubclass(aiogpu.CudaError, aiogpu.GPUError)
    assert issubclass(aiogpu.WatchdogTimeout, aiogpu.GPUError)
    assert issubclass(aiogpu.OutOfMemoryError, aiogpu.GPUError)
    assert issubclass(aiogpu.OutOfMemoryError, MemoryError)
    for name in ("GPUError", "HsaError", "CudaError", "OutOfMemoryError", "WatchdogTimeout",
                 "RuntimeClosedError", "BackendUnavailable", "InvalidStateError", "NotOnCudaError"):
        assert name in aiogpu.__all__


def test_out_of_memory_says_what_was_asked_and_what_is_free(any_rt):
    d0 = any_rt.devices[0]
    with pytest.raises(aiogpu.OutOfMemoryError) as info:
        d0.alloc(1 << 50)                      # a petabyte
    err = info.value
    assert err.requested >= 1 << 50
    assert err.free is None or err.free < 1 << 50
    assert str(err.requested) in str(err)
    buf = d0.alloc(1024)                       # the device still works
    assert buf.nbytes == 1024


def test_forcing_an_unavailable_backend_raises_backend_unavailable():
    from backends import CUDA_OK
    from aiogpu.runtime import backend_class
    if not backend_class("hsa").probe()[0]:
        with pytest.raises(aiogpu.BackendUnavailable) as info:
            aiogpu.Runtime("hsa")
        assert "libhsa-runtime64-1" in str(info.value) and info.value.backend == "hsa"
    if not CUDA_OK:
        with pytest.raises(aiogpu.BackendUnavailable) as info:
            aiogpu.Runtime("cuda")
        assert "aiogpu[cuda]" in str(info.value) and info.value.backend == "cuda"


def test_unknown_backend_names_the_source(monkeypatch):
    with pytest.raises(ValueError, match="backend argument"):
        aiogpu.Runtime("rocm")
    monkeypatch.setenv("AIOGPU_BACKEND", "opencl")
    with pytest.raises(ValueError, match="AIOGPU_BACKEND"):
        aiogpu.Runtime()


def test_emulator_gpu_count_variable_is_named_when_wrong(monkeypatch):
    monkeypatch.setenv("AIOGPU_EMULATOR_GPUS", "two")
    with pytest.raises(ValueError, match="AIOGPU_EMULATOR_GPUS"):
        aiogpu.Runtime("emulator")


def test_closed_runtime_refuses_work(make_any):
    rt = make_any()
    d0 = rt.devices[0]
    buf = d0.alloc(64)
    rt.close()
    for call in (lambda: d0.alloc(64), lambda: d0.launch(saxpy, (16,), (16,), (buf, buf, 1.0, 16)),
                 lambda: aiogpu.copy(buf, np.zeros(64, np.uint8))):
        with pytest.raises(aiogpu.RuntimeClosedError):
            call()


def test_leak_check_sees_held_buffers_and_pending_work(any_rt):
    buf = any_rt.devices[0].alloc(4096)
    assert any_rt.leaks(0.5, buffers=True) == {"buffers": 1}
    buf.free()
    assert any_rt.leaks(buffers=True) == {}
    assert set(LEAK_KEYS) <= set(any_rt.stats())


def test_describe_names_backend_and_devices(any_rt):
    text = any_rt.describe()
    assert f"backend: {any_rt.backend}" in text
    assert any_rt.reason in text


def test_graph_node_outside_its_capture_is_refused(any_rt):
    d0 = any_rt.devices[0]
    buf = d0.alloc(64)
    with aiogpu.Graph() as g:
        node = d0.launch(saxpy, (16,), (16,), (buf, buf, 1.0, 16))
    pending = any_rt.stats()["pending"]
    with pytest.raises(ValueError, match="captured graph"):
        d0.launch(saxpy, (16,), (16,), (buf, buf, 1.0, 16), after=[node])
    with pytest.raises(ValueError, match="captured graph"):
        aiogpu.gather(node)
    assert len(g.nodes) == 1 and any_rt.stats()["pending"] == pending
    with pytest.raises(TypeError, match="a graph node is not work"):
        node.wait(0.1)


def test_kernel_arity_is_checked_at_declaration():
    with pytest.raises(TypeError, match="3 parameters"):
        @aiogpu.kernel("f32*, u32")
        def wrong(launch, y):                 # noqa: ARG001 - one parameter short
            pass

    @aiogpu.kernel("f32*, u32")
    def right(launch, y, n):                  # noqa: ARG001
        pass


def test_scalars_that_cannot_be_represented_are_refused(any_rt):
    d0 = any_rt.devices[0]
    x = d0.alloc(64)
    with pytest.raises(TypeError, match="real number"):
        d0.launch(saxpy, (16,), (16,), (x, x, 1 + 2j, 16))
    with pytest.raises(ValueError, match="out of range"):
        d0.launch(saxpy, (16,), (16,), (x, x, 1e300, 16))


def test_buffer_of_another_runtime_is_named(make_any):
    a, b = make_any(), make_any()
    x = b.devices[0].alloc(64)
    with pytest.raises(ValueError, match="another runtime"):
        a.devices[0].launch(saxpy, (16,), (16,), (x, x, 1.0, 16))
    with pytest.raises(ValueError, match="another runtime"):
        aiogpu.copy(a.devices[0].alloc(64), x)


# -- the package as users meet it ---------------------------------------------------------------
def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_importing_aiogpu_starts_no_process_and_loads_no_backend():
    code = ("import subprocess, sys\n"
            "calls = []\n"
            "real = subprocess.Popen.__init__\n"
            "def spy(self, *a, **k):\n"
            "    calls.append(a)\n"
            "    return real(self, *a, **k)\n"
            "subprocess.Popen.__init__ = spy\n"
            "import aiogpu\n"
            "assert calls == [], calls\n"
            "loaded = [m for m in sys.modules if m.startswith(('aiogpu.hsa', 'aiogpu.cuda', 'cuda'))]\n"
            "assert loaded == [], loaded\n")
    got = _run("-c", code)
    assert got.returncode == 0, got.stderr


def test_version_and_console_name():
    got = _run("-m", "aiogpu", "--version")
    assert got.returncode == 0 and got.stdout.strip() == f"aiogpu {aiogpu.__version__}"
    got = _run("-m", "aiogpu", "--help")
    assert got.stdout.startswith("usage: aiogpu ")


@pytest.mark.parametrize("args", [["info", "--backend", "foo"], ["demo", "--backend", "foo"]])
def test_cli_usage_errors_are_one_line_and_exit_2(args):
    got = _run("-m", "aiogpu", *args)
    assert got.returncode == 2
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "foo" in lines[0] and "Traceback" not in got.stderr


@pytest.mark.skipif(__import__("backends").CUDA_OK, reason="needs a machine without CUDA")
def test_cli_unavailable_backend_is_one_line_and_exit_2():
    got = _run("-m", "aiogpu", "info", "--backend", "cuda")
    assert got.returncode == 2
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "aiogpu[cuda]" in lines[0]


def test_info_describes_the_emulator():
    got = _run("-m", "aiogpu", "info", "--backend", "emulator")
    assert got.returncode == 0, got.stderr
    assert "backend: emulator" in got.stdout and "copies: hsa_amd_memory_async_copy (" in got.stdout


def test_package_is_typed():
    import importlib.resources
    assert importlib.resources.files("aiogpu").joinpath("py.typed").is_file()
