"""The CUDA backend's per-operation code, compiled where a compiler exists (``encode.pxd``):
lanes (a stream, its completion word and the futures pending on it, in ticket order), kernels
loaded with their argument packing, the launch encode and the device-side waits; and the
thread's current context (``make_current``), which every launch tests.

It imports no driver at import time: a lane keeps the driver's hot path (``driver.HOT``) it
was made with, and the rare calls (creating and destroying streams) import the driver then.
So this module loads, compiled or not, where cuda-bindings is missing (``aiogpu info`` imports
every compiled module)."""
from __future__ import annotations

import ctypes
import itertools
import struct
import threading
from collections import deque
from typing import Any, Sequence

from .._core.state import DeviceState

try:
    import cython  # type: ignore[import-untyped,import-not-found,unused-ignore]
except ImportError:            # interpreted, where Cython is not installed (see _core/interrupts.py)
    globals()["cython"] = type("cython", (), {"compiled": False})
# The context current on each thread, as (context handle, generation) (``make_current``).
_tls = threading.local()
_generation = [0]
if not cython.compiled:
    # Compiled, the .pxd's C function of that name: the calling thread's state's identifier
    # (PyThreadState_GetID), never reused in the process, unlike a thread's identifier
    # (threading.get_ident), which a new thread takes over from one that ended.
    _thread_ids = itertools.count(1)

    def thread_state_id() -> int:
        try:
            return _tls.id
        except AttributeError:
            _tls.id = me = next(_thread_ids)
            return me

    # The .pxd's C functions of a lane's own driver calls (``Lane.direct``, never true here).
    set_direct: Any = None
    direct_launch: Any = None
    direct_write64: Any = None
    direct_wait64: Any = None
    pack_direct: Any = None

# How many launches in a row a lane may leave its completion word to a later write
# (``Lane.lazy``): the write is a driver call per launch (about 0.8 us on an H100), and a stream
# runs in order, so one write covers every ticket before it.
LAZY_LAUNCHES = 16
# Launches awaited one by one write the word at once (``Lane.eager``): an await that comes
# after at most this many launches of its lane since the last awaited one.
EAGER_GAP = 2

# The thread that made a context current last, and that context's device (``make_current``):
# a launch from that thread on that device needs no look at the thread-local record. (Any other
# thread, or device, takes the look; ``forget_current`` clears it.) One pair, which only its
# own thread writes: interpreted, a thread running between the two stores sees another
# thread's identifier, a miss. (With a second pair, say for the waiter thread, a thread
# updating both would store the other thread's pair, which may be stale by then.)
_last_thread = 0
_last_device: Any = None


def make_current(device: Any) -> int:
    """Make ``device``'s context current on this thread, unless it already is in this
    generation (closing a runtime starts a new one, since a released primary context may come
    back): the thread-local record decides, and the driver is called only where it differs."""
    global _last_thread, _last_device
    me = thread_state_id()
    if me == _last_thread and device is _last_device:
        return 0
    key = (device.ctx_handle, _generation[0])
    if getattr(_tls, "ctx", None) != key:
        from . import driver as D             # (rare: a thread's first call, or a new generation)
        D.set_current(device.ctx)
        _tls.ctx = key
    _last_thread, _last_device = me, device
    return 0


def forget_current() -> int:
    """Every thread sets its context again before its next call (``driver.forget_current``)."""
    global _last_thread, _last_device
    _generation[0] += 1
    _last_thread, _last_device = 0, None
    return 0


