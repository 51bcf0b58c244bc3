"""A backend that fills memory itself (``native_fill``: CUDA's cuMemsetD32Async) is handed each
fill through ``_encode_fill``: the future to complete, the lane (that of the pending work the
fill follows), the buffer, the word and the work to wait for; the fill is then a dispatch
ordered like any other write. The emulator's device plays such a backend here, its own fill
encoding the built-in fill kernel through ``_encode_kernel``."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from aiogpu.kernels import fill_kernel


@aiogpu.kernel("u32*")
def mark(launch, x):
    x[0] = 7


@pytest.fixture
def native(rt, monkeypatch):
    dev = rt.devices[0]
    calls = []

    def encode_fill(fut, lane, buf, word, waits, cleanup):
        calls.append((fut, lane, buf, word, list(waits)))
        count = buf.nbytes // 4
        return dev._encode_kernel(fut, lane, dev._loaded_kernel(fill_kernel), dev._fill_grid(count), (256,),
                                  [buf.address, word, count], [buf.nbytes], waits, cleanup)

    monkeypatch.setattr(dev, "native_fill", True, raising=False)
    monkeypatch.setattr(dev, "_encode_fill", encode_fill, raising=False)
    return rt, dev, calls


def test_a_native_fill_gets_the_future_lane_buffer_word_and_waits(native):
    rt, dev, calls = native
    buf = dev.alloc(1024)
    assert dev.load(mark).wait(10)
    with rt.hub.lock:           # (nothing retires meanwhile: the writer is still pending work)
        writer = dev.launch(mark, (1,), (1,), (buf,))
        fill = buf.fill(0x01020304)
    assert calls == [(fill, writer.lane, buf, 0x01020304, [writer])]
    assert fill.wait(10) and fill.exception() is None
    assert fill.device is dev and fill.kind == "dispatch" and fill.label == "fill 1024 B"
    out = np.zeros(256, np.uint32)
    assert aiogpu.copy(out, buf).wait(10)
    assert (out == 0x01020304).all()


def test_a_native_fill_with_nothing_to_follow_runs_on_a_compute_lane(native):
    rt, dev, calls = native
    buf = dev.alloc(64)
    fill = buf.fill(5)
    assert fill.wait(10)
    ((fut, lane, got, word, waits),) = calls
    assert fut is fill and lane in dev.compute and got is buf and word == 5 and waits == []
    out = np.zeros(16, np.uint32)
    assert aiogpu.copy(out, buf).wait(10) and (out == 5).all()
