"""Bad input raises ValueError/TypeError with a clear message before anything is submitted."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from gpu_kernels import saxpy, sleep_ms


def write_indices(rt):
    return [rt.api.hsa_queue_load_write_index_relaxed(q._q) for d in rt.devices for q in d.queues]


@pytest.fixture
def setup(rt):
    d0, d1 = rt.devices
    x, y, z = d0.alloc(64), d0.alloc(64), d1.alloc(64)
    return rt, d0, d1, x, y, z


CASES = [
    ("too few args", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (16,), (16,), (y, x, 2.0)), TypeError, "takes 4 arguments"),
    ("too many args", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (16,), (16,), (y, x, 2.0, 16, 1)), TypeError, "takes 4"),
    ("scalar for pointer", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (16,), (16,), (1, x, 2.0, 16)), TypeError, "must be a Buffer"),
    ("array for pointer", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (16,), (16,), (np.zeros(16, np.float32), x, 2.0, 16)), TypeError, "must be a Buffer"),
    ("buffer for scalar", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (16,), (16,), (y, x, x, 16)), TypeError, "must be a real number"),
    ("string scalar", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (16,), (16,), (y, x, "2", 16)), TypeError, "must be a real number"),
    ("negative unsigned", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (16,), (16,), (y, x, 2.0, -1)), ValueError, "out of range"),
    ("float for integer", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (16,), (16,), (y, x, 2.0, 1.5)), TypeError, "must be an integer"),
    ("buffer of another device", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (16,), (16,), (y, z, 2.0, 16)), ValueError, "is on gpu1, not on gpu0"),
    ("zero grid", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (0,), (16,), (y, x, 2.0, 16)), ValueError, "grid entries"),
    ("four dimensions", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (1, 1, 1, 1), (1, 1, 1, 1), (y, x, 2.0, 16)), ValueError, "1 to 3"),
    ("block too large", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (2048,), (2048,), (y, x, 2.0, 16)), ValueError, "block entries"),
    ("block product too large", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (64, 64), (64, 64), (y, x, 2.0, 16)), ValueError, "work-items"),
    ("dims mismatch", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (16, 2), (16,), (y, x, 2.0, 16)), ValueError, "same number of dimensions"),
    ("float grid", lambda rt, d0, d1, x, y, z: d0.launch(saxpy, (16.0,), (16,), (y, x, 2.0, 16)), TypeError, "integers"),
    ("not a kernel", lambda rt, d0, d1, x, y, z: d0.launch(print, (16,), (16,), ()), TypeError, "aiogpu kernel"),
    ("non-future in after", lambda rt, d0, d1, x, y, z: d0.launch(sleep_ms, (1,), (1,), (1,), after=[42]), TypeError, "GPUFutures"),
    ("copy size mismatch", lambda rt, d0, d1, x, y, z: aiogpu.copy(x, np.zeros(8, np.float32)), ValueError, "sizes differ"),
    ("copy non-contiguous", lambda rt, d0, d1, x, y, z: aiogpu.copy(x, np.zeros(32, np.float32)[::2]), ValueError, "C-contiguous"),
    ("copy read-only dst", lambda rt, d0, d1, x, y, z: aiogpu.copy(np.frombuffer(bytes(64), np.uint8), x), ValueError, "read-only"),
    ("copy host to host", lambda rt, d0, d1, x, y, z: aiogpu.copy(np.zeros(4), np.zeros(4)), TypeError, "at least one Buffer"),
    ("copy a list", lambda rt, d0, d1, x, y, z: aiogpu.copy(x, [0] * 64), TypeError, "Buffer or a NumPy array"),
    ("alloc zero", lambda rt, d0, d1, x, y, z: d0.alloc(0), ValueError, "positive"),
    ("alloc float", lambda rt, d0, d1, x, y, z: d0.alloc(1.5), TypeError, "byte count"),
    ("to_numpy partial element", lambda rt, d0, d1, x, y, z: d0.alloc(6).to_numpy(np.float32), ValueError, "whole number"),
    ("gather non-future", lambda rt, d0, d1, x, y, z: aiogpu.gather(1), TypeError, "GPUFutures"),
]


@pytest.mark.parametrize("name,call,exc,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_before_submission(setup, name, call, exc, message):
    rt, d0, d1, x, y, z = setup
    before = write_indices(rt)
    pending = rt.hub.pending_count
    with pytest.raises(exc, match=message):
        call(rt, d0, d1, x, y, z)
    assert write_indices(rt) == before, "a packet was submitted"
    assert rt.hub.pending_count == pending


def test_freed_buffer_is_rejected(setup):
    rt, d0, d1, x, y, z = setup
    x.free()
    before = write_indices(rt)
    with pytest.raises(ValueError, match="was freed"):
        d0.launch(saxpy, (16,), (16,), (y, x, 2.0, 16))
    with pytest.raises(ValueError, match="was freed"):
        aiogpu.copy(y, x)
    assert write_indices(rt) == before


def test_future_of_another_runtime_is_rejected(setup, make_runtime):
    rt, d0, d1, x, y, z = setup
    other = make_runtime(gpus=1)
    f = other.devices[0].launch(sleep_ms, (1,), (1,), (0,))
    with pytest.raises(ValueError, match="another runtime"):
        d0.launch(sleep_ms, (1,), (1,), (0,), after=[f])
    f.wait(5)


def test_closed_runtime_is_rejected(make_runtime):
    rt = make_runtime()
    d0 = rt.devices[0]
    x = d0.alloc(64)
    rt.close()
    with pytest.raises(aiogpu.RuntimeClosedError, match="closed"):
        d0.alloc(64)
    with pytest.raises(ValueError, match="closed"):   # RuntimeClosedError is a ValueError too
        d0.launch(sleep_ms, (1,), (1,), (0,))
    with pytest.raises(ValueError, match="closed"):
        aiogpu.copy(x, np.zeros(64, np.uint8))


def test_bad_signatures_fail_at_declaration():
    with pytest.raises(ValueError, match="bad kernel argument type"):
        aiogpu.kernel("f33*")
    with pytest.raises(ValueError, match="bad kernel argument type"):
        aiogpu.kernel("const f32")
    with pytest.raises(TypeError):
        aiogpu.kernel(42)
