"""The ``Device``: what every backend's GPU shares.

The base owns the rules once: argument validation (grid, block, signature, scalars, buffers of
this device), allocation through the 2 MiB sub-allocator, the kernel cache, and the launch front
(capture, the runtime lock, then the core's submission: ``aiogpu._core.submit``). A backend
subclasses it and implements the hooks of ``aiogpu.backend.DeviceHooks`` (memory, loading,
encoding a dispatch or a fill on a lane); nothing here knows HSA or CUDA.
"""
from __future__ import annotations

import functools
import math
import sys
import traceback
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from . import capture as _capture
from . import deferred, ordering
from ._core import submit as _submit
from ._core.state import DeviceState
from .backend import DeviceHooks
from .errors import OutOfMemoryError
from .futures import GPUFuture, completed_future
from .kernels import Kernel, fill_kernel
from .memory import BLOCK, SMALL_LIMIT, Buffer, DeviceMemory, round_up
from .memory import alloc_plain as _alloc_plain

if TYPE_CHECKING:
    from .runtime import Runtime

MAX_GRID = 0xFFFFFFFF
# A 64-bit address space: the bound on an allocation where the backend cannot tell the device's size.
ADDRESS_SPACE = 1 << 64
MAX_WORKGROUP = 1024
# The largest grid of the built-in copy and fill kernels: a dispatch packet's grid size is a
# 32-bit count, so larger copies and fills stride (each work-item handles every cap-th item).
SHADER_GRID_CAP = 1 << 30


def _caller_stack(frames: int) -> traceback.StackSummary:
    """``frames`` frames of the stack above ``Device.alloc``, most recent call last; source
    lines are read only when the summary is formatted (as tracemalloc, nothing per allocation
    beyond the frames' names and line numbers)."""
    stack = traceback.StackSummary.extract(traceback.walk_stack(sys._getframe(2)), limit=frames,
                                           lookup_lines=False)
    stack.reverse()
    return stack


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


class Foreign:
    """Another library's device array as a pointer argument (CUDA: ``__cuda_array_interface__``):
    its memory, ordered as a byte range by address, and the stream to wait on before the launch."""

    __slots__ = ("obj", "address", "nbytes", "state", "stream")

    def __init__(self, obj: Any, address: int, nbytes: int, state: Any, stream: Any):
        self.obj, self.address, self.nbytes, self.state, self.stream = obj, address, nbytes, state, stream


def check_args(device: "Device", kernel: Kernel, args: Sequence[Any]) -> tuple[list, list, dict[int, Any]]:
    """Validate ``args`` against ``kernel``'s signature for a launch on ``device``: (argument
    values, buffer lengths, {index: Buffer or Foreign})."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    plan = kernel.arg_plan
    if len(args) != len(plan):
        raise TypeError(f"{kernel.name} takes {len(kernel.args)} arguments ({kernel.signature}), "
                        f"got {len(args)}")
    values: list = []
    lengths: list = []
    buffers: dict[int, Any] = {}
    closed = device.runtime.closed
    for i, value in enumerate(args):
        pointer, low, high = plan[i]
        # The common cases in one test each (a whole raw buffer of this device, a plain int or
        # float in range); anything else goes through the full check, which names what is wrong.
        if pointer:
            if (type(value) is not Buffer or value._base is not None or value.typed_dtype is not None
                    or value.freed or closed or value.device is not device):
                value = check_pointer(device, kernel, i, kernel.args[i], value)
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


def check_pointer(device: "Device", kernel: Kernel, i: int, spec: Any, value: Any) -> Any:
    """A pointer argument: a usable Buffer (or view) of ``device`` whose type fits ``spec``, or
    another library's array on ``device`` where the backend accepts them (a Foreign)."""
    what = f"{kernel.name} argument {i} ({spec})"
    if not isinstance(value, Buffer):
        return device.runtime._foreign_argument(device, value, what, write=i in kernel.writes)
    value._check_usable()
    if value.device is not device:
        where = ("a buffer of another runtime" if value.device.runtime is not device.runtime
                 else f"on {value.device.name}")
        raise ValueError(f"{what}: {value!r} is {where}, not on {device.name}; copy it with aiogpu.copy first")
    if value.typed_dtype is not None and value.typed_dtype != spec.dtype:
        raise TypeError(f"{what}: {value!r} holds {value.typed_dtype}, not {spec.dtype}; pass a view "
                        f"of the right dtype (buf.view(np.{spec.dtype}))")
    if value.address % spec.dtype.itemsize:
        raise ValueError(f"{what}: {value!r} is not aligned for {spec.dtype} (offset {value.offset})")
    return value