class Lane:
    """One CUDA stream of a device, its completion word and pending futures (ticket order).

    ``spin`` is this lane's adaptive spin window (seconds); ``rate`` the copy bandwidth it has
    shown (bytes/s, None until learned), from which an awaiter of a long copy predicts when to
    start spinning. ``sh`` and ``wordp`` are the stream handle and the word's device pointer as
    ints (0 without a word), the hot path's handles; ``hot`` the hot path itself
    (``driver.HOT`` when the lane was made) and ``wait_geq`` its "word >= ticket" wait flag.

    ``fused_word`` decides, once per lane, how a launch or copy on it completes: the word's
    pointer where the launch or copy call itself writes the ticket there after its work
    (``HotPath.launch``/``memcpy`` with ``word``: one C call on the C hot path), or 0 where
    the submission writes the word itself or records an event: the lane has no word (events),
    or the runtime records an event per operation (``event_waits``), which goes between the
    work and the word. ``CudaRuntime._encode_on_lane`` applies it, to operations that are one
    launch or copy call (``fusable``); the rest get the separate write.

    ``lazy``: a plain launch (``launch_on_lane``) on a lane with a fused word writes no word
    unless ``lazy`` tickets have gone unwritten (0: every launch writes it). ``written`` is the
    newest ticket whose write is queued: the word reaches a ticket when any later write lands,
    and whoever needs a ticket that is not covered yet (an await's spin, ``done()``, a parked
    awaiter's wake-up, a wait of another lane or library on the device) covers it first
    (``flush_word``), which writes the lane's newest ticket after the lane's current work. The
    waiter's scan needs no word: beyond it, it queries the stream. The cost: such a ticket is
    seen complete only after the work queued behind it before the demand. Lanes of a runtime
    with a watchdog write every ticket (it reads the word to tell work done from work stuck).
    ``eager``: while the lane's launches are awaited one by one (``awaited``), each writes the
    word at once: a write queued at the await would reach a device that has gone idle, which
    costs the await the device's pick-up of a new command (about 2.5 us on an H100, more than
    the write saves). ``demanded`` is the lane's ticket at the last awaited launch.

    ``direct``: compiled, where the hot path gives its entry points (``HotPath.direct``), the
    lane's launch, copy and cross-lane wait call them itself, in C, with the same arguments and
    results as the hot path's methods; otherwise, and always interpreted, they call the methods.
    ``use_hot`` sets both."""

    __slots__ = ("name", "device", "stream", "ticket", "armed", "wanted", "pending", "kind", "word", "dptr",
                 "spin", "rate", "sh", "wordp", "fused_word", "hot", "wait_geq", "direct", "written", "lazy", "eager",
                 "demanded")

    def __init__(self, device: Any, name: str, kind: str, *, priority: int = 0):
        from . import driver as D
        from .driver import cu
        device.make_current()
        stream = D.check(cu.cuStreamCreateWithPriority(D.STREAM_NON_BLOCKING, priority), f"cuStreamCreate({name})")
        try:
            self._attach(device, name, kind, stream)
        except BaseException:          # (its completion word could not be made)
            cu.cuStreamDestroy(stream)
            raise

    def _attach(self, device: Any, name: str, kind: str, stream: Any) -> None:
        from . import driver as D
        self.use_hot(D.HOT)              # (the hot path the runtime was made with)
        self.wait_geq = D.WAIT_GEQ
        self.device, self.name, self.kind = device, name, kind
        self.stream = stream
        self.sh = int(stream)
        self.ticket = 0          # operations submitted so far
        self.written = 0         # the newest ticket whose word write is queued
        self.eager = False       # launches write the word at once (awaited one by one)
        self.demanded = 0        # the lane's ticket when a launch of it was last awaited
        self.armed = 0           # a host-function wake-up is queued after this ticket
        self.wanted = 0          # a parked ticket the waiter is to arm for (``lanehub._wake_for``)
        self.pending: deque = deque()
        self.spin = device.runtime.hub.spin_s
        self.rate: float | None = None
        self.word = self.dptr = None
        self.wordp = 0
        if device.words is not None:
            host, self.dptr = device.words.slot()
            self.word = ctypes.c_uint64.from_address(host)
            self.wordp = int(self.dptr)
        self.fused_word = 0 if device.runtime.event_waits else self.wordp
        self.lazy = LAZY_LAUNCHES if self.fused_word and device.runtime.hub.watchdog_s is None else 0

    def use_hot(self, hot: Any) -> None:
        """Make the lane's driver calls through ``hot`` (a ``driver.HotPath``) from now on."""
        self.hot = hot
        self.direct = False
        if cython.compiled:
            set_direct(self, hot.direct)

    @property
    def handle(self) -> int:
        return int(self.stream)

    def done_upto(self) -> int:
        """The last ticket known complete from the word (0 without a word)."""
        return self.word.value if self.word is not None else 0

    def arm(self, fn: int, data: int) -> int:
        """Queue the host function ``fn(data)`` after the lane's current work (a wake-up), after
        the word covers that work (``flush_word``)."""
        return flush_word(self, self.ticket) or self.hot.host_func(self.sh, fn, data)

    def destroy(self) -> None:
        from .driver import cu
        if self.stream is not None:
            cu.cuStreamDestroy(self.stream)
            self.stream = None

    def __repr__(self) -> str:
        return f"<Lane {self.name} ticket={self.ticket} pending={len(self.pending)}>"


