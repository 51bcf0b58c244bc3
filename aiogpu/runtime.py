"""The ``Runtime``: backend choice, options, and the fronts of every operation.

``aiogpu.Runtime(backend=None, **options)`` picks a backend (the argument, else
``AIOGPU_BACKEND``, else a real AMD GPU if ROCr answers with one, else an NVIDIA GPU, else the
emulator) and returns an instance of that backend's registered subclass: ``HsaRuntime``
(``hsa`` and ``emulator``) or ``CudaRuntime`` (``cuda``). Backends are imported lazily, when
chosen; importing aiogpu loads no driver and starts no process.

The base owns: option validation (unknown options raise TypeError on every backend), the one
lock, the fronts of ``copy`` (its validation and the shader-copy fallback decision; the copy
record, the direction rule (host-to-device on the destination's engine, device-to-host and peer
copies on the SOURCE device's) and the staging of small host sources are the core's,
``aiogpu._core.copies``), ``fill`` and ``gather``, stats and the leak check, and ``close``. Submission
itself (hazards, ``after=``, failed inputs, deferral, bookkeeping) is the core's
(``aiogpu._core.submit``); a backend implements the hooks of ``aiogpu.backend.RuntimeHooks``.
"""
from __future__ import annotations

import gc
import importlib
import os
import threading
import time
import traceback
import weakref
from typing import Any, Callable, ClassVar, Iterable, NamedTuple

import numpy as np

from . import _loops
from . import capture as _capture
from ._core import copies as _copies
from ._core import hazards
from ._core import deferred
from ._core import submit as _submit
from ._core.copies import STAGE_LIMIT, CopyOp, CopySide  # noqa: F401 - the copy record, for backends
from ._core.state import RuntimeState
from .backend import RuntimeHooks
from .device import Device
from .errors import BackendUnavailable, BlockingCallError, GPUError, InvalidStateError, NotOnCudaError, RuntimeClosedError
from .futures import FutureHub, GPUFuture, completed_future
from .hostpool import PinnedPool
from .kernels import copy_kernel
from .memory import Buffer, host_dtype


# Dtypes of host arrays that copies were given and ``host_dtype`` accepted (checked once).
_HOST_DTYPES: set = set()
# Backend name -> "module:class", imported when chosen.
REGISTRY: dict[str, str] = {
    "hsa": "aiogpu.hsa.runtime:HsaRuntime",
    "emulator": "aiogpu.hsa.runtime:HsaRuntime",
    "hsa-virtual": "aiogpu.hsa.runtime:HsaRuntime",
    "cuda": "aiogpu.cuda.runtime:CudaRuntime",
}
BACKENDS = tuple(REGISTRY)
# What makes a backend with optional dependencies available (BackendUnavailable's message; the
# HSA loader names its own fix).
FIXES: dict[str, str] = {
    "cuda": "pip install 'aiogpu[cuda]' on a machine with an NVIDIA GPU and its driver",
}
# Counters that return to zero when nothing is pending: what a leak check looks at.
LEAK_KEYS = ("pending", "signals_in_use", "kernarg_in_use", "backlog", "host_locks", "deferred")
# Frames of each allocation's call stack a runtime records (0: none), as PYTHONTRACEMALLOC.
TRACK_ALLOCS_ENV = "AIOGPU_TRACK_ALLOCS"


def allocation_frames() -> int:
    """``AIOGPU_TRACK_ALLOCS``: how many frames of each ``Device.alloc``'s call stack a new
    runtime records for its leak reports (unset or 0: none). ValueError naming the variable for
    anything but a non-negative integer."""
    raw = os.environ.get(TRACK_ALLOCS_ENV, "").strip()
    if not raw:
        return 0
    try:
        frames = int(raw)
    except ValueError:
        frames = -1
    if frames < 0:
        raise ValueError(f"{TRACK_ALLOCS_ENV} must be a number of frames (0: off), got {raw!r}")
    return frames


