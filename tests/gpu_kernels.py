"""Kernels the tests launch; their NumPy bodies are the oracle."""
from __future__ import annotations

import threading
import time

import aiogpu


@aiogpu.kernel("f32*, const f32*, f32, u32")
def saxpy(launch, y, x, a, n):
    y[:n] += a * x[:n]


@aiogpu.kernel("i64*")
def slow_increment(launch, counter):
    """Read, pause (releasing the GIL), write: loses updates unless launches are ordered."""
    value = int(counter[0])
    time.sleep(0.002)
    counter[0] = value + 1


@aiogpu.kernel("u32")
def sleep_ms(launch, ms):
    time.sleep(ms / 1000)


@aiogpu.kernel("i32*, i32")
def fail_if(launch, out, code):
    if code:
        raise RuntimeError("kernel failed on purpose")
    out[0] = 1


@aiogpu.kernel("f32*, f32, u32")
def scale(launch, y, a, n):
    y[:n] *= a


@aiogpu.kernel("i64*, const i64*, u32")
def add_into(launch, dst, src, n):
    dst[:n] += src[:n]


GATES: dict[int, "threading.Event"] = {}


@aiogpu.kernel("u32")
def wait_gate(launch, key):
    """Blocks the device until the test opens gate ``key``: deterministic 'slow' work."""
    GATES[int(key)].wait(30)


class Gate:
    """A device-side gate the test opens: ``gate.launch(dev)`` then ``gate.open()``."""

    _next = 0

    def __init__(self):
        Gate._next += 1
        self.key = Gate._next
        GATES[self.key] = threading.Event()

    def launch(self, device, **kw):
        return device.launch(wait_gate, grid=(1,), block=(1,), args=(self.key,), **kw)

    def open(self):
        GATES[self.key].set()