class ForeignLane(Lane):
    """Another library's CUDA stream (torch, CuPy, a raw handle) as a lane of ``device``.

    A future for it (``aiogpu.stream_future``) is one write of the lane's completion word queued
    on that stream (``cuStreamWriteValue64``, the only thing aiogpu adds to it; a pooled event
    where the device has no stream memory operations). Such futures complete in stream order, as
    a lane's do, so the spin and the waiter settle them like any lane's: the spin reads the word
    (a memory load, no ``cuEventQuery``), and a completion seen by the spin is settled off the
    loop. A parked awaiter is woken through a stream of aiogpu's own (``arm_stream``, created at
    the first park) that waits for the newest ticket (or event) and then runs the wake-up host
    function: nothing is queued on the library's stream that would delay its later work.
    A lane is kept per stream handle for the runtime's life; a stream destroyed while futures of
    it are pending is not supported (its handle may be reused by a new stream)."""

    __slots__ = ("arm_stream",)

    def __init__(self, device: Any, handle: int):
        from .driver import cu
        # Its stream is the library's; the completion word, as a Lane's, is written after each
        # future's point.
        self._attach(device, f"{device.name}.stream{handle:#x}", "foreign", cu.CUstream(handle))
        self.arm_stream: Any = None

    def arm(self, fn: int, data: int) -> int:
        newest = self.pending[-1] if self.pending else None
        if newest is None or newest.retired or (newest.event is None and self.dptr is None):
            return 0
        from . import driver as D
        from .driver import cu
        if self.arm_stream is None:
            self.device.make_current()
            err, stream = cu.cuStreamCreate(D.STREAM_NON_BLOCKING)
            if err != 0:
                return int(err)
            self.arm_stream = stream
        hot, arm = self.hot, int(self.arm_stream)
        if newest.event is not None:
            code = hot.wait_event(arm, newest.event)
        else:
            code = hot.wait64(arm, self.wordp, newest.ticket, self.wait_geq)
        return int(code) or hot.host_func(arm, fn, data)

    def destroy(self) -> None:
        from .driver import cu
        if self.arm_stream is not None:
            cu.cuStreamDestroy(self.arm_stream)
            self.arm_stream = None

    def __repr__(self) -> str:
        return f"<ForeignLane {self.name} ticket={self.ticket} pending={len(self.pending)}>"


def wait_on_device(lane: Lane, waits: Any) -> int:
    """Make ``lane`` wait, on the device, for the futures ``waits``: one wait per other lane (its
    newest dependency suffices: lanes run in order), none for work its lane's word already
    shows done; ``cuStreamWaitValue64`` on the other lane's word, or ``cuStreamWaitEvent`` where
    it recorded an event. The first failing call's CUresult, else 0."""
    newest: dict = {}
    for dep in waits:
        if dep.lane is None or dep.lane is lane:
            continue
        other = dep.lane
        cur = newest.get(other)
        if cur is None or dep.ticket > cur.ticket:
            newest[other] = dep
    if not newest:
        return 0
    hot, stream = lane.hot, lane.sh
    for dep in newest.values():
        other = dep.lane
        if dep.ticket > (other.word.value if other.word is not None else 0):
            if dep.event is not None:
                code = hot.wait_event(stream, dep.event)
            else:
                if dep.ticket > other.written:          # (its launches left the word behind)
                    code = flush_word(other, dep.ticket)
                    if code:
                        return code
                    make_current(lane.device)
                if cython.compiled and lane.direct:
                    code = direct_wait64(lane, other.wordp, dep.ticket)
                else:
                    code = hot.wait64(stream, other.wordp, dep.ticket, lane.wait_geq)
            if code:
                return code
    return 0


def awaited(lane: Lane, fut: Any) -> int:
    """Someone awaits ``fut``, work on ``lane``: a launch awaited after at most ``EAGER_GAP``
    launches of the lane since the last awaited one makes its launches write the word at once
    (``Lane.eager``); one awaited after more (a burst, then its last awaited) leaves them lazy
    again. Other work (a copy, which writes its word itself) changes nothing."""
    gap = lane.ticket - lane.demanded
    if lane.lazy and gap and fut.kind == "dispatch":   # (gap 0: this await's second look)
        lane.eager = gap <= EAGER_GAP
        lane.demanded = lane.ticket
    return 0