class HeldBuffer(NamedTuple):
    """A device allocation alive at a leak check: ``description`` (its repr), ``nbytes``,
    ``device`` (its name), ``address``, ``users`` (operations still using it), and
    ``allocated_at``: where ``Device.alloc`` was called (a ``traceback.StackSummary``, most
    recent call last), or None when the runtime did not track allocations."""

    description: str
    nbytes: int
    device: str
    address: int
    users: int
    allocated_at: traceback.StackSummary | None


class Leaks(dict):
    """What ``Runtime.leaks`` found: the non-zero counters by name (a dict: empty when
    nothing leaked; ``buffers`` counts live allocations) and ``held``, a HeldBuffer for each
    allocation still alive (descriptions only: the report keeps no buffer alive).
    ``describe()`` is the text to show a person."""

    def __init__(self, counts: dict, held: Iterable[HeldBuffer] = ()):
        super().__init__(counts)
        self.held = list(held)

    def describe(self) -> str:
        """The counters, then each held buffer with where it was allocated."""
        if not self:
            return "nothing leaked"
        lines = [", ".join(f"{key}: {value}" for key, value in self.items())]
        untracked = False
        for h in self.held:
            users = f", used by {h.users} pending operation(s)" if h.users else ""
            lines.append(f"{h.description}{users}")
            if h.allocated_at is None:
                untracked = True
                continue
            lines.append("  allocated at (most recent call last):")
            lines.extend("  " + line for line in "".join(h.allocated_at.format()).rstrip("\n").split("\n"))
        if untracked:
            lines.append(f"(where each buffer was allocated: set {TRACK_ALLOCS_ENV}=N, or "
                         f"Runtime.track_allocations = N, to record N frames of each allocation)")
        return "\n".join(lines)


def resolve_backend(backend: str | None) -> str | None:
    """The backend asked for (argument, else AIOGPU_BACKEND), or None for auto."""
    source = "backend argument"
    if not backend:
        backend, source = os.environ.get("AIOGPU_BACKEND") or None, "AIOGPU_BACKEND"
    if backend not in (None, "auto", *BACKENDS):
        raise ValueError(f"unknown backend {backend!r} ({source}); expected one of {', '.join(BACKENDS)} or auto")
    return None if backend == "auto" else backend


