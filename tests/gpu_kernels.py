"""Kernels the tests launch; their NumPy bodies are the oracle."""
from __future__ import annotations

import threading
import time

import aiogpu

# CUDA implementations (the NumPy bodies stay the oracle). CUDA launches ceil(grid/block)
# blocks, so element-wise kernels check their index against n.
_TIMER = r"""
__device__ __forceinline__ unsigned long long aiogpu_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ void aiogpu_sleep_ns(unsigned long long ns) {
    unsigned long long t0 = aiogpu_now();
    while (aiogpu_now() - t0 < ns) { __nanosleep(1000); }
}
"""

SAXPY_CU = r"""
extern "C" __global__ void saxpy(float* y, const float* x, float a, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}
"""

SLOW_INCREMENT_CU = _TIMER + r"""
extern "C" __global__ void slow_increment(long long* counter) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        long long value = *(volatile long long*)counter;
        aiogpu_sleep_ns(2000000ull);
        *(volatile long long*)counter = value + 1;
    }
}
"""

SLEEP_MS_CU = _TIMER + r"""
extern "C" __global__ void sleep_ms(unsigned int ms) {
    if (blockIdx.x == 0 && threadIdx.x == 0) aiogpu_sleep_ns(1000000ull * ms);
}
"""

FAIL_IF_CU = r"""
extern "C" __global__ void fail_if(int* out, int code) {
    if (code) __trap();
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = 1;
}
"""

SCALE_CU = r"""
extern "C" __global__ void scale(float* y, float a, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= a;
}
"""

ADD_INTO_CU = r"""
extern "C" __global__ void add_into(long long* dst, const long long* src, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] += src[i];
}
"""

ADD_CONST_N_CU = r"""
extern "C" __global__ void add_const_n(long long* x, long long c, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += c;
}
"""


@aiogpu.kernel("f32*, const f32*, f32, u32", cuda=SAXPY_CU)
def saxpy(launch, y, x, a, n):
    y[:n] += a * x[:n]


@aiogpu.kernel("i64*", cuda=SLOW_INCREMENT_CU)
def slow_increment(launch, counter):
    """Read, pause (releasing the GIL), write: loses updates unless launches are ordered."""
    value = int(counter[0])
    time.sleep(0.002)
    counter[0] = value + 1


@aiogpu.kernel("u32", cuda=SLEEP_MS_CU)
def sleep_ms(launch, ms):
    time.sleep(ms / 1000)


@aiogpu.kernel("i32*, i32", cuda=FAIL_IF_CU)
def fail_if(launch, out, code):
    if code:
        raise RuntimeError("kernel failed on purpose")
    out[0] = 1


@aiogpu.kernel("f32*, f32, u32", cuda=SCALE_CU)
def scale(launch, y, a, n):
    y[:n] *= a


@aiogpu.kernel("i64*, const i64*, u32", cuda=ADD_INTO_CU)
def add_into(launch, dst, src, n):
    dst[:n] += src[:n]


@aiogpu.kernel("i64*, i64, u32", cuda=ADD_CONST_N_CU)
def add_const_n(launch, x, c, n):
    x[:n] += c


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


async def freed_while_in_use(device):
    """An 8-byte buffer freed while a kernel that increments it waits behind a closed gate:
    (the gate, that kernel's future, the buffer's address). Open the gate to let it run."""
    import numpy as np

    gate = Gate()
    buf = device.alloc(8)
    await aiogpu.copy(buf, np.zeros(1, np.int64))
    held = gate.launch(device)
    inc = device.launch(slow_increment, grid=(1,), block=(1,), args=(buf,), after=[held])
    address = buf.address
    buf.free()
    return gate, inc, address
