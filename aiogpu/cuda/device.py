"""One NVIDIA GPU as aiogpu sees it: its primary context, memory, lanes, kernels, launches."""
from __future__ import annotations

from typing import Any, Sequence

from ..device import Device
from ..kernels import Kernel
from ..memory import Buffer
from . import driver as D
from . import nvrtc
from .driver import cu
from . import encode as _encode
from .encode import Lane, LoadedCudaKernel, encode_kernel
from .streams import CompletionWords, EventPool

class CudaDevice(Device):
    """One NVIDIA GPU (the core's Device on CUDA).

    Work runs on lanes (streams): ``compute`` lanes for kernels, and the copy lanes ``h2d``,
    ``d2h``, ``d2d`` and ``peer`` that stand in for the DMA engines.
    """

    def __init__(self, runtime: Any, index: int, *, compute_streams: int):
        self.cudev = D.check(cu.cuDeviceGet(index), "cuDeviceGet")
        self.ctx = _retain_primary(self.cudev)
        self.ctx_handle = int(self.ctx)
        self.lanes: list[Lane] = []
        self.events = EventPool(self)     # (creates nothing until used)
        self.words: CompletionWords | None = None
        try:
            self._create(runtime, index, compute_streams)
        except BaseException:
            self._release_partial()      # what it made so far: nothing of it outlives the failure
            raise
        _encode.bind(self)               # (the core calls its launch encode as a C function)

    def _create(self, runtime: Any, index: int, compute_streams: int) -> None:
        raw = D.check(cu.cuDeviceGetName(128, self.cudev), "cuDeviceGetName")
        self.product = raw.split(b"\0", 1)[0].decode(errors="replace")
        self.cc = (D.attribute(self.cudev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
                   D.attribute(self.cudev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"))
        super().__init__(runtime, index, f"sm_{self.cc[0]}{self.cc[1]}")
        self.max_grid = tuple(D.attribute(self.cudev, f"CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_{a}") for a in "XYZ")
        self.host_pointer_ok = bool(D.attribute(
            self.cudev, "CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM"))
        self.memops = bool(D.attribute(self.cudev, "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS"))
        self.words = CompletionWords(self) if self.memops and runtime.completion_words else None
        lanes = self.lanes               # (filled as they are made: see _release_partial)
        for i in range(compute_streams):
            lanes.append(Lane(self, f"{self.name}.s{i}", "compute"))
        self._set_compute_lanes(lanes)
        for kind in ("h2d", "d2h", "d2d", "peer"):
            lanes.append(Lane(self, f"{self.name}.{kind}", kind))
        self.h2d, self.d2h, self.d2d, self.peer = lanes[-4:]     # (the four just made)
        self.foreign: dict[int, Any] = {}   # other libraries' streams (foreign.py), by handle
        self.ext: list[Lane] = []            # streams that capture other libraries' events
        self.peers: set[int] = set()
        self._geometry: dict[tuple, tuple] = {}

    def __repr__(self) -> str:
        return f"<CudaDevice {self.name} {self.product} {self.isa} (cuda)>"

    def make_current(self) -> None:
        _encode.make_current(self)

    # -- hooks: memory -------------------------------------------------------------------------
    def _raw_alloc(self, size: int) -> int:
        """``cuMemAlloc`` in this device's context; OutOfMemoryError when it has no room."""
        self.make_current()
        err, ptr = cu.cuMemAlloc(size)
        if int(err) == D.OUT_OF_MEMORY:
            free = cu.cuMemGetInfo()
            raise self._out_of_memory(size, int(free[1]) if free[0] == 0 else None, int(err))
        return int(D.check((err, ptr), f"cuMemAlloc({size})"))

    def _raw_free(self, address: int) -> None:
        self.make_current()
        cu.cuMemFree(address)

    def _memory_size(self) -> int | None:
        """``cuMemGetInfo``'s total in this device's context."""
        self.make_current()
        info = cu.cuMemGetInfo()
        return int(info[2]) if int(info[0]) == 0 else None

    def _memory_free(self) -> int | None:
        self.make_current()
        info = cu.cuMemGetInfo()
        return int(info[1]) if int(info[0]) == 0 else None

    # -- hooks: kernels ------------------------------------------------------------------------
    def _needs_compile(self, kernel: Kernel) -> bool:
        """CUDA C source not yet compiled by NVRTC in this process for this architecture."""
        code = kernel.cuda
        return isinstance(code, str) and not nvrtc.cached(code, *self.cc)

    def _compile(self, kernel: Kernel) -> None:
        """NVRTC (or the disk cache) on a compile worker thread; ``_load`` then finds the image."""
        if isinstance(kernel.cuda, str):
            nvrtc.compile_source(kernel.cuda, kernel.name, *self.cc)

    def _load(self, kernel: Kernel) -> LoadedCudaKernel:
        """``kernel`` compiled (NVRTC, cached per process) and loaded in this context."""
        code = kernel.cuda
        if code is None:
            raise ValueError(f"kernel {kernel.name!r} has no CUDA implementation (cuda=)")
        if isinstance(code, str):
            code, _kind = nvrtc.compile_source(code, kernel.name, *self.cc)
        self.make_current()
        module = D.check(cu.cuModuleLoadData(code), f"cuModuleLoadData({kernel.name})")
        err, func = cu.cuModuleGetFunction(module, kernel.name.encode())
        if err != 0:
            cu.cuModuleUnload(module)
            raise ValueError(f"the CUDA code of kernel {kernel.name!r} has no extern \"C\" "
                             f"__global__ function named {kernel.name!r} ({D.error_name(err)})")
        if hasattr(cu, "cuFuncLoad"):
            # Load it now rather than at its first launch: with lazy loading, a first
            # launch may wait for kernels already running on the device.
            cu.cuFuncLoad(func)
        return LoadedCudaKernel(kernel, func, module)

    def blocks(self, grid: tuple, block: tuple) -> tuple[tuple, tuple]:
        """CUDA's (gridDim, blockDim) for an HSA-style grid of work-items (ValueError if too big);
        a launch of a shape seen before pays a dictionary lookup."""
        key = (grid, block)
        try:
            return self._geometry[key]
        except KeyError:
            pass
        except TypeError:                  # unhashable (lists): not cached
            return self._blocks(grid, block)
        got = self._blocks(grid, block)
        if len(self._geometry) < 4096:
            self._geometry[key] = got
        return got

    def _blocks(self, grid: tuple, block: tuple) -> tuple[tuple, tuple]:
        blocks = tuple(-(-g // b) for g, b in zip(grid, block))
        for axis, (n, limit) in enumerate(zip(blocks, self.max_grid)):
            if n > limit:
                raise ValueError(f"grid {grid} with block {block} needs {n} blocks along axis {axis}; "
                                 f"{self.name} allows {limit}")
        pad = (1,) * (3 - len(grid))
        return blocks + pad, tuple(block) + pad

    _check_grid = blocks

    def _copy_grid(self, nbytes: int) -> tuple[int, ...]:
        """Shader copies stride over the range (16 bytes a thread a step): at most 8,192 blocks."""
        return (max(1, min(-(-nbytes // (16 * 256)), 8192)) * 256,)

    # The hook runs once per launch: it is compiled with the lanes (``encode.encode_kernel``),
    # which encodes a launch that is only a launch and hands the others to ``_encode_kernel_with``.
    _encode_kernel = encode_kernel

    def _encode_kernel_with(self, fut: Any, lane: Lane, loaded: LoadedCudaKernel, grid: tuple, block: tuple,
                            values: Sequence, waits: Sequence, cleanup: list, copy: Any, foreign: Sequence) -> tuple:
        """A shader copy (``copy``, the CopyOp) or a launch after other libraries' streams
        (``foreign``) on ``lane``, through ``CudaRuntime._encode_on_lane``."""
        (gx, gy, gz), (bx, by, bz) = self.blocks(grid, block)
        params = loaded.pack(values) if loaded.offsets else 0
        fh = loaded.handle
        launch = D.HOT.launch
        rt: Any = self.runtime          # (a CudaRuntime)

        def enqueue(stream: int, word: int, ticket: int) -> int:
            return launch(fh, gx, gy, gz, bx, by, bz, 0, stream, params, word, ticket)

        if copy is None:
            return rt._encode_on_lane(fut, lane, waits, cleanup, rt.with_foreign_waits(self, foreign, enqueue),
                                      fusable=True)
        from .interop import copy_streams
        patches = rt._take_patches(copy)
        if patches:       # (bytes of pending bounced downloads: after the shader copy, on its stream)
            enqueue = rt._with_patches(copy, enqueue, patches)
        return rt._encode_on_lane(fut, lane, waits, cleanup, rt.with_foreign_waits(self, copy_streams(copy), enqueue),
                                  fusable=not patches, on_complete=copy.on_complete,
                                  nbytes=copy.nbytes, staging=copy.staging)

    native_fill = True     # (cuMemsetD32Async)

    def _encode_fill(self, fut: Any, lane: Lane, buf: Buffer, word: int, waits: Sequence,
                     cleanup: list) -> tuple:
        """``cuMemsetD32Async`` on a compute lane."""
        count, ptr = buf.nbytes // 4, buf.address
        return self.runtime._encode_on_lane(fut, lane, waits, cleanup,
                                            lambda stream, _word, _ticket: cu.cuMemsetD32Async(ptr, word, count, stream)[0])

    # -- interop (Buffer.__cuda_array_interface__ / __dlpack__ delegate here) ------------------------
    def cuda_array_interface(self, buf: Buffer, typestr: str, lane: Any) -> dict:
        from .interop import cuda_array_interface
        return cuda_array_interface(buf, typestr, lane)

    def dlpack(self, buf: Buffer, **kw: Any) -> Any:
        from .interop import to_dlpack
        return to_dlpack(buf, **kw)

    def dlpack_device(self, buf: Buffer) -> tuple[int, int]:
        from .interop import KDL_CUDA
        return (KDL_CUDA, self.index)

    # -- shutdown ------------------------------------------------------------------------------
    def _destroy(self) -> None:
        self.make_current()
        cu.cuCtxSynchronize()
        for lane in self.lanes:
            lane.destroy()
        self.events.destroy()
        if self.words is not None:
            self.words.destroy()
        for loaded in self._kernels.values():
            cu.cuModuleUnload(loaded.module)
        self._kernels.clear()
        self.memory.destroy()

    def _release_partial(self) -> None:
        """Undo a construction that failed: its streams, events, completion words and its
        hold on the primary context (no work was submitted)."""
        for lane in self.lanes:
            lane.destroy()
        self.events.destroy()
        if self.words is not None:
            self.words.destroy()
        cu.cuDevicePrimaryCtxRelease(self.cudev)

    def release_context(self) -> None:
        cu.cuDevicePrimaryCtxRelease(self.cudev)
        if self.broken is not None:
            # The context hit a sticky error: only a reset makes the device usable again.
            cu.cuDevicePrimaryCtxReset(self.cudev)


def _retain_primary(cudev: Any) -> Any:
    """The device's primary context (shared with torch/cupy), reset first if a sticky error
    from an earlier user left it unusable."""
    err, ctx = cu.cuDevicePrimaryCtxRetain(cudev)
    if err == 0:
        D.check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        D.forget_current()
        (err,) = cu.cuCtxSynchronize()
        if err in D.STICKY:
            cu.cuDevicePrimaryCtxRelease(cudev)
            cu.cuDevicePrimaryCtxReset(cudev)
            err, ctx = cu.cuDevicePrimaryCtxRetain(cudev)
            if err == 0:
                D.check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    if err in D.STICKY:
        raise D.CudaError(f"CUDA device {int(cudev)} hit a sticky error earlier in this process "
                          f"({D.error_name(err)}); CUDA recovers from it only in a new process",
                          status=int(err))
    D.check((err,), "cuDevicePrimaryCtxRetain")
    return ctx