def flush_word(lane: Lane, ticket: int) -> int:
    """Make ``lane``'s completion word reach ``ticket`` (submitted on it): where its launches
    left the word behind (``Lane.lazy``), queue the write of the lane's newest ticket after its
    current work, in the lane's device's context; nothing for a lane without a word. Under the
    runtime lock (its plain lock suffices). Returns the CUresult (0: written, or queued to be)."""
    if ticket <= lane.written or not lane.wordp or lane.stream is None:
        return 0                      # (covered already; a lane of events; a closed one)
    make_current(lane.device)
    newest = lane.ticket
    if cython.compiled and lane.direct:
        code = direct_write64(lane, newest)
    else:
        code = lane.hot.write64(lane.sh, lane.wordp, newest)
    if not code:
        lane.written = newest
    return code


_FORMATS = {"f32": "f", "f64": "d", "i8": "b", "i16": "h", "i32": "i", "i64": "q",
            "u8": "B", "u16": "H", "u32": "I", "u64": "Q"}


class LoadedCudaKernel:
    """A kernel loaded in one context, with its argument packing prepared once.

    Each argument sits at its natural C alignment in one parameter block; ``kernelParams`` is an
    array of pointers into it. The driver copies the values during ``cuLaunchKernel``, so the
    block is reused by every launch (under the runtime lock)."""

    def __init__(self, kernel: Kernel, func: Any, module: Any):
        self.kernel, self.func, self.module = kernel, func, module
        self.handle = int(func)     # the CUfunction as an int, the hot path's handle
        self.writes = kernel.writes
        fmt, offsets, self.size = layout(kernel.args)
        self.fmt, self.offsets = fmt, tuple(offsets)
        # (each argument's struct format character, for the compiled pack: ``pack_direct``)
        self.kinds = "".join(c for c in fmt[1:] if c != "x").encode("ascii")
        self._block = ctypes.create_string_buffer(max(self.size, 8))
        self.base = base = ctypes.addressof(self._block)
        self._ptrs = (ctypes.c_void_p * max(len(self.offsets), 1))(*[base + o for o in self.offsets])
        self.params = ctypes.addressof(self._ptrs) if self.offsets else 0
        self._pack = struct.Struct(self.fmt).pack_into
        # The CUDA geometry of the last (grid, block) launched (``launch_on_lane``).
        self.grid = self.block = None
        self.gx = self.gy = self.gz = self.bx = self.by = self.bz = 0

    def pack(self, values: Sequence[Any]) -> int:
        """Write ``values`` into the shared block; the ``kernelParams`` address."""
        if self.offsets:
            if cython.compiled:
                pack_direct(self, values)
            else:
                self._pack(self._block, 0, *values)
        return self.params

    def packed_copy(self, values: Sequence[Any]) -> tuple[int, list]:
        """A private parameter block (for graph nodes): (kernelParams address, keep-alive)."""
        block = ctypes.create_string_buffer(max(self.size, 8))
        if self.offsets:
            struct.pack_into(self.fmt, block, 0, *values)
        base = ctypes.addressof(block)
        ptrs = (ctypes.c_void_p * max(len(self.offsets), 1))(*[base + o for o in self.offsets])
        return (ctypes.addressof(ptrs) if self.offsets else 0), [block, ptrs]


def layout(args: tuple) -> tuple[str, list[int], int]:
    """struct format (with padding), offsets and size of a parameter block."""
    fmt, offsets, off = "<", [], 0
    for a in args:
        size = 8 if a.pointer else a.dtype.itemsize
        pad = (-off) % size
        fmt += "x" * pad
        off += pad
        offsets.append(off)
        fmt += "Q" if a.pointer else _FORMATS[a.type_name]
        off += size
    return fmt, offsets, off


def encode_kernel(device: Any, fut: Any, lane: Lane, loaded: LoadedCudaKernel, grid: tuple, block: tuple,
                  values: Sequence, lengths: Sequence, waits: Sequence, cleanup: list, copy: Any = None,
                  foreign: Sequence = ()) -> tuple:
    """``CudaDevice._encode_kernel`` (the hook: ``aiogpu.backend.DeviceHooks``): one
    ``cuLaunchKernel`` on ``lane`` after ``waits``, under the runtime lock, through
    ``HotPath.launch``, which writes the lane's completion word too where the lane fuses it
    (``Lane.fused_word``). A launch that is only a launch is encoded here
    (``launch_on_lane``); a shader copy or a launch after other libraries' streams goes through
    ``CudaDevice._encode_kernel_with``."""
    if copy is None and not foreign:
        launch_on_lane(device, fut, lane, loaded, grid, block, values, waits, cleanup)
        return ()
    return device._encode_kernel_with(fut, lane, loaded, grid, block, values, waits, cleanup, copy, foreign)


