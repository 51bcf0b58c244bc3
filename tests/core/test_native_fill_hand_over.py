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


@pytest.fixture
def refusing(rt, monkeypatch):
    """The emulator's device as a backend whose own fill raises ``box[0]``."""
    dev = rt.devices[0]
    box = []

    def encode_fill(fut, lane, buf, word, waits, cleanup):
        raise box[0]

    monkeypatch.setattr(dev, "native_fill", True, raising=False)
    monkeypatch.setattr(dev, "_encode_fill", encode_fill, raising=False)
    return rt, dev, box


def test_a_native_fill_the_driver_refuses_is_a_failed_future_with_its_error(refusing):
    rt, dev, box = refusing
    buf = dev.alloc(64)
    box.append(aiogpu.GPUError("the driver refused the fill"))
    fill = buf.fill(1)
    assert fill.done() and fill.exception() is box[0]
    assert rt.stats()["pending"] == 0


def test_a_native_fill_whose_encode_raises_raises_it_and_leaves_nothing_pending(refusing):
    rt, dev, box = refusing
    buf = dev.alloc(64)
    box.append(RuntimeError("not an encode error"))
    with pytest.raises(RuntimeError, match="not an encode error"):
        buf.fill(1)
    assert rt.stats()["pending"] == 0


@aiogpu.kernel("u32*, u32")
def fail_on_purpose(launch, x, code):
    if code:
        raise RuntimeError("kernel failed on purpose")


def test_a_native_fill_after_work_that_fails_fails_with_it(native):
    rt, dev, calls = native
    buf, other = dev.alloc(64), dev.alloc(64)
    assert dev.load(fail_on_purpose).wait(10)
    with rt.hub.lock:           # (the failure is handled once the lock is free: after the fill)
        bad = dev.launch(fail_on_purpose, (1,), (1,), (other, 1))
        fill = buf.fill(2, after=[bad])
    assert calls[0][4] == [bad]
    assert fill.wait(10) and bad.exception() is not None
    assert isinstance(fill.exception(), aiogpu.GPUError)
    assert fill.exception().__cause__ is bad.exception()
