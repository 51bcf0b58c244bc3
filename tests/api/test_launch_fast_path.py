"""The common launch in one call (``submit.launch_plain``): a shape launched before, whole raw
Buffers of the device and plain numbers in range, no ``after=``, no capture. It must skip the
general path's per-launch work, and hand everything else to that path unchanged: the same
errors, before anything is submitted."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
import aiogpu.device
from aiogpu.errors import RuntimeClosedError
from backends import count_calls
from gpu_kernels import saxpy, scale

pytestmark = pytest.mark.asyncio


def _spy(monkeypatch, name):
    return count_calls(monkeypatch, aiogpu.device, name)


async def test_a_repeated_plain_launch_skips_the_general_path(any_rt, monkeypatch):
    d0 = any_rt.devices[0]
    x, y = d0.alloc(64 * 4), d0.alloc(64 * 4)
    await aiogpu.copy(x, np.arange(64, dtype=np.float32))
    await aiogpu.copy(y, np.zeros(64, np.float32))
    await d0.launch(saxpy, (64,), (64,), (y, x, 1.0, 64))          # the shape is validated once
    # (each spy's own list: a concatenation of them would be a new list no call reaches)
    arg_checks, launch_checks = _spy(monkeypatch, "check_args"), _spy(monkeypatch, "check_launch")
    shape_checks = count_calls(monkeypatch, d0, "_launch_shape")
    futs = [d0.launch(saxpy, (64,), (64,), (y, x, 1.0, 64)) for _ in range(5)]
    assert arg_checks == launch_checks == shape_checks == [], "a plain launch went through the general path"
    await aiogpu.gather(*futs)
    assert (await y.to_numpy(np.float32) == 6 * np.arange(64, dtype=np.float32)).all()   # in order




@pytest.mark.parametrize("case", ["count", "bool", "range", "fraction", "str", "freed", "view", "not_a_buffer"])
async def test_bad_input_after_a_plain_launch_raises_as_before(any_rt, case):
    d0 = any_rt.devices[0]
    y = d0.alloc(256)
    await d0.launch(scale, (64,), (64,), (y, 2.0, 64))             # warm: the shape is cached
    assert not await any_rt.leaks_async(buffers=False)             # (nothing pending now)
    args: tuple
    if case == "count":
        args, exc, words = (y, 2.0), TypeError, "takes 3 arguments"
    elif case == "bool":
        args, exc, words = (y, 2.0, True), TypeError, "must be a real number"
    elif case == "range":
        args, exc, words = (y, 2.0, 1 << 32), ValueError, "out of range"
    elif case == "fraction":
        args, exc, words = (y, 2.0, 1.5), TypeError, "must be an integer"
    elif case == "str":
        args, exc, words = (y, "2", 64), TypeError, "must be a real number"
    elif case == "freed":
        z = d0.alloc(256)
        z.free()
        args, exc, words = (z, 2.0, 64), ValueError, "was freed"
    elif case == "view":
        args, exc, words = (y.view(np.int32), 2.0, 64), TypeError, "holds int32"
    else:
        args, exc, words = (np.zeros(64, np.float32), 2.0, 64), (TypeError, ValueError), "argument 0"
    with pytest.raises(exc, match=words):
        d0.launch(scale, (64,), (64,), args)
    assert any_rt.stats()["pending"] == 0, "bad input submitted something"
    assert d0.launch(scale, (64,), (64,), [y, 2.0, 64]) is not None    # a list goes the general way
    await d0.launch(scale, (64,), (64,), (y, np.float32(2.0), np.uint32(64)))  # NumPy scalars too


async def test_a_buffer_of_another_device_after_a_plain_launch_raises_as_before(any_rt2):
    d0, d1 = any_rt2.devices[:2]
    y = d0.alloc(256)
    await d0.launch(scale, (64,), (64,), (y, 2.0, 64))             # warm: the shape is cached
    with pytest.raises(ValueError, match="not on gpu0"):
        d0.launch(scale, (64,), (64,), (d1.alloc(256), 2.0, 64))
    assert any_rt2.stats()["pending"] == 0, "bad input submitted something"


async def test_a_plain_launch_on_a_closed_runtime_raises(make_any):
    rt = make_any()
    d0 = rt.devices[0]
    await d0.launch(scale, (1,), (1,), (d0.alloc(4), 2.0, 1))
    y = d0.alloc(4)
    rt.close()
    with pytest.raises(RuntimeClosedError):
        d0.launch(scale, (1,), (1,), (y, 2.0, 1))