def _foreign_parts(kernel: Kernel, buffers: dict, capturing: bool) -> tuple[list, list]:
    """Replace the Foreign arguments in ``buffers`` by their ordering states; (the objects to
    keep alive, the foreign streams to wait on). A graph takes no foreign arrays (TypeError)."""
    keep, waits = [], []
    for i, arg in buffers.items():
        if type(arg) is Foreign:
            if capturing:
                raise TypeError(f"{kernel.name} argument {i}: a graph captures Buffers only, "
                                f"not {type(arg.obj).__name__}")
            buffers[i] = arg.state
            keep.append(arg.obj)
            if arg.stream is not None:
                waits.append(arg.stream)
    return keep, waits


class Device(DeviceState, DeviceHooks):
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
        # The core's lane choice: round-robin, by load where the backend tells it (``_lane_load``).
        self._lane_order = _submit.LaneOrder([], type(self)._lane_load is not DeviceHooks._lane_load)
        self._kernels: dict[Kernel, Any] = {}
        self._compiling: dict[Kernel, Any] = {}   # compile futures (deferred.Deferred) in flight or failed
        self._shapes: dict[tuple, tuple] = {}
        self._last_launch = None

    def _set_compute_lanes(self, lanes: list) -> None:
        self.compute = list(lanes)
        self._lane_order = _submit.LaneOrder(self.compute, self._lane_order.balances_load)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.isa} ({self.runtime.backend})>"

    def _copy_grid(self, nbytes: int) -> tuple[int, ...]:
        """The grid of a shader copy of ``nbytes`` (the built-in copy kernel strides over the
        rest): one work-item a byte, at most ``SHADER_GRID_CAP``."""
        return (min(max(nbytes, 1), SHADER_GRID_CAP),)

    def _fill_grid(self, count: int) -> tuple[int, ...]:
        """The grid of a fill of ``count`` 32-bit words (the built-in fill kernel strides over
        the rest): one work-item a word, at most ``SHADER_GRID_CAP``."""
        return (min(max(count, 1), SHADER_GRID_CAP),)

    def trim(self) -> int:
        """Give the device memory cached for reuse back to the driver; returns the bytes."""
        with self.runtime.lock:
            return self.memory.trim()

    # -- memory --------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Buffer:
        """``nbytes`` of device memory (synchronous, cheap; contents undefined).

        Raises TypeError for a size that is no integer (bool, float, str), ValueError for zero
        or less, OutOfMemoryError (``requested``, ``free``) when the device has no room (for a
        size beyond ``memory_size`` before any driver call), RuntimeClosedError after
        ``close()``."""
        buf = _alloc_plain(self, nbytes)     # (the common case, in one compiled call)
        if buf is not None:
            return buf
        if type(nbytes) is not int:
            if isinstance(nbytes, (bool, np.bool_)) or not isinstance(nbytes, (int, np.integer)):
                raise TypeError(f"alloc takes a byte count, got {nbytes!r}")
            nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"alloc needs a positive byte count, got {nbytes}")
        if nbytes > SMALL_LIMIT:       # (only a large request can exceed the device)
            self._check_room(nbytes)
        rt = self.runtime
        if rt.closed:
            rt._check_open()            # (raises)
        memory = self.memory
        # The steady state: a piece from the size class's cache, with no lock (see ``take``).
        address = memory.take(nbytes)
        if address is None:
            with rt.lock:
                rt._check_open()
                address = memory.alloc(nbytes)
        buf = Buffer(self, address, nbytes, memory.give_back)
        if rt.track_allocations:       # (for leak reports: Runtime.leaks names where)
            buf.allocated_at = _caller_stack(rt.track_allocations)
        return buf

    @functools.cached_property
    def memory_size(self) -> int | None:
        """The device's memory in bytes (None where the backend cannot tell): no allocation
        larger than this can succeed."""
        return self._memory_size()

    def _check_room(self, nbytes: int) -> None:
        """OutOfMemoryError, before any driver call, for ``nbytes`` more than the device has
        (or than a 64-bit address space holds, where the backend cannot tell): the driver
        would refuse it, or fail on a size that does not fit its size_t (ROCr's
        INVALID_ARGUMENT for 2**64, which wraps to 0)."""
        size = round_up(nbytes, BLOCK)            # what the allocator asks the driver for
        total = self.memory_size
        if size <= (total if total is not None else ADDRESS_SPACE - BLOCK):
            return
        free = self._memory_free()
        have = "an unknown amount" if free is None else f"{free} bytes"
        whole = f"the device's {total} bytes of memory" if total is not None else "a 64-bit address space"
        asked = "" if size == nbytes else f" ({nbytes} rounded up to whole 2 MiB blocks)"
        raise OutOfMemoryError(f"{self.name}: out of memory allocating {size} bytes{asked}: more than {whole} "
                               f"({have} free)", requested=size, free=free)

    def _out_of_memory(self, size: int, free: int | None, status: int | None = None) -> OutOfMemoryError:
        """The error a raw allocator raises when the device has no room for ``size`` bytes."""
        have = "unknown" if free is None else f"{free} bytes"
        return OutOfMemoryError(f"{self.name}: out of memory allocating {size} bytes ({have} free)",
                                requested=size, free=free, status=status)

    # -- kernels -------------------------------------------------------------------------------
    def _loaded_kernel(self, kernel: Kernel) -> Any:
        """``kernel`` loaded on this device (compiled and loaded once, then cached). Raises
        the device's error if it is broken (a lost device loads nothing: it would never finish)."""
        got = self._kernels.get(kernel)
        if got is None:
            if self.broken is not None:
                raise ordering.broken_error(f"loading {kernel.name} on {self.name}", self.broken)
            got = self._kernels[kernel] = self._load(kernel)
        return got

    def load(self, kernel: Kernel) -> GPUFuture[None]:
        """Compile and load ``kernel`` on this device, off the event loop: the warm-up of a
        service (``await dev.load(kernel)`` before taking requests).

        Returns a future at once; the compile runs on a worker thread (the loop runs on) and
        the future completes once the kernel is ready here (at once if it already is; the
        compilers' disk cache makes a second process fast). It fails with the compiler's
        error (a ValueError carrying its log) if the kernel does not compile; launches of it
        then raise that error. RuntimeClosedError after ``close()``."""
        if not isinstance(kernel, Kernel):
            raise TypeError(f"load takes an aiogpu kernel, got {kernel!r}")
        rt = self.runtime
        with rt.lock:
            rt._check_open()
            if kernel in self._kernels:
                return completed_future(rt.hub, f"load {kernel.name}")
            pending = self._compiling.get(kernel)
            if pending is None:
                pending = self._start_compile(kernel, always=True)
            return pending

    def _start_compile(self, kernel: Kernel, *, always: bool = False) -> Any:
        """The compile future of ``kernel`` on this device, started now on a worker thread
        (under the lock); None when loading it compiles nothing (``always``: a future anyway)."""
        rt = self.runtime
        if not always and not self._needs_compile(kernel):
            return None
        fut = self._compiling[kernel] = deferred.new_compile(rt, f"compile {kernel.name} for {self.name}")

        def work() -> None:
            exc: BaseException | None = None
            try:
                self._compile(kernel)
            except BaseException as e:  # noqa: BLE001 - the compile's failure, for its future
                exc = e
            with rt.lock:
                if exc is None and not rt._abandoning:
                    try:
                        self._loaded_kernel(kernel)
                    except BaseException as e:  # noqa: BLE001
                        exc = e
                elif exc is None:
                    exc = RuntimeError("the runtime was closed before the kernel was loaded")
                if exc is None:
                    del self._compiling[kernel]
                deferred.finish_compile(rt, fut, exc)

        rt._compile_in_background(work)
        return fut

    def launch(self, kernel: Kernel, grid: Any, block: Any, args: Sequence[Any] = (), *,
               after: Iterable[GPUFuture[Any]] = ()) -> GPUFuture[None]:
        """Dispatch ``kernel`` over ``grid`` work-items in workgroups of ``block``.

        Returns at once with a GPUFuture. Bad input raises ValueError/TypeError before anything
        is submitted. The launch waits on the device for ``after`` and for earlier operations
        that conflict with the buffers it uses: its pointer arguments are read and written,
        ``const T*`` ones only read, ``out T*`` ones only written. It fails if something it
        reads failed; writing memory that a failed operation left undefined defines it again.

        A kernel not compiled yet for this device is compiled on a worker thread (never on the
        event loop): the launch returns its future at once, its ordering is fixed now (later
        work on its buffers orders after it), and it is submitted when the compile finishes
        (see ``aiogpu.deferred``); if the compile fails, the future fails with a GPUError
        caused by the compiler's error, and later launches of the kernel raise that error.
        ``await dev.load(kernel)`` compiles ahead of time.
        """
        if not after and _capture._active.get() is None:
            # The common case in one call (``submit.launch_plain``: a shape seen before, plain
            # arguments); anything else, None from it, takes the general path.
            fut = _submit.launch_plain(self, kernel, grid, block, args)
            if fut is not None:
                return fut
        return self._launch_general(kernel, grid, block, args, after)

    def _launch_general(self, kernel: Kernel, grid: Any, block: Any, args: Sequence[Any], after: Any) -> GPUFuture[None]:
        """``launch`` of anything but its common case: validated here, then submitted. (A
        function of its own: the closures below make cells of its locals at every call, which
        the common case does not pay.)"""
        rt = self.runtime
        grid, block = self._launch_shape(kernel, grid, block)
        values, lengths, buffers = check_args(self, kernel, args)
        after = rt._check_after(after) if after else []
        capture = rt._current_capture()
        keep, waits = _foreign_parts(kernel, buffers, capture is not None) if buffers else ([], [])
        if capture is not None:
            return capture.record_launch(self, kernel, grid, block, tuple(args), after)
        if buffers:
            reads = [buffers[i] for i in kernel._reads if i in buffers]
            writes = [buffers[i] for i in kernel._writes if i in buffers]
        else:
            reads = writes = []
        with rt.lock:
            rt._check_open()
            loaded = self._kernels.get(kernel)
            if loaded is None and self.broken is not None:   # fails it at once, loading nothing
                return _submit.guarded(rt, self, kernel.name, reads, writes, after, _unreachable)
            if loaded is None:
                compiling = self._compiling.get(kernel) or self._start_compile(kernel)
                if compiling is not None and compiling._exc is not None:
                    raise compiling._exc            # it did not compile: bad input, as before
                if compiling is not None and not compiling.done():
                    # (``keep`` and ``waits`` travel with it: the foreign arrays stay alive while
                    # it waits, and it is ordered after their streams when submitted.)
                    return _submit.guarded(rt, self, kernel.name, reads, writes, after, lambda deps: _submit.launch(
                        rt, self, self._loaded_kernel(kernel), kernel.name, grid, block, values, lengths, deps,
                        reads, writes, keep, (), None, waits), compile=compiling)
                loaded = self._loaded_kernel(kernel)
            if not (reads or writes or after) and self.broken is None:
                # Nothing to order after on a working device: ``guarded``'s fast path, without
                # building the closure it takes.
                return _submit.launch(rt, self, loaded, kernel.name, grid, block, values, lengths, {}, reads,
                                      writes, keep, (), None, waits)
            return _submit.guarded(rt, self, kernel.name, reads, writes, after, lambda deps: _submit.launch(
                rt, self, loaded, kernel.name, grid, block, values, lengths, deps, reads, writes, keep, (), None,
                waits))

    def _launch_shape(self, kernel: Kernel, grid: Any, block: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``grid`` and ``block`` validated (core rules, then the backend's limits); a service
        launching the same shapes again pays a dictionary lookup. The cache, ``_shapes``, maps
        (kernel, grid, block) to (grid, block, kernel.arg_plan, kernel._reads, kernel._writes,
        kernel.name), what ``submit.launch_plain`` reads."""
        key = (kernel, grid, block)
        try:
            shape = self._shapes[key]
            if _submit.plain_ints(grid) and _submit.plain_ints(block):   # (not True or 1.0 for 1)
                return shape[0], shape[1]
        except (KeyError, TypeError):       # new, or unhashable (lists), or not tuples: validate
            pass
        got = check_launch(kernel, grid, block)
        self._check_grid(*got)
        if len(self._shapes) < 4096:
            try:
                # (with what the plain launch reads of the kernel: submit.launch_plain)
                self._shapes[key] = (*got, kernel.arg_plan, kernel._reads, kernel._writes, kernel.name)
            except TypeError:
                pass
        return got

    # -- lanes ---------------------------------------------------------------------------------
    def _pick_lane(self, deps: dict[GPUFuture, Any]) -> Any:
        """The compute lane the core would choose for work after ``deps`` (``submit.pick_lane``)."""
        return _submit.pick_lane(self, deps)


def _unreachable(deps: dict) -> GPUFuture:
    raise AssertionError("the submission submits nothing on a broken device")
