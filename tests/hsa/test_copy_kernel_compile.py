"""The built-in copy kernel is compiled off the event loop, as any launch's kernel.

On the real library the first shader copy compiles the copy kernel with comgr and loads it (half
a second on a small machine). The emulator runs reference bodies (nothing to compile), so these
tests give the device a compile that blocks on an Event the test holds: the copy must return a
pending future at once, the compile run on a worker thread, and the copy run once it finishes.
"""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import aiogpu
from aiogpu.kernels import copy_kernel


class HeldCompile:
    """A device whose copy kernel compiles (in ``_compile``, or in ``_load`` when not compiled
    yet, as comgr does on a cache miss) only once the test releases it."""

    def __init__(self, monkeypatch, dev):
        self.release, self.started = threading.Event(), threading.Event()
        self.compiled: set = set()
        self.threads: list = []
        real_load = dev._load

        def compile_(kernel):
            self.threads.append(threading.current_thread())
            self.started.set()
            self.release.wait(5)
            self.compiled.add(kernel)

        def load(kernel):
            if kernel is copy_kernel and kernel not in self.compiled:
                compile_(kernel)
            return real_load(kernel)

        monkeypatch.setattr(dev, "_needs_compile", lambda k: k is copy_kernel and k not in self.compiled)
        monkeypatch.setattr(dev, "_compile", compile_)
        monkeypatch.setattr(dev, "_load", load)


@pytest.mark.asyncio
@pytest.mark.parametrize("options", [{}, {"copy_engines": False}], ids=["within-one-device", "no-engines"])
async def test_a_shader_copy_whose_kernel_compiles_returns_at_once_and_runs_after(make_runtime, monkeypatch,
                                                                                 options):
    rt = make_runtime(gpus=1, **options)
    dev = rt.devices[0]
    data = np.arange(4096, dtype=np.uint8)
    a, b = dev.alloc(4096), dev.alloc(4096)
    await aiogpu.copy(a, data)                 # (an engine copy, or a shader copy: kernel loaded now)
    dev._kernels.pop(copy_kernel, None)        # as in a fresh process: the copy kernel not loaded
    held = HeldCompile(monkeypatch, dev)
    f = aiogpu.copy(b, a) if not options else aiogpu.copy(b, data)
    try:
        assert not f.done()
        assert held.started.wait(5)
        assert threading.current_thread() not in held.threads    # compiled on a worker
        down = b.to_numpy()                    # ordered after the held copy
        assert not down.done()
    finally:
        held.release.set()
    np.testing.assert_array_equal(await asyncio.wait_for(down, 30), data)
    assert f.done() and f.exception() is None
    assert f.queue.startswith("gpu0.q")        # it ran as the shader copy
    assert held.threads and all(t is not threading.current_thread() for t in held.threads)


@pytest.mark.asyncio
async def test_an_engine_copy_does_not_wait_for_the_copy_kernel(make_runtime, monkeypatch):
    rt = make_runtime(gpus=1)
    dev = rt.devices[0]
    held = HeldCompile(monkeypatch, dev)
    buf = dev.alloc(4096)
    f = aiogpu.copy(buf, np.full(4096, 3, np.uint8))
    np.testing.assert_array_equal(await asyncio.wait_for(buf.to_numpy(), 30), np.full(4096, 3, np.uint8))
    assert dev.engines.runs(f.queue) and not held.started.is_set()


@pytest.mark.asyncio
async def test_a_copy_kernel_that_does_not_compile_fails_the_copy(make_runtime, monkeypatch):
    rt = make_runtime(gpus=1, copy_engines=False)
    dev = rt.devices[0]
    dev._kernels.pop(copy_kernel, None)

    def broken(kernel):
        raise ValueError("comgr: error: no such builtin")

    monkeypatch.setattr(dev, "_needs_compile", lambda k: k is copy_kernel)
    monkeypatch.setattr(dev, "_compile", broken)
    monkeypatch.setattr(dev, "_load", lambda k: broken(k))
    buf = dev.alloc(64)
    f = aiogpu.copy(buf, np.zeros(64, np.uint8))
    with pytest.raises(aiogpu.GPUError, match="did not compile") as info:
        await asyncio.wait_for(f, 30)
    assert isinstance(info.value.__cause__, ValueError)
    assert rt.stats()["pending"] == 0


def test_close_while_a_copy_waits_for_the_copy_kernel_abandons_it(monkeypatch):
    rt = aiogpu.Runtime("emulator", gpus=1, copy_engines=False)
    dev = rt.devices[0]
    dev._kernels.pop(copy_kernel, None)
    held = HeldCompile(monkeypatch, dev)
    buf = dev.alloc(64)
    f = rt.copy(buf, np.zeros(64, np.uint8))
    assert held.started.wait(5)
    try:
        rt.close(timeout=0.2)                  # the compile is still held
        assert f.done()
        assert isinstance(f.exception(), aiogpu.GPUError) and "abandoned" in str(f.exception())
    finally:
        held.release.set()
