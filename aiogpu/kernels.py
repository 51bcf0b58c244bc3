"""Kernel declarations: one signature, per-backend implementations, and the built-in kernels.

``@aiogpu.kernel("f32*, const f32*, f32, u32", hsaco=..., cuda=...)`` declares a kernel. Its
Python body is the NumPy reference implementation: the emulator runs it once per dispatch, with
pointer arguments as typed views of whole buffers, and tests use it as the oracle. ``hsaco`` is an
AMD code object (kernel symbol = the function's name); ``opencl`` is OpenCL C source, compiled for
the agent's ISA at first use through ROCm's comgr (where libamd_comgr is present); ``cuda`` is
CUDA C source or cubin bytes.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np

from .signature import Arg, parse_signature


class Kernel:
    """A GPU kernel with a typed signature; launch it with ``Device.launch``."""

    def __init__(self, body: Callable, signature: str, *, hsaco: bytes | None = None,
                 cuda: str | bytes | None = None, opencl: str | None = None, name: str | None = None):
        if not callable(body):
            raise TypeError("a kernel body must be a function")
        self.body = body
        self.name = name or body.__name__
        self.signature = signature
        self.args: tuple[Arg, ...] = parse_signature(signature)
        self._derive()
        _check_arity(body, self.name, len(self.args))
        self.hsaco = hsaco
        self.cuda = cuda
        self.opencl = opencl
        # Per-backend artifacts (compiled code objects, emulator tokens), keyed by the backend's
        # own keys: kept on the kernel so that they live as long as it does.
        self.artifacts: dict[Any, Any] = {}
        self.__doc__ = body.__doc__

    def _derive(self) -> None:
        """What a launch reads of the signature, derived once: the pointer indices written and
        read, and the scalar bounds of the launch-time argument check (see device.check_args)."""
        self._writes = [i for i, a in enumerate(self.args) if a.pointer and not a.const]
        self._reads = [i for i, a in enumerate(self.args) if a.pointer and not a.out]
        self.arg_plan = tuple(_plan(a) for a in self.args)

    def __setstate__(self, state: dict) -> None:
        # Unpickled (Ray ships kernels to its workers): derive again, also from a kernel
        # pickled by a version of aiogpu that did not store these.
        self.__dict__.update(state)
        self._derive()

    @property
    def writes(self) -> list[int]:
        """Indices of the pointer arguments the kernel may write (not ``const``)."""
        return list(self._writes)

    @property
    def reads(self) -> list[int]:
        """Indices of the pointer arguments the kernel may read (not ``out``)."""
        return list(self._reads)

    def compile(self, device: Any) -> Any:
        """``device.load(self)``: compile and load this kernel on ``device`` off the event loop;
        a future that completes when it is ready (``await kernel.compile(dev)``)."""
        return device.load(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the reference body directly (on NumPy arrays), e.g. as a test oracle."""
        return self.body(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Kernel {self.name}({self.signature})>"


def _plan(arg: Arg) -> tuple[bool, Any, Any]:
    """(pointer, low, high) of one argument: an integer's range, a float's finite limit (low None)."""
    if arg.pointer:
        return True, None, None
    dt = arg.dtype
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return False, int(info.min), int(info.max)
    return False, None, float(np.finfo(dt).max)


def _check_arity(body: Callable, name: str, count: int) -> None:
    """The reference body takes the launch plus one parameter per signature argument; a
    mismatch raises TypeError at declaration rather than at the first emulated dispatch."""
    try:
        params = inspect.signature(body).parameters.values()
    except (TypeError, ValueError):      # builtins and the like: nothing to check
        return
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if not len(required) <= count + 1 <= len(positional):
        raise TypeError(f"kernel {name!r}: the signature has {count} arguments, so the body must take "
                        f"{count + 1} parameters (the launch, then one per argument); it takes "
                        f"{len(positional)}")


def kernel(signature: str, *, hsaco: bytes | None = None, cuda: str | bytes | None = None,
           opencl: str | None = None, name: str | None = None) -> Callable[[Callable], Kernel]:
    """Declare a kernel from its NumPy reference body: ``@aiogpu.kernel("f32*, u32")``."""
    parse_signature(signature)  # bad signatures fail at declaration

    def wrap(body: Callable) -> Kernel:
        return Kernel(body, signature, hsaco=hsaco, cuda=cuda, opencl=opencl, name=name)

    return wrap


# -- built-in kernels ---------------------------------------------------------------------------
# CUDA launches ceil(grid / block) blocks; these loops stride over the whole range, so they are
# right for any grid (the CUDA backend launches its own shader copies with a capped grid).
COPY_CU = r"""
extern "C" __global__ void aiogpu_copy(unsigned char* dst, const unsigned char* src, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    if ((((unsigned long long)dst | (unsigned long long)src) & 15) == 0) {
        unsigned long long n16 = n / 16;
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (unsigned long long k = i; k < n16; k += stride) d[k] = s[k];
        for (unsigned long long k = n16 * 16 + i; k < n; k += stride) dst[k] = src[k];
    } else {
        for (unsigned long long k = i; k < n; k += stride) dst[k] = src[k];
    }
}
"""

FILL_CU = r"""
extern "C" __global__ void aiogpu_fill(unsigned int* dst, unsigned int value, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long k = i; k < n; k += stride) dst[k] = value;
}
"""


# The HSA grid is capped (Device._copy_grid/_fill_grid: a packet's grid size is 32 bits), so these
# stride over the whole range too.
COPY_CL = """
__kernel void aiogpu_copy(__global uchar* dst, __global const uchar* src, ulong n) {
    ulong stride = get_global_size(0);
    for (ulong i = get_global_id(0); i < n; i += stride) dst[i] = src[i];
}
"""

FILL_CL = """
__kernel void aiogpu_fill(__global uint* dst, uint value, ulong n) {
    ulong stride = get_global_size(0);
    for (ulong i = get_global_id(0); i < n; i += stride) dst[i] = value;
}
"""


@kernel("out u8*, const u8*, u64", name="aiogpu_copy", cuda=COPY_CU, opencl=COPY_CL)
def copy_kernel(launch, dst, src, n):
    """Shader copy: the fallback when no SDMA engine (CUDA: copy stream) is available. (The
    reference body runs once per dispatch, so it is right for any grid.)"""
    dst[:n] = src[:n]


@kernel("out u32*, u32, u64", name="aiogpu_fill", cuda=FILL_CU, opencl=FILL_CL)
def fill_kernel(launch, dst, value, n):
    """Fill ``n`` 32-bit words with ``value``."""
    dst[:n] = value


BUILTINS = (copy_kernel, fill_kernel)