def bind(device: Any) -> None:
    """Compiled: ``device``'s launch encode becomes this module's C function, which the core then
    calls as a C function (``aiogpu._core.state``); interpreted, its method stays the hook."""
    if cython.compiled:
        state: DeviceState = device
        state._encode_kernel_c = _encode_kernel_c


def _encode_kernel_c(device: Any, fut: Any, lane: Any, loaded: Any, grid: Any, block: Any, values: Any,
                     lengths: Any, waits: Any, cleanup: list, copy: Any, foreign: Any) -> Any:
    return encode_kernel(device, fut, lane, loaded, grid, block, values, lengths, waits, cleanup, copy, foreign)


def launch_on_lane(device: Any, fut: Any, lane: Lane, loaded: LoadedCudaKernel, grid: tuple, block: tuple,
                   values: Sequence, waits: Sequence, cleanup: list) -> None:
    """``CudaDevice._encode_kernel`` of a launch that is only a launch (no shader copy, no other
    library's streams), under the runtime lock: the device-side ``waits``, then one
    ``HotPath.launch`` that also writes the lane's completion word where the lane fuses it
    (``Lane.fused_word``) and the lane does not leave it to a later write (``Lane.lazy``), then
    the lane's completion of ``fut`` (``CudaRuntime._completed_on_lane``, inlined for a launch
    that wrote the word or left it behind). Raises ValueError for a grid the device cannot
    launch and CudaError where a call failed (nothing then completes ``fut``)."""
    if grid is not loaded.grid or block is not loaded.block:
        # (a service launches one shape again and again: the same tuples, from the shape cache)
        (gx, gy, gz), (bx, by, bz) = device.blocks(grid, block)
        loaded.gx, loaded.gy, loaded.gz, loaded.bx, loaded.by, loaded.bz = gx, gy, gz, bx, by, bz
        loaded.grid, loaded.block = grid, block
    loaded.pack(values)
    code = enter_lane(device, lane, waits)
    word = lane.fused_word
    ticket = lane.ticket + 1
    # (the word written only once ``lazy`` tickets went unwritten: ``Lane.lazy``)
    write = word if lane.eager or ticket - lane.written >= lane.lazy else 0
    if code:
        pass
    elif cython.compiled and lane.direct:
        code = direct_launch(lane, loaded, write, ticket if write else 0)
    else:
        code = lane.hot.launch(loaded.handle, loaded.gx, loaded.gy, loaded.gz, loaded.bx, loaded.by, loaded.bz, 0,
                               lane.sh, loaded.params, write, ticket if write else 0)
    lane_completes(device.runtime, fut, lane, cleanup, code, word, ticket, write != 0)


def enter_lane(device: Any, lane: Lane, waits: Any) -> int:
    """Before a launch or copy on ``lane`` of ``device``: the device's context made current on
    this thread (``make_current``), then the device-side ``waits``. Returns their CUresult
    (0: queued)."""
    make_current(device)
    return wait_on_device(lane, waits) if waits else 0


def lane_completes(runtime: Any, fut: Any, lane: Lane, cleanup: list, code: int, word: Any, ticket: int,
                   wrote: bool = True) -> None:
    """After one launch or memcpy on ``lane`` returned ``code`` (``word``: the lane's fused word,
    to which the call wrote ``ticket`` after its work, or, ``wrote`` false, left that to a later
    write: ``Lane.lazy``): ``fut`` becomes the lane's ``ticket`` at once when the call was
    given the word and succeeded; else ``CudaRuntime._completed_on_lane`` records the event or
    writes the word, or raises CudaError for a failed call (nothing then completes ``fut``)."""
    if code or not word:
        runtime._completed_on_lane(fut, lane, cleanup, code, word)
        return
    lane.ticket = ticket
    if wrote:
        lane.written = ticket
    fut.lane = lane
    fut.ticket = ticket
    fut.queue = lane.name
    fut.packet = ticket