def backend_class(name: str) -> type["Runtime"]:
    """The Runtime subclass registered for backend ``name`` (imported now). BackendUnavailable
    when its module cannot be imported here (a missing optional dependency)."""
    module, cls = REGISTRY[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise BackendUnavailable(name, f"its module does not import ({exc})", FIXES.get(name, "")) from exc


def choose_backend(requested: str | None) -> tuple[str, str]:
    """(backend, why it was chosen) for ``requested`` (None: auto)."""
    if requested is not None:
        return requested, f"{requested} requested"
    ok, why_hsa = backend_class("hsa").probe()
    if ok:
        return "hsa", f"auto: {why_hsa}"
    ok, why_cuda = cuda_available()
    if ok:
        return "cuda", f"auto: no usable AMD GPU ({why_hsa}); {why_cuda}"
    return "emulator", f"auto: no usable GPU (HSA: {why_hsa}; CUDA: {why_cuda}); using the emulator"


def cuda_available() -> tuple[bool, str]:
    """Whether the CUDA backend can run here, and why not (never raises)."""
    try:
        return backend_class("cuda").probe()
    except BackendUnavailable as exc:
        return False, exc.reason


class Runtime(RuntimeState, RuntimeHooks):
    """A GPU runtime over one backend. ``close()`` waits for submitted work, then frees all.

    ``Runtime(backend=None, **options)`` returns an instance of the chosen backend's subclass.
    Options every backend takes: ``watchdog_s`` (fail work whose completion does not arrive in
    that many seconds once it could run; None: never), ``copy_engines`` (False: every copy is a
    shader copy), ``queues_per_device`` (compute queues/streams per device), ``spin_s`` (how long
    an await polls on the loop before parking). Backends add their own (``OPTIONS``); an unknown
    option raises TypeError, and so does a backend-specific one given to another backend.
    Raises BackendUnavailable when the backend asked for cannot run here.
    """

    backend: str = ""
    _chosen: tuple[str, str]
    OPTIONS: ClassVar[frozenset[str]] = frozenset({"watchdog_s", "copy_engines", "queues_per_device", "spin_s"})

    def __new__(cls, backend: str | None = None, **options: Any) -> Any:
        requested = resolve_backend(backend)
        if cls is Runtime:
            name, reason = choose_backend(requested)
            cls = backend_class(name)
        else:
            name, reason = cls._default_choice(requested)
        cls.check_options(name, options)
        self = super().__new__(cls)
        self._chosen = (name, reason)
        return self

    @classmethod
    def _default_choice(cls, requested: str | None) -> tuple[str, str]:
        """(backend, reason) when this subclass is constructed directly."""
        return requested or cls.backend, f"{requested or cls.backend} requested"

    @classmethod
    def check_options(cls, backend: str, options: dict) -> None:
        """TypeError naming every option ``backend`` does not take."""
        unknown = sorted(set(options) - cls.OPTIONS)
        if unknown:
            raise TypeError(f"the {backend} backend takes no option(s) {', '.join(map(repr, unknown))}; "
                            f"its options are {', '.join(sorted(cls.OPTIONS))}")


    @staticmethod
    def _check_shared_options(*, queues_per_device: Any, watchdog_s: Any, spin_s: Any,
                             copy_engines: Any) -> None:
        """The values of the options every backend takes, checked before anything starts:
        TypeError for a wrong type, ValueError for a value out of range (naming the option),
        and for a bad ``AIOGPU_TRACK_ALLOCS``."""
        allocation_frames()
        if isinstance(queues_per_device, bool) or not isinstance(queues_per_device, int):
            raise TypeError(f"queues_per_device must be an integer, got {queues_per_device!r}")
        if queues_per_device < 1:
            raise ValueError(f"queues_per_device must be positive, got {queues_per_device!r}")
        if watchdog_s is not None:
            _check_seconds("watchdog_s", watchdog_s, "positive (or None: no watchdog)", lambda v: v > 0)
        _check_seconds("spin_s", spin_s, "zero or positive", lambda v: v >= 0)
        if not isinstance(copy_engines, (bool, np.bool_)):
            raise TypeError(f"copy_engines must be True or False, got {copy_engines!r}")

    def _init_core(self, hub: FutureHub, *, copy_engines: bool) -> None:
        """State every backend has; call first in the subclass's ``__init__``."""
        self.backend, self.reason = self._chosen
        self.closed = False
        self.copy_engines = bool(copy_engines)
        self.shader_copies = 0            # copies run as the built-in copy kernel (stats)
        self.hub = hub
        hub.owner = self
        self.lock = hub.lock
        self.hazards = hazards.Hazards()
        self.devices: list[Device] = []
        self._graphs: weakref.WeakSet = weakref.WeakSet()
        self.pinned = PinnedPool(self._pin_host, self._unpin_host)
        self._deferred: set = set()       # deferred operations not submitted yet (deferred.py)
        self._replaying = 0               # > 0 while deferred work is being submitted
        self._compiler: Any = None        # the compile worker threads (created at first use)
        self._abandoning = False          # close gave up waiting: deferred work fails
        # Frames of each allocation's stack to record for leak reports (0: none; cheap to test).
        self.track_allocations = allocation_frames()

    # -- state ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        """Raise RuntimeClosedError once ``close()`` has begun."""
        if self.closed:
            raise RuntimeClosedError("the aiogpu runtime is closed")

    def _current_capture(self) -> Any:
        """The graph capturing this runtime's operations in this context, else None."""
        return None if _capture._active.get() is None else _capture.current(self)

    def _check_after(self, after: Any) -> list[GPUFuture]:
        """``after=`` as a list of this runtime's GPUFutures (TypeError/ValueError otherwise).
        A graph node is accepted only inside its capture. Another library's CUDA stream or
        event (``is_cuda_sync``) becomes ``stream_future(it)`` now: the work waits, on the
        device, for what was queued there before this call (NotOnCudaError off CUDA)."""
        if isinstance(after, (GPUFuture, _capture.GraphNode)) or is_cuda_sync(after):
            after = [after]
        try:
            items = list(after)
        except TypeError:
            raise TypeError(f"after= takes GPUFutures, got {after!r}") from None
        capture = None
        for i, f in enumerate(items):
            if not isinstance(f, GPUFuture):
                if isinstance(f, _capture.GraphNode):
                    capture = capture or self._current_capture()
                    if capture is None:
                        raise ValueError(f"{f!r} is a node of a captured graph; outside its capture, "
                                         f"wait for a replay's future instead")
                    continue
                if not is_cuda_sync(f):
                    raise TypeError(f"after= takes GPUFutures (or CUDA streams and events of torch or "
                                    f"CuPy), got {f!r}")
                items[i] = f = self.stream_future(f)
            if f._hub is not None and f._hub is not self.hub:
                raise ValueError(f"{f!r} belongs to another runtime")
        return items

    # -- other libraries' CUDA streams and events ------------------------------------------------
    def stream_future(self, stream: Any, *, device: Device | None = None) -> GPUFuture[None]:
        """See ``aiogpu.stream_future``."""
        if self._current_capture() is not None:
            raise ValueError("a graph cannot capture a wait on another library's stream or event; "
                             "await stream_future(...) before replaying, or pass it to the replay's work")
        with self.lock:
            self._check_open()
            return _submit.foreign(self, stream, device)

    def wait_on(self, fut: GPUFuture, stream: Any, *, device: Device | None = None) -> None:
        """See ``GPUFuture.wait_on``: the rule (what can wait) here, the driver calls in the
        backend's ``_wait_on``."""
        with self.lock:
            self._check_open()
            self._foreign_check(stream)
            got = fut._submitted_work()
            if got is None:
                raise InvalidStateError(f"{fut!r} is not submitted yet (its kernel is compiling): "
                                        f"await it, or await dev.load(kernel) before launching")
            if got._exc is not None:
                from .futures import mark_retrieved
                mark_retrieved(got._exc)
                raise got._exc
            if got.retired or got._hub is None:
                return                       # finished on the device: nothing to wait for
            self._wait_on(got, stream, device)

    # -- copies --------------------------------------------------------------------------------
    def copy(self, dst: Any, src: Any, after: Iterable[GPUFuture[Any]] = ()) -> GPUFuture[None]:
        """See ``aiogpu.copy``."""
        nbytes = self._check_copy(dst, src)
        after = self._check_after(after) if after else []
        if _capture._active.get() is not None:          # (_current_capture, inlined: per copy)
            capture = _capture.current(self)
            if capture is not None:
                if not all(isinstance(s, (Buffer, np.ndarray)) for s in (dst, src)):
                    raise TypeError("a graph captures copies of Buffers and NumPy arrays only")
                return capture.record_copy(dst, src, after)
        with self.lock:
            if self.closed:
                self._check_open()
            side = _copies.side
            d = side(self, dst, nbytes) if type(dst) is Buffer or type(dst) is np.ndarray \
                else self._side(dst, "dst", nbytes)
            s = side(self, src, nbytes) if type(src) is Buffer or type(src) is np.ndarray \
                else self._side(src, "src", nbytes)
            return _copies.submit(self, d, s, nbytes, after, [dst, src])

    def _copy_kernel_compile(self, op: CopyOp) -> Any:
        """The compile of the built-in copy kernel when ``op`` would run as a shader copy now
        and that kernel is not loaded on its device yet (None otherwise): the copy is then
        deferred behind it, as a launch is behind its kernel's compile, so comgr or NVRTC never
        runs on the event loop. (A copy an engine was expected to take but that falls back
        after all, or one submitted later behind deferred work, loads the kernel where it is
        submitted; the engines' own answer makes that rare.)"""
        dev = op.device
        if copy_kernel in dev._kernels:
            return None
        # (The engines' prediction first: cheaper than asking whether the kernel needs a
        # compile, and an engine takes nearly every copy.)
        if self.copy_engines and self._engine_may_take(op) or not self._shader_can_copy(op):
            return None
        compiling = dev._compiling.get(copy_kernel)
        if compiling is None and not dev._needs_compile(copy_kernel):
            return None              # loading it is fast (the emulator, a warm disk cache)
        if compiling is None:
            compiling = dev._start_compile(copy_kernel)
        return compiling if compiling is not None and (not compiling.done() or compiling._exc is not None) else None

    def _check_copy(self, dst: Any, src: Any) -> int:
        """Validate a copy's two sides before anything is submitted; returns the byte count."""
        if type(dst) is Buffer and type(src) is np.ndarray:
            # The common case, an upload from an array, when every check of the general path
            # below passes (any failure: that path raises its error, in its order).
            nbytes = _copies.plain_upload_bytes(self, dst, src, _HOST_DTYPES)
            if nbytes:
                return nbytes
        sizes = []
        for name, side in (("dst", dst), ("src", src)):
            if type(side) is Buffer:        # (Buffers have no subclasses: a type test is enough)
                side._check_usable()
                if side.device.runtime is not self:
                    raise ValueError(f"copy {name}: {side!r} belongs to another runtime")
                sizes.append(side.nbytes)
            elif isinstance(side, np.ndarray):
                if side.dtype not in _HOST_DTYPES:
                    host_dtype(side.dtype, f"copy {name}")
                    if len(_HOST_DTYPES) < 64:
                        _HOST_DTYPES.add(side.dtype)
                if not side.flags.c_contiguous:
                    raise ValueError(f"copy {name}: the NumPy array must be C-contiguous")
                if side.nbytes == 0:
                    raise ValueError(f"copy {name}: the array is empty")
                sizes.append(side.nbytes)
            else:
                info = self._foreign(side, f"copy {name}", name == "dst")
                if info is None:
                    raise TypeError(f"copy {name} must be a Buffer or a NumPy array{self._foreign_kinds}, "
                                    f"got {type(side).__name__}{self._refusal(side)}")
                sizes.append(info[1])
        if type(dst) is not Buffer and type(src) is not Buffer:
            if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
                raise TypeError("copy needs at least one Buffer (host-to-host copies are NumPy's job)")
            raise TypeError("copy needs at least one Buffer")
        if type(dst) is not Buffer and isinstance(dst, np.ndarray) and not dst.flags.writeable:
            raise ValueError("copy dst: the NumPy array is read-only")
        if sizes[0] != sizes[1]:
            raise ValueError(f"copy sizes differ: dst has {sizes[0]} bytes, src {sizes[1]}")
        return sizes[0]

    def _side(self, side: Any, name: str, nbytes: int) -> CopySide:
        """One side of a validated copy (``copies.side`` for Buffers and NumPy arrays; here
        another library's array)."""
        if type(side) is Buffer or isinstance(side, np.ndarray):
            return _copies.side(self, side, nbytes)
        info = self._foreign(side, f"copy {name}", name == "dst")
        assert info is not None                  # _check_copy accepted it as a foreign array
        ptr, nbytes, device, stream = info
        return CopySide(side, False, device, self.hazards.host(ptr, nbytes), ptr, stream)

    # Foreign device arrays (other libraries' memory) in copies: none by default.
    _foreign_kinds = ""

    def _refusal(self, obj: Any) -> str:
        """Why a foreign-looking object is refused here (an empty string for other objects)."""
        if hasattr(obj, "__cuda_array_interface__") or hasattr(obj, "__dlpack__"):
            return (f" (another library's array; the {self.backend} backend accepts those only as "
                    f"sources or destinations of aiogpu.copy on CUDA: copy it through a NumPy array)")
        return ""

    def _foreign_argument(self, device: Device, obj: Any, what: str, *, write: bool) -> Any:
        """Another library's array as a pointer argument of a launch on ``device`` (a
        ``device.Foreign``): ordered by its address range like host memory, after the work
        queued on its stream (CUDA: the ``__cuda_array_interface__`` stream, else the legacy
        default stream). TypeError where the backend takes none, ValueError for one elsewhere."""
        from .device import Foreign

        info = self._foreign(obj, what, write)
        if info is None:
            raise TypeError(f"{what} must be a Buffer{self._foreign_kinds}, got "
                            f"{type(obj).__name__}{self._refusal(obj)}")
        ptr, nbytes, dev, stream = info
        if dev is not device:
            raise ValueError(f"{what}: the {type(obj).__name__} is on {dev.name}, not on {device.name}")
        return Foreign(obj, ptr, nbytes, self.hazards.host(ptr, nbytes), stream)

    # -- fills ---------------------------------------------------------------------------------
    def fill(self, buf: Buffer, value: int, after: Iterable[GPUFuture[Any]] = ()) -> GPUFuture[None]:
        """See ``Buffer.fill``: ``value`` repeated as a 32-bit word over the buffer."""
        word = _fill_word(value)
        if not isinstance(buf, Buffer):
            raise TypeError(f"fill takes a Buffer, got {type(buf).__name__}")
        buf._check_usable()
        if buf.nbytes % 4 or buf.offset % 4:
            raise ValueError(f"fill writes 32-bit words; {buf!r} does not start and end on 4-byte "
                             f"boundaries")
        after = self._check_after(after)
        dev = buf.device
        capture = self._current_capture()
        if capture is not None:
            from .kernels import fill_kernel
            return capture.record_launch(dev, fill_kernel, dev._fill_grid(buf.nbytes // 4), (256,),
                                         (buf, word, buf.nbytes // 4), after)
        with self.lock:
            self._check_open()
            return _submit.guarded(self, dev, f"fill {buf.nbytes} B", [], [buf], after,
                                   lambda deps: _submit.fill(self, dev, buf, word, deps))

    # -- joins ---------------------------------------------------------------------------------
    def gather(self, futures: Iterable[GPUFuture[Any]]) -> GPUFuture[None]:
        """One future for all of ``futures`` (a join on the device where possible). It settles
        once every member has settled and the device is done with its work (as trio's nurseries
        and anyio's task groups wait for every child, unlike ``asyncio.gather``), then fails
        with the error of the first member, in argument order, that failed."""
        futures = self._check_after(list(futures))
        capture = self._current_capture()
        if capture is not None:
            return capture.record_gather(futures)
        with self.lock:
            self._check_open()
            live = [f for f in futures if not f.retired]
            if not live:
                err = next((f._exc for f in futures if f._exc is not None), None)
                return completed_future(self.hub, "gather", err)
            device = next((f.device for f in live if f.device is not None), self.devices[0])
            # Ordering edges only: a member's failure must not settle the join early.
            fut: GPUFuture
            deps, blockers = deferred.resolve({f: False for f in live})
            with self.hub.settling_under_lock():     # (the join must not settle before its members are set)
                if blockers:
                    fut = deferred.defer(self, device, f"gather of {len(live)}", [], [], deps, lambda d: _submit.join(
                        self, device, [f for f in d if not f.retired], d), blockers=blockers)
                else:
                    fut = _submit.join(self, device, list(deps), deps)
                if fut.members is None and not fut.done():
                    fut.members = futures
            return fut

    # -- graphs ----------------------------------------------------------------------------------
    def instantiate(self, graph: Any) -> Any:
        """The executable of a captured ``graph`` (``Graph.instantiate`` calls this)."""
        with self.lock:
            self._check_open()
            exe = self._instantiate(graph)
            self._graphs.add(exe)
            return exe

    # -- hooks with a default (see backend.RuntimeHooks) ---------------------------------------------
    def _host_pinned(self, array: np.ndarray) -> bool:
        """Whether copies can use ``array`` where it is, with no pinning or staging: it lies in
        the runtime's pinned pool (backends add memory they keep registered)."""
        return self.pinned.device_pointer(array.__array_interface__["data"][0], array.nbytes) is not None

    def describe(self) -> str:
        """What ``python -m aiogpu info`` prints: the backend, why, every device and lane."""
        return f"backend: {self.backend}\nreason:  {self.reason}"

    # -- stats and leaks -------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters; those of ``LEAK_KEYS`` and the allocation counts return to zero when no
        work is pending and no buffer is held."""
        self.hub.poll()
        with self.lock:
            if not self.closed:
                for d in self.devices:
                    d.memory.drain()      # buffers dropped since (by a collection, say)
            out = {key: 0 for key in LEAK_KEYS}
            out.update(pending=self.hub.pending_count, host_ranges=self.hazards.host_ranges,
                       deferred=len(self._deferred),
                       small_allocations=sum(d.memory.small.used for d in self.devices),
                       large_allocations=sum(len(d.memory.large) for d in self.devices),
                       cached_bytes=sum(d.memory.cached_bytes for d in self.devices),
                       pinned_blocks=self.pinned.blocks_in_use)
            out.update(self._backend_stats())
            return out

    def leaks(self, timeout: float = 10.0, *, buffers: bool = True) -> Leaks:
        """What is still held once pending work has settled: waits up to ``timeout`` s for
        pending work (operations, and buffers that unretired work still uses), never for
        buffers a program merely holds, which are reported at once. Returns a Leaks: a dict of
        the non-zero counters of ``LEAK_KEYS`` and, when ``buffers``, ``buffers`` (live
        allocations, after a garbage collection) with each one described in ``held`` (where it
        was allocated when ``track_allocations`` is on). An empty dict means nothing leaked.
        The one leak check of the pytest plugin, the test suite and ``python -m aiogpu stress``.

        For synchronous code and threads: on the thread of a running event loop (asyncio,
        uvloop, trio) it raises BlockingCallError instead of stalling the loop; ``await
        leaks_async()`` there."""
        if _loops.current_port() is not None:
            raise BlockingCallError("Runtime.leaks() would block the running event loop while work is "
                                    "pending; `await rt.leaks_async()` instead (or call leaks() from "
                                    "another thread)")
        deadline = time.monotonic() + timeout
        while True:
            found = self._leak_check(buffers, time.monotonic() > deadline)
            if found is not None:
                return found
            time.sleep(0.005)

    async def leaks_async(self, timeout: float = 10.0, *, buffers: bool = True) -> Leaks:
        """``leaks()`` for a coroutine (asyncio, uvloop or trio): the same report, waiting for
        pending work without blocking the loop."""
        import anyio

        deadline = time.monotonic() + timeout
        while True:
            found = self._leak_check(buffers, time.monotonic() > deadline)
            if found is not None:
                return found
            await anyio.sleep(0.005)

    def _leak_check(self, buffers: bool, last: bool) -> Leaks | None:
        """One look for ``leaks``: the report, or None while work is pending (unless ``last``:
        then what is held, pending work included)."""
        stats = self.stats()
        if not last and any(stats[k] for k in LEAK_KEYS):
            return None
        found = {k: stats[k] for k in LEAK_KEYS if stats[k]}
        held: list[HeldBuffer] = []
        if buffers:
            gc.collect()          # buffers nobody references any more go back at a collection
            stats = self.stats()
            count = stats["small_allocations"] + stats["large_allocations"]
            if count:
                with self.lock:   # (retirement runs under it: no buffer is seen half-released)
                    held = self._held_buffers()
                if not last and any(h.users for h in held):
                    return None   # work retiring late (a failed write's predecessors) lets go later
                found["buffers"] = count
        return Leaks(found, held)

    def _held_buffers(self) -> list[HeldBuffer]:
        """Every live allocation of this runtime's devices, found among the objects the garbage
        collector tracks (a leak report's cost: nothing is registered per allocation)."""
        out = []
        for obj in gc.get_objects():
            if type(obj) is Buffer and obj._base is None and obj._owns() \
                    and getattr(obj.device, "runtime", None) is self:
                out.append(HeldBuffer(repr(obj), obj.nbytes, obj.device.name, obj.address, obj.users,
                                      obj.allocated_at))
        out.sort(key=lambda h: (h.device, h.address))
        return out

    # -- shutdown ------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Wait (up to ``timeout`` s) for submitted work, then release every resource.

        Returns about ``timeout`` s after the call at the latest. Work still pending then is
        abandoned, as ``concurrent.futures.Executor.shutdown(cancel_futures=True)`` abandons
        queued work: its futures fail with a GPUError that says so (awaiters wake; nothing
        hangs), and the driver resources it may still use are released in the background once
        the device is done with them. Idempotent; later operations raise RuntimeClosedError."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        deadline = time.monotonic() + timeout
        # The deferred set first: deferred work leaves it only once submitted (deferred._run).
        while (self._deferred or self.hub.pending_count) and time.monotonic() < deadline:
            self.hub.poll()
            if self._deferred or self.hub.pending_count:
                time.sleep(0.002)
        with self.lock:
            self._abandoning = True
            deferred.abandon(self, timeout)
            abandoned = self._abandon_pending(timeout)
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
        self.hub.stop()
        if abandoned:
            threading.Thread(target=self._shutdown, name="aiogpu-close", daemon=True).start()
        else:
            self._shutdown()

    def _compile_in_background(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on one of the runtime's compile worker threads (two; created at first
        use, so that two kernels compile at once while the event loop runs on)."""
        if self._compiler is None:
            import concurrent.futures
            self._compiler = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="aiogpu-compile")
        self._compiler.submit(fn)

    def _abandon_pending(self, timeout: float) -> int:
        """Fail every future still pending at close (under the lock); how many were pending."""
        pending = self.hub.pending_futures()
        for fut in pending:
            if not fut.done():
                self.hub.fail(fut, GPUError(f"{fut.label}: abandoned: the runtime was closed before it "
                                            f"completed (close timeout {timeout:g} s)",
                                            queue=fut.queue, packet=fut.packet))
        return len(pending)

    def _shutdown(self) -> None:
        """Destroy graph executables and release the backend (the waiter has stopped; the
        runtime is closed, so nothing else touches the driver objects: no lock is held, and a
        release that waits for the device blocks nobody)."""
        for exe in list(self._graphs):
            exe.destroy()
        self.pinned.close()
        self._release()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.backend}: {len(self.devices)} GPU(s)>"


def is_cuda_sync(obj: Any) -> bool:
    """Whether ``obj`` looks like another library's CUDA stream or event (torch, CuPy,
    cuda-bindings), by duck typing: no library is imported."""
    if hasattr(obj, "cuda_stream") or hasattr(obj, "cuda_event"):
        return True
    cls = type(obj)
    module, name = cls.__module__ or "", cls.__name__
    if module.startswith("cupy") and ("Stream" in name or "Event" in name):
        return True
    return module.startswith("cuda") and name in ("CUstream", "CUevent")


def _check_seconds(name: str, value: Any, wanted: str, ok: Callable[[float], bool]) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if not ok(float(value)):          # (NaN fails every comparison)
        raise ValueError(f"{name} must be {wanted}, got {value!r}")


def _fill_word(value: Any) -> int:
    """A fill value as the 32-bit word written (signed or unsigned 32-bit integers)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"fill takes a 32-bit integer word, got {value!r}; to fill with floats, "
                        f"fill with their bit pattern (e.g. np.float32(x).view(np.uint32))")
    if not -(1 << 31) <= int(value) < (1 << 32):
        raise ValueError(f"fill value {value} does not fit in 32 bits")
    return int(value) & 0xFFFFFFFF


_default: Runtime | None = None
_default_lock = threading.Lock()


def runtime(backend: str | None = None) -> Runtime:
    """The process-wide default runtime (created on first use: ``backend`` or AIOGPU_BACKEND,
    else a real GPU if one answers, else the emulator)."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = Runtime(backend)
        elif backend is not None and backend != _default.backend:
            raise ValueError(f"the default runtime already uses {_default.backend!r}, not {backend!r}")
        return _default
