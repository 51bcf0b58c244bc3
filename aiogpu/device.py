"""The core's ``Device``: what every backend's GPU shares.

The base owns the rules once: argument validation (grid, block, signature, scalars, buffers of
this device), allocation through the 2 MiB sub-allocator, the kernel cache, the launch front
(capture, the runtime lock, hazards and ``after=`` through ``Runtime.submit_guarded``) and the
choice of compute lane. A backend subclasses it and implements the hooks below; nothing here
knows HSA or CUDA.

Hooks (each backend implements them; called under the runtime lock unless said otherwise):

- ``_raw_alloc(size) -> address`` / ``_raw_free(address)``: device memory from the driver;
  ``_raw_alloc`` raises ``OutOfMemoryError`` when there is none.
- ``_load(kernel) -> loaded``: the kernel's code loaded on this device (cached by ``loaded``).
- ``_submit_kernel(loaded, label, grid, block, values, lengths, deps, reads, writes, keep=(),
  cleanup=()) -> GPUFuture``: one dispatch on a compute lane after ``deps`` (on the device).
- ``_submit_fill(buf, word, deps) -> GPUFuture``: fill ``buf`` with a 32-bit word (default: the
  built-in fill kernel through ``_submit_kernel``).
- ``_check_grid(grid, block)``: backend limits beyond the core's (default: none).
- ``_destroy()``: release the device's driver objects (runtime close).
"""
from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from .errors import OutOfMemoryError
from .futures import GPUFuture
from .kernels import Kernel, fill_kernel
from .memory import Buffer, DeviceMemory

if TYPE_CHECKING:
    from .runtime import Runtime

MAX_GRID = 0xFFFFFFFF
MAX_WORKGROUP = 1024
# The largest grid of the built-in copy and fill kernels: a dispatch packet's grid size is a
# 32-bit count, so larger copies and fills stride (each work-item handles every cap-th item).
SHADER_GRID_CAP = 1 << 30


def check_dims(name: str, dims: Any, limit: int) -> tuple[int, ...]:
    """Validate a grid or block: 1 to 3 positive integers each <= limit."""
    if isinstance(dims, (int, np.integer)):
        dims = (dims,)
    if not isinstance(dims, (tuple, list)) or not 1 <= len(dims) <= 3:
        raise ValueError(f"{name} must be 1 to 3 integers, got {dims!r}")
    out = []
    for d in dims:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"{name} entries must be integers, got {d!r}")
        if not 1 <= d <= limit:
            raise ValueError(f"{name} entries must be between 1 and {limit}, got {d}")
        out.append(int(d))
    return tuple(out)


def check_launch(kernel: Any, grid: Any, block: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate a launch's kernel, grid and block."""
    if not isinstance(kernel, Kernel):
        raise TypeError(f"launch takes an aiogpu kernel, got {kernel!r}")
    grid = check_dims("grid", grid, MAX_GRID)
    block = check_dims("block", block, MAX_WORKGROUP)
    if len(block) != len(grid):
        raise ValueError(f"grid {grid} and block {block} must have the same number of dimensions")
    if math.prod(block) > MAX_WORKGROUP:
        raise ValueError(f"block {block} has {math.prod(block)} work-items; at most {MAX_WORKGROUP}")
    return grid, block


_INT_RANGES: dict[str, tuple[int, int]] = {}


def check_scalar(kernel: Kernel, i: int, spec: Any, value: Any) -> Any:
    """A scalar argument as the Python number that will be packed; TypeError for non-numbers
    (bools, complex numbers, strings), ValueError for values the type cannot hold."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{kernel.name} argument {i} ({spec}) must be a real number, got {value!r}")
    bounds = _INT_RANGES.get(spec.type_name)
    if bounds is None and spec.dtype.kind in "iu":
        info = np.iinfo(spec.dtype)
        bounds = _INT_RANGES[spec.type_name] = (int(info.min), int(info.max))
    if bounds is not None:
        if isinstance(value, (float, np.floating)) and not float(value).is_integer():
            raise TypeError(f"{kernel.name} argument {i} ({spec}) must be an integer, got {value!r}")
        if not bounds[0] <= int(value) <= bounds[1]:
            raise ValueError(f"{kernel.name} argument {i} ({spec}) out of range: {value}")
        return int(value)
    value = float(value)
    if math.isfinite(value) and abs(value) > float(np.finfo(spec.dtype).max):
        raise ValueError(f"{kernel.name} argument {i} ({spec}) out of range: {value} "
                         f"(the largest {spec.type_name} is {np.finfo(spec.dtype).max})")
    return value


def check_args(device: "Device", kernel: Kernel, args: Sequence[Any]) -> tuple[list, list, dict[int, Buffer]]:
    """Validate ``args`` against ``kernel``'s signature for a launch on ``device``: (argument
    values, buffer lengths, {index: Buffer})."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    plan = kernel.arg_plan
    if len(args) != len(plan):
        raise TypeError(f"{kernel.name} takes {len(kernel.args)} arguments ({kernel.signature}), "
                        f"got {len(args)}")
    values: list = []
    lengths: list = []
    buffers: dict[int, Buffer] = {}
    closed = device.runtime.closed
    for i, value in enumerate(args):
        pointer, low, high = plan[i]
        # The common cases in one test each (a buffer of this device, a plain int or float in
        # range); anything else goes through the full check, which names what is wrong.
        if pointer:
            if type(value) is not Buffer or value.freed or closed or value.device is not device:
                _check_pointer(device, kernel, i, value)
            values.append(value.address)
            lengths.append(value.nbytes)
            buffers[i] = value
        elif low is not None and type(value) is int and low <= value <= high:
            values.append(value)
        elif low is None and type(value) is float and -high <= value <= high:
            values.append(value)
        else:
            values.append(check_scalar(kernel, i, kernel.args[i], value))
    return values, lengths, buffers


