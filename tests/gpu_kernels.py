"""Kernels the tests launch; their NumPy bodies are the oracle."""
from __future__ import annotations

import threading
import time

import aiogpu

# CUDA implementations (the NumPy bodies stay the oracle; OpenCL C ones for AMD below). CUDA launches ceil(grid/block)
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


# OpenCL C implementations for AMD agents (comgr compiles them for the agent's ISA). The pause
# reads s_memrealtime, the constant-rate counter of gfx8 to gfx10 (100 MHz on the data-centre
# parts; ROCr reports the rate as HSA_AMD_AGENT_INFO_TIMESTAMP_FREQUENCY).
_TIMER_CL = r"""
#define AIOGPU_REALTIME_HZ 100000000ul
void aiogpu_sleep_ns(ulong ns) {
    ulong t0 = __builtin_amdgcn_s_memrealtime();
    ulong ticks = ns / (1000000000ul / AIOGPU_REALTIME_HZ);
    while (__builtin_amdgcn_s_memrealtime() - t0 < ticks) __builtin_amdgcn_s_sleep(127);
}
"""

SAXPY_CL = r"""
__kernel void saxpy(__global float* y, __global const float* x, float a, uint n) {
    size_t i = get_global_id(0);
    if (i < n) y[i] += a * x[i];
}
"""

SLOW_INCREMENT_CL = _TIMER_CL + r"""
__kernel void slow_increment(__global long* counter) {
    if (get_global_id(0) == 0) {
        long value = *(volatile __global long*)counter;
        aiogpu_sleep_ns(2000000ul);
        *(volatile __global long*)counter = value + 1;
    }
}
"""

SLEEP_MS_CL = _TIMER_CL + r"""
__kernel void sleep_ms(uint ms) {
    if (get_global_id(0) == 0) aiogpu_sleep_ns(1000000ul * ms);
}
"""

FAIL_IF_CL = r"""
__kernel void fail_if(__global int* out, int code) {
    if (code) __builtin_trap();
    if (get_global_id(0) == 0) out[0] = 1;
}
"""

SCALE_CL = r"""
__kernel void scale(__global float* y, float a, uint n) {
    size_t i = get_global_id(0);
    if (i < n) y[i] *= a;
}
"""

ADD_INTO_CL = r"""
__kernel void add_into(__global long* dst, __global const long* src, uint n) {
    size_t i = get_global_id(0);
    if (i < n) dst[i] += src[i];
}
"""

ADD_CONST_N_CL = r"""
__kernel void add_const_n(__global long* x, long c, uint n) {
    size_t i = get_global_id(0);
    if (i < n) x[i] += c;
}
"""

@aiogpu.kernel("f32*, const f32*, f32, u32", cuda=SAXPY_CU, opencl=SAXPY_CL)
def saxpy(launch, y, x, a, n):
    y[:n] += a * x[:n]


@aiogpu.kernel("i64*", cuda=SLOW_INCREMENT_CU, opencl=SLOW_INCREMENT_CL)
def slow_increment(launch, counter):
    """Read, pause (releasing the GIL), write: loses updates unless launches are ordered."""
    value = int(counter[0])
    time.sleep(0.002)
    counter[0] = value + 1


@aiogpu.kernel("u32", cuda=SLEEP_MS_CU, opencl=SLEEP_MS_CL)
def sleep_ms(launch, ms):
    time.sleep(ms / 1000)


@aiogpu.kernel("i32*, i32", cuda=FAIL_IF_CU, opencl=FAIL_IF_CL)
def fail_if(launch, out, code):
    if code:
        raise RuntimeError("kernel failed on purpose")
    out[0] = 1


@aiogpu.kernel("f32*, f32, u32", cuda=SCALE_CU, opencl=SCALE_CL)
def scale(launch, y, a, n):
    y[:n] *= a


@aiogpu.kernel("i64*, const i64*, u32", cuda=ADD_INTO_CU, opencl=ADD_INTO_CL)
def add_into(launch, dst, src, n):
    dst[:n] += src[:n]


@aiogpu.kernel("i64*, i64, u32", cuda=ADD_CONST_N_CU, opencl=ADD_CONST_N_CL)
def add_const_n(launch, x, c, n):
    x[:n] += c


@aiogpu.kernel("const i64*")
def peek(launch, x):
    """Reads ``x[0]`` and writes nothing: work that only depends on a buffer."""
    int(x[0])


@aiogpu.kernel("i64*, u32")
def slow_write(launch, x, ms):
    """Writes 7 into ``x[0]`` after ``ms`` milliseconds of host time."""
    time.sleep(ms / 1000)
    x[0] = 7


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