def _check_pointer(device: "Device", kernel: Kernel, i: int, value: Any) -> None:
    """A pointer argument must be a usable Buffer of ``device`` (TypeError/ValueError)."""
    spec = kernel.args[i]
    if not isinstance(value, Buffer):
        raise TypeError(f"{kernel.name} argument {i} ({spec}) must be a Buffer, got "
                        f"{type(value).__name__}")
    value.check_usable()
    if value.device is not device:
        where = ("a buffer of another runtime" if value.device.runtime is not device.runtime
                 else f"on {value.device.name}")
        raise ValueError(f"{kernel.name} argument {i}: {value!r} is {where}, not on "
                         f"{device.name}; copy it with aiogpu.copy first")


class Device:
    """One GPU: ``alloc`` buffers, ``launch`` kernels. Copies go through ``aiogpu.copy``.

    ``name`` is ``gpu<index>``, ``isa`` its architecture (``gfx90a``, ``sm_90``, ...). Work runs
    on lanes (``lanes``): compute lanes for kernels, and copy engines.
    """

    def __init__(self, runtime: "Runtime", index: int, isa: str) -> None:
        self.runtime = runtime
        self.index = index
        self.name = f"gpu{index}"
        self.isa = isa
        self.broken: Any = None        # a GPUError once the device is unusable (sticky errors)
        self.memory = DeviceMemory(self._raw_alloc, self._raw_free)
        self.compute: list[Any] = []   # compute lanes, set by the backend
        self._rr: Any = None
        self._kernels: dict[Kernel, Any] = {}
        self._shapes: dict[tuple, tuple] = {}

    def _set_compute_lanes(self, lanes: list) -> None:
        self.compute = list(lanes)
        self._rr = itertools.cycle(range(len(self.compute)))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.isa} ({self.runtime.backend})>"

    # -- hooks ---------------------------------------------------------------------------------
    def _raw_alloc(self, size: int) -> int:
        raise NotImplementedError

    def _raw_free(self, address: int) -> None:
        raise NotImplementedError

    def _load(self, kernel: Kernel) -> Any:
        raise NotImplementedError

    def _submit_kernel(self, loaded: Any, label: str, grid: tuple, block: tuple, values: list,
                       lengths: list, deps: dict, reads: list, writes: list, *,
                       keep: Iterable = (), cleanup: Iterable = (), copy: Any = None) -> GPUFuture:
        """One dispatch after ``deps`` (``copy``: the CopyOp when it is a shader copy)."""
        raise NotImplementedError

    def _submit_fill(self, buf: Buffer, word: int, deps: dict) -> GPUFuture:
        count = buf.nbytes // 4
        return self._submit_kernel(self.loaded(fill_kernel), f"fill {buf.nbytes} B", self.fill_grid(count), (256,),
                                   [buf.address, word, count], [buf.nbytes], deps, [buf], [buf])

    def _check_grid(self, grid: tuple, block: tuple) -> None:
        """Backend limits on a validated grid and block (ValueError); none by default."""

    def copy_grid(self, nbytes: int) -> tuple[int, ...]:
        """The grid of a shader copy of ``nbytes`` (the built-in copy kernel strides over the
        rest): one work-item a byte, at most ``SHADER_GRID_CAP``."""
        return (min(max(nbytes, 1), SHADER_GRID_CAP),)

    def fill_grid(self, count: int) -> tuple[int, ...]:
        """The grid of a fill of ``count`` 32-bit words (the built-in fill kernel strides over
        the rest): one work-item a word, at most ``SHADER_GRID_CAP``."""
        return (min(max(count, 1), SHADER_GRID_CAP),)

    def _destroy(self) -> None:
        """Release this device's driver objects (the runtime is closing)."""

    def trim(self) -> int:
        """Give the device memory cached for reuse back to the driver; returns the bytes."""
        with self.runtime.lock:
            return self.memory.trim()

    # -- memory --------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Buffer:
        """``nbytes`` of device memory (synchronous, cheap; contents undefined).

        Raises TypeError/ValueError for a bad size, OutOfMemoryError when the device has no room,
        RuntimeClosedError after ``close()``."""
        if isinstance(nbytes, (bool, np.bool_)) or not isinstance(nbytes, (int, np.integer)):
            raise TypeError(f"alloc takes a byte count, got {nbytes!r}")
        if nbytes <= 0:
            raise ValueError(f"alloc needs a positive byte count, got {nbytes}")
        rt = self.runtime
        with rt.lock:
            rt.check_open()
            address, _ = self.memory.alloc(int(nbytes))
        return Buffer(self, address, int(nbytes), self.memory.give_back)

    def out_of_memory(self, size: int, free: int | None, status: int | None = None) -> OutOfMemoryError:
        """The error a raw allocator raises when the device has no room for ``size`` bytes."""
        have = "unknown" if free is None else f"{free} bytes"
        return OutOfMemoryError(f"{self.name}: out of memory allocating {size} bytes ({have} free)",
                                requested=size, free=free, status=status)

    # -- kernels -------------------------------------------------------------------------------
    def loaded(self, kernel: Kernel) -> Any:
        """``kernel`` loaded on this device (compiled and loaded once, then cached)."""
        got = self._kernels.get(kernel)
        if got is None:
            got = self._kernels[kernel] = self._load(kernel)
        return got

    def launch(self, kernel: Kernel, grid: Any, block: Any, args: Sequence[Any] = (), *,
               after: Iterable[GPUFuture] = ()) -> GPUFuture:
        """Dispatch ``kernel`` over ``grid`` work-items in workgroups of ``block``.

        Returns at once with a GPUFuture. Bad input raises ValueError/TypeError before anything
        is submitted. The launch waits on the device for ``after`` and for earlier operations
        that conflict with the buffers it uses: its pointer arguments are read and written,
        ``const T*`` ones only read, ``out T*`` ones only written. It fails if something it
        reads failed; writing memory that a failed operation left undefined defines it again.
        """
        rt = self.runtime
        grid, block = self.shape(kernel, grid, block)
        values, lengths, buffers = check_args(self, kernel, args)
        after = rt.check_after(after) if after else []
        capture = rt.capturing()
        if capture is not None:
            return capture.record_launch(self, kernel, grid, block, tuple(args), after)
        if buffers:
            reads = [buffers[i] for i in kernel._reads if i in buffers]
            writes = [buffers[i] for i in kernel._writes if i in buffers]
        else:
            reads = writes = []
        with rt.lock:
            rt.check_open()
            loaded = self._kernels.get(kernel) or self.loaded(kernel)
            return rt.submit_guarded(self, kernel.name, reads, writes, after, lambda deps: self._submit_kernel(
                loaded, kernel.name, grid, block, values, lengths, deps, reads, writes))

    def shape(self, kernel: Kernel, grid: Any, block: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``grid`` and ``block`` validated (core rules, then the backend's limits); a service
        launching the same shapes again pays a dictionary lookup."""
        key = (kernel, grid, block)
        try:
            return self._shapes[key]
        except (KeyError, TypeError):       # new, or unhashable (lists): validate
            pass
        got = check_launch(kernel, grid, block)
        self._check_grid(*got)
        if len(self._shapes) < 4096:
            try:
                self._shapes[key] = got
            except TypeError:
                pass
        return got

    # -- lanes ---------------------------------------------------------------------------------
    def pick_lane(self, deps: Iterable[GPUFuture]) -> Any:
        """The compute lane of the newest live dependency on this device (lane order then
        suffices for it), else the next compute lane round-robin, so independent work spreads."""
        if not deps:
            return self.compute[next(self._rr)]
        for fut in reversed(list(deps)):
            lane = getattr(fut, "lane", None)
            if lane is not None and not fut.retired and getattr(lane, "device", None) is self \
                    and getattr(lane, "kind", "") == "compute":
                return lane
        return self.compute[next(self._rr)]
