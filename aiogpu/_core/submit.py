"""Submission: a validated operation -> dependencies -> failed inputs -> deferral -> lane ->
the backend's encode -> track -> watch. Every backend's operations go through here, once.

The layers above validate (the messages users see) and hand over what an operation reads and
writes, what it must follow (``after=``) and what to encode; the backend only encodes on the
lane it is given (``aiogpu/backend.py``). Everything a future holds until it retires is
recorded here: hazards (``hazards.record``), the buffers it uses, the dependents that fail with
it, the completion keys its packets name, the cleanup that runs once it has retired.

All of it runs under the runtime's lock.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from . import hazards
from . import deferred
from ..errors import GPUError
from ..kernels import copy_kernel, fill_kernel
from .futures import PENDING, GPUFuture, add_preds, completed_future
from .hazards import BufferState, dependencies, failed_dependency, record
from .state import encode_kernel

# The shared empty sequence: the waits of an operation with no dependency, and the lengths,
# reads and writes of a launch that touches no memory (encoders and the bookkeeping only read them).
_EMPTY: tuple = ()
# Pending futures at which a loop that awaits stops leaving their retirement to the waiter
# thread (its submissions reap, and so may a backend's spin): batches this big cost little per
# future, and what a request held still dies young (before a garbage collection promotes it).
REAP_AT = 32
# ... and at which a loop that only submits does (the waiter retires bigger batches for less,
# so it is left the work while it keeps this close).
REAP_MAX = 1024


def guarded(rt: Any, device: Any, label: str, reads: list, writes: list, after: list,
            submit: Callable[[dict], GPUFuture], compile: Any = None,
            deferred_rw: tuple[list, list] | None = None) -> GPUFuture:
    """The dependencies of an operation (hazards on ``reads``/``writes`` plus ``after``);
    a failed input or a broken device fails it without submitting anything, else
    ``submit(deps)`` submits it: now, or, when ``compile`` (its kernel's compile) is still
    running or a dependency is deferred work not submitted yet, once they are (the operation
    is deferred: see ``deferred.py``). ``deferred_rw``, when given, is the (reads, writes) to
    record instead if it is deferred: what orders an operation submitted now may be less (a
    host source staged now is no reader; fresh memory has no history)."""
    # A broken device first: work offered to a lost device is lost, failed inputs or not.
    err: GPUError | None
    if device.broken is not None:
        deps, err = {}, hazards.broken_error(label, device.broken)
    elif reads or writes or after:
        deps = dependencies(reads, writes, after)
        err = failed_dependency(deps) if deps else None
    else:                                     # the fast path: nothing to order after
        deps, err = {}, None
    if err is not None:
        return hazards.failed_without_running(rt.hub, label, err, writes)
    if compile is not None or deps and any_deferred(deps):   # (deferred work: its submitted work)
        resolved, blockers = deferred.resolve(deps)
        if blockers or compile is not None:
            if deferred_rw is not None:
                reads, writes = deferred_rw
            return deferred.defer(rt, device, label, reads, writes, deps, submit, compile, blockers)
        deps = resolved
    return submit(deps)


# -- lanes ---------------------------------------------------------------------------------------
class LaneOrder:
    """A device's compute lanes in the order the lane choice tries them (``pick_lane``):
    round-robin from ``next``; ``balances_load``: the backend tells each lane's load
    (``_lane_load``), else every lane reads idle and the order alone decides."""

    def __init__(self, lanes: list, balances_load: bool) -> None:
        self.lanes = list(lanes)
        self.next = 0
        self.balances_load = bool(balances_load)


def pick_lane(device: Any, deps: dict) -> Any:
    """The compute lane of the newest live dependency on ``device`` (lane order then suffices
    for it), else the least loaded compute lane (an idle one if there is one; ties in
    round-robin order), so independent work spreads and never queues behind a long kernel
    while another lane is free. ``deps``: an operation's dependencies, oldest first. A backend
    that tells no load (``LaneOrder.balances_load`` false) gets its lanes in round-robin order."""
    if deps:
        for fut in reversed(deps):
            lane = fut.lane
            if lane is not None and not fut.retired and getattr(lane, "device", None) is device \
                    and getattr(lane, "kind", "") == "compute":
                return lane
    order: LaneOrder = device._lane_order
    lanes = order.lanes
    n = len(lanes)
    start = order.next
    order.next = start + 1 if start + 1 < n else 0
    if not order.balances_load:
        return lanes[start]
    best, least = None, None
    for i in range(n):
        lane = lanes[(start + i) % n]
        load = device._lane_load(lane)
        if load == 0:
            return lane
        if least is None or load < least:
            best, least = lane, load
    return best


def any_deferred(deps: dict) -> bool:
    """Whether a dependency may be deferred work (``deferred.Deferred``, the one subclass of
    GPUFuture): only then has ``deferred.resolve`` anything to do."""
    for f in deps:
        if type(f) is not GPUFuture:
            return True
    return False


def live(deps: Iterable[GPUFuture]) -> list:
    """The dependencies whose work has not retired, oldest first: what an encode waits for
    (a new list)."""
    waits = []
    for d in deps:
        if not d.retired:
            waits.append(d)
    return waits


def reap(rt: Any) -> int:
    """At a submission's start, outside the lock: while other work is awaited, or once the
    waiter has fallen ``REAP_MAX`` futures behind, settle and retire what the device has
    finished (``CompletionHooks.reap``), so that a loop busy submitting wakes its own awaiters,
    and frees what their work held, without waiting for the waiter thread to get the GIL."""
    hub = rt.hub
    if (hub.awaiting or len(hub._pending) >= REAP_MAX) and not rt.closed:
        hub.reap()
    return 0


def plain_ints(shape: tuple) -> bool:
    """Whether every entry of ``shape`` is an int and no bool: a cached launch shape is found
    by equality, and ``(True,)`` and ``(1.0,)`` equal ``(1,)`` (and hash alike), so a lookup
    that hit is taken only for the plain integers validation accepted."""
    for x in shape:
        if type(x) is not int:
            return False
    return True


# -- the operations --------------------------------------------------------------------------------
def launch_plain(device: Any, kernel: Any, grid: Any, block: Any, args: Any) -> GPUFuture | None:
    """``Device.launch`` of the common case in one call: a (kernel, grid, block) that the
    device validated before (``device._shapes``, its validated shapes); every argument a whole
    raw Buffer of ``device`` or a plain int or float in its type's range; the kernel loaded,
    the device working, the runtime open; no ``after=``, no capture (the caller tests those
    two). None, having done nothing, for anything else: the caller's general path then
    validates it (and names what is wrong) and submits it. Raises only what the submission
    raises."""
    if type(args) is not tuple or type(grid) is not tuple or type(block) is not tuple:
        return None                    # (lists: unhashable, no shape cached)
    last = device._last_launch
    if last is not None and last[0] is kernel and last[1] is grid and last[2] is block:
        # (the same objects as the last plain launch: a service's constant tuples. It holds
        # them, so they are not freed and their identities not reused; tuples do not change)
        shape = last[3]
    else:
        shape = device._shapes.get((kernel, grid, block))
        if shape is None or not plain_ints(grid) or not plain_ints(block):
            return None
        device._last_launch = (kernel, grid, block, shape)
    plan = shape[2]                    # (kernel.arg_plan, ._reads, ._writes, .name: see Device._launch_shape)
    n = len(args)
    if n != len(plan):
        return None
    rt = device.runtime
    values: Any = args
    kreads, kwrites = shape[3], shape[4]
    touches = bool(kreads or kwrites)
    if touches:                        # (pointer arguments: each is read, written or both)
        values = []
        lengths: Any = []
        reads: Any = []
        writes: Any = []
        buffers: dict = {}
        for i in range(n):
            value = args[i]
            pointer, low, high = plan[i]
            if pointer:
                # (BufferState's one subclass is memory.Buffer, which the core does not import)
                if not isinstance(value, BufferState):
                    return None
                buf = value
                if buf._base is not None or buf.typed_dtype is not None or buf.freed or buf.device is not device:
                    return None
                values.append(buf.address)
                lengths.append(buf.nbytes)
                buffers[i] = buf
            elif low is not None:
                if type(value) is not int or not low <= value <= high:
                    return None
                values.append(value)
            else:
                if type(value) is not float or not -high <= value <= high:
                    return None
                values.append(value)
        for i in kreads:
            reads.append(buffers[i])
        for i in kwrites:
            writes.append(buffers[i])
    else:
        for i in range(n):
            value = args[i]
            pointer, low, high = plan[i]
            if low is not None:
                if type(value) is not int or not low <= value <= high:
                    return None
            elif type(value) is not float or not -high <= value <= high:
                return None
        lengths = reads = writes = _EMPTY     # (no memory touched: no three lists per launch)
    reap(rt)
    lock = rt.lock
    lock.enter()
    try:
        if rt.closed or device.broken is not None:
            return None
        loaded = device._kernels.get(kernel)
        if loaded is None:
            return None
        label = shape[5]
        if not touches:
            return launch(rt, device, loaded, label, shape[0], shape[1], values, lengths, {}, reads, writes)
        deps = dependencies(reads, writes, _EMPTY)
        if deps:
            err = failed_dependency(deps)
            if err is not None:
                return hazards.failed_without_running(rt.hub, label, err, writes)
            if any_deferred(deps):
                resolved, blockers = deferred.resolve(deps)
                if blockers:
                    return deferred.defer(rt, device, label, reads, writes, deps, functools.partial(
                        _launch_after, rt, device, loaded, label, shape, values, lengths, reads, writes), None,
                        blockers)
                deps = resolved
        return launch(rt, device, loaded, label, shape[0], shape[1], values, lengths, deps, reads, writes)
    finally:
        lock.exit()


def _launch_after(rt: Any, device: Any, loaded: Any, label: str, shape: tuple, values: Any, lengths: list,
                  reads: list, writes: list, deps: dict) -> GPUFuture:
    """The submission of a plain launch that was deferred (``deferred.defer``'s ``submit``)."""
    return launch(rt, device, loaded, label, shape[0], shape[1], values, lengths, deps, reads, writes)


def launch(rt: Any, device: Any, loaded: Any, label: str, grid: tuple, block: tuple, values: Sequence,
           lengths: Sequence, deps: dict, reads: list, writes: list, keep: Iterable = (),
           cleanup: Iterable = (), copy: Any = None, foreign: Sequence = ()) -> GPUFuture:
    """One dispatch of ``loaded`` on a compute lane of ``device`` after ``deps`` (resolved,
    none failed)."""
    lane = pick_lane(device, deps)
    hub = rt.hub
    fut = hub.new_future(label)
    fut.device, fut.kind = device, "dispatch"
    waits = live(deps) if deps else _EMPTY
    todo = list(cleanup) if cleanup else []
    own = len(todo)
    try:
        keys = encode_kernel(device, fut, lane, loaded, grid, block, values, lengths, waits, todo, copy, foreign)
    except GPUError as exc:
        return _refused(rt, fut, exc, todo, writes)
    except BaseException:
        _withdraw(rt, fut, todo[own:])       # (the caller's cleanup stays the caller's to run)
        raise
    _submitted(rt, fut, deps, waits, keys, reads, writes, keep, todo)
    return fut


def fill(rt: Any, device: Any, buf: Any, word: int, deps: dict) -> GPUFuture:
    """A fill of ``buf`` with a 32-bit word: the backend's own fill where it has one
    (``native_fill``), else the built-in fill kernel."""
    label = f"fill {buf.nbytes} B"
    if not device.native_fill:
        count = buf.nbytes // 4
        return launch(rt, device, device._loaded_kernel(fill_kernel), label, device._fill_grid(count), (256,),
                      [buf.address, word, count], [buf.nbytes], deps, [buf], [buf])
    return encoded(rt, device, pick_lane(device, deps), label, "dispatch", deps, [], [buf], (), (),
                   functools.partial(_encode_fill, device, buf, word))


def _encode_fill(device: Any, buf: Any, word: int, fut: GPUFuture, lane: Any, waits: list,
                 cleanup: list) -> Iterable[int]:
    return device._encode_fill(fut, lane, buf, word, waits, cleanup)


def encoded(rt: Any, device: Any, lane: Any, label: str, kind: str, deps: dict, reads: list, writes: list,
            keep: Iterable, cleanup: Iterable, encode: Callable[..., Iterable[int] | None]) -> GPUFuture:
    """Any other operation on ``lane``: ``encode(fut, lane, waits, cleanup)`` queues it (the
    backend's graph replays, other libraries' streams and events), under the same rules."""
    fut = rt.hub.new_future(label)
    fut.device, fut.kind = device, kind
    waits = live(deps)
    todo = list(cleanup)
    own = len(todo)
    try:
        keys = encode(fut, lane, waits, todo)
    except GPUError as exc:
        return _refused(rt, fut, exc, todo, writes)
    except BaseException:
        _withdraw(rt, fut, todo[own:])
        raise
    _submitted(rt, fut, deps, waits, keys, reads, writes, keep, todo)
    return fut


def join(rt: Any, device: Any, live: list, deps: dict) -> GPUFuture:
    """One future after every future of ``live`` (pending ones of ``deps``), completed on the
    device (``Runtime.gather``)."""
    lane = rt._join_lane(device, live, deps)
    return encoded(rt, getattr(lane, "device", device), lane, f"gather of {len(deps)}", "join", deps, [], [],
                   (), (), rt._encode_join)


def replay(rt: Any, exe: Any, patches: dict, deps: dict, reads: list, writes: list, keep: list,
           label: str) -> GPUFuture:
    """One replay of the graph executable ``exe`` after ``deps``, on the lane its backend names
    (``_replay_work``), under the same rules as any operation; or, for an executable whose
    replay spans several lanes (HSA's), in parts (``_replay_in_parts``)."""
    work = exe._replay_work(patches)
    if work is None:
        return _replay_in_parts(rt, exe, patches, deps, reads, writes, keep, label)
    device, lane, encode = work
    return encoded(rt, device, lane, label, "graph", deps, reads, writes, [*keep, exe], (), encode)


class Part:
    """One part of an operation that runs on several lanes (a graph replay's node, lane or
    engine copy: ``GraphExecHooks._replay_parts``), for which the core makes a future.

    ``depends``: (index of an earlier part, semantic) pairs: the part names their completion,
    and fails when a semantic one fails; ``preds``: indices of parts it is ordered after (it
    retires after them); ``after_head``: it is ordered after the operation's own dependencies
    too, and ``on_head`` names their completion (failing with the semantic ones); ``joined``:
    the operation completes only after it, and fails with it."""

    __slots__ = ("label", "device", "kind", "depends", "preds", "after_head", "on_head", "joined")

    def __init__(self, label: str, device: Any, kind: str, *, depends: Sequence[tuple[int, bool]] = (),
                 preds: Sequence[int] = (), after_head: bool = False, on_head: bool = False,
                 joined: bool = False) -> None:
        self.label, self.device, self.kind = label, device, kind
        self.depends, self.preds, self.joined = depends, preds, joined
        self.after_head, self.on_head = after_head, on_head


def _replay_in_parts(rt: Any, exe: Any, patches: dict, deps: dict, reads: list, writes: list, keep: list,
                     label: str) -> GPUFuture:
    """A replay whose work spans several lanes: a future per part the executable names
    (``_replay_parts``, which raises before any future exists), the replay's future joined
    after the parts that say so, then the executable's encode of all of them
    (``_encode_parts``), then each one's bookkeeping as for any operation."""
    hub = rt.hub
    device, parts, plan = exe._replay_parts(patches, deps)
    head = live(deps)
    futs = []
    for part in parts:
        fut = hub.watch(hub.new_future(part.label))
        fut.device, fut.kind = part.device, part.kind
        futs.append(fut)
    # The replay depends on each part before any part is encoded: one that fails at once
    # must fail the replay, whose completion names its signal.
    whole = hub.watch(hub.new_future(label))
    whole.device, whole.kind = device, "graph"
    for part, fut in zip(parts, futs):
        for i, semantic in part.depends:
            hub.depend(fut, futs[i], semantic=semantic)
        if part.on_head:
            for d in head:
                hub.depend(fut, d, semantic=deps[d])
        if part.joined:
            hub.depend(whole, fut)
    cleanups, cleanup = exe._encode_parts(plan, whole, futs, head)
    for part, fut, done in zip(parts, futs, cleanups):
        track(rt, fut, _EMPTY, _EMPTY, [*(head if part.after_head else _EMPTY), *(futs[i] for i in part.preds)],
              _EMPTY, done)
    # The replay's own future may retire (fail with its queue) before its parts stop running:
    # they are its predecessors, so later writers of its memory then wait for them.
    track(rt, whole, reads, writes, [*head, *futs], [*keep, exe], cleanup)
    return whole


def foreign(rt: Any, obj: Any, device: Any) -> GPUFuture:
    """A future for another library's stream or event ``obj``: the backend names the lane that
    captures it and how (``_foreign_work``); done at once when there is nothing to wait for."""
    dev, lane, label, encode = rt._foreign_work(obj, device)
    if lane is None:
        return completed_future(rt.hub, label)
    return encoded(rt, dev, lane, label, "dispatch", {}, [], [], (), (), encode)


def exported_work(f: GPUFuture) -> GPUFuture:
    """The device work behind ``f`` (a deferred launch's submitted work), for a buffer handed
    to another library; BufferError while it still waits for its kernel's compile (nothing is
    on the device to wait for yet)."""
    got = f._submitted_work()
    if got is None:
        raise BufferError(f"{f!r} waits for its kernel's compile: await it (or dev.load(kernel)) "
                          f"before handing the buffer to another library")
    return got


def writers_lane(buf: Any) -> Any:
    """The lane after whose queued work every pending writer of ``buf``'s bytes has finished
    (another library's consumer waits on it; under the lock): the writers' lane when they share
    one, else that of a join of them; None when nothing pending writes them. BufferError while
    a writer waits for its kernel's compile (``exported_work``)."""
    writers = [w for w in map(exported_work, hazards.touching(buf)[0]) if getattr(w, "lane", None) is not None]
    if not writers:
        return None
    if len({id(w.lane) for w in writers}) == 1:
        return writers[-1].lane
    return join(buf.device.runtime, buf.device, writers, {w: False for w in writers}).lane


# -- after the encode ----------------------------------------------------------------------------
def _submitted(rt: Any, fut: GPUFuture, deps: dict, waits: Sequence, keys: Iterable[int] | None,
               reads: list, writes: list, keep: Iterable, cleanup: list) -> None:
    """The bookkeeping of an encoded operation: the keys its work names (held until it
    retires), its dependents (it fails when a semantic dependency fails), the host steps it
    must run after, its hazards and held memory (``track``); then it is watched."""
    hub = rt.hub
    if keys and not fut.retired:     # (retired while encoded: see below; it names nothing now)
        for key in keys:
            if hub.keys_are_resources:
                hub.retain_key(key)
            fut._add_dep_signal(key)
    if waits:
        host_deps = None
        for dep in waits:
            if deps[dep]:
                dep._add_dependent(fut)
            if dep._state == PENDING and (dep.on_complete or dep.host_deps):
                # Work with host-side completion steps (bounced device-to-host copies): they
                # run before this future completes, so that its result includes them.
                if host_deps is None:
                    host_deps = []
                if dep.on_complete:
                    host_deps.append(dep)
                for d in dep.host_deps or ():
                    if d._state == PENDING:
                        host_deps.append(d)
        fut.host_deps = host_deps
    track(rt, fut, reads, writes, deps, keep, cleanup)
    if fut.retired:
        # The backend's queue failed it while it was being encoded (an HSA queue that could
        # not take its packets retires it at once): what was just recorded is released now.
        todo, fut._cleanup = fut._cleanup, ()
        for fn in todo:
            fn()
        fut.keep = ()
        return
    hub.watch(fut)


def _refused(rt: Any, fut: GPUFuture, exc: GPUError, cleanup: list, writes: list) -> GPUFuture:
    """The driver refused the work (nothing queued): a failed future, which leaves what it
    would have written failed; what the operation held is released now."""
    _withdraw(rt, fut, cleanup)
    return hazards.failed_without_running(rt.hub, fut.label, exc, writes)


def _withdraw(rt: Any, fut: GPUFuture, cleanup: list) -> None:
    """Forget a future whose work was not queued, and run its cleanup."""
    hub = rt.hub
    hub.discard(fut)
    for fn in cleanup:
        fn()
    cleanup.clear()


# -- bookkeeping -----------------------------------------------------------------------------------
def track(rt: Any, fut: GPUFuture, reads: Iterable, writes: Iterable, deps: Iterable[GPUFuture] = (),
          keep: Iterable = (), cleanup: Iterable[Callable[[], None]] = ()) -> None:
    """Bookkeeping once ``fut`` is submitted: it becomes the last writer of ``writes`` and a
    reader of ``reads``; buffers count it as a user; ``keep`` stays alive and ``cleanup``
    runs when it has retired (under the lock)."""
    if rt._replaying:
        # Deferred work being submitted: its Deferred future recorded the hazards and holds
        # the buffers since the call (deferred.py); the submitted work only waits and cleans.
        add_preds(fut, [d for d in deps if not d.retired])
        fut.keep = [*fut.keep, *keep]
        fut._cleanup = [*fut._cleanup, *cleanup]
        return
    if not (reads or writes or deps or keep or cleanup):
        return                          # (work touching no memory: nothing to record)
    if type(reads) is not list:
        reads = list(reads)
    if type(writes) is not list:
        writes = list(writes)
    record(fut, reads, writes, deps)
    held = _new_held(rt.hazards, fut)
    for s in reads:
        held.add(s, False)
    for s in writes:
        held.add(s, True)
    if cleanup:
        held.cleanup = list(cleanup)
    views = held.views
    if views or keep:
        fut.keep = views if not fut.keep and not keep else [*fut.keep, *views, *keep]
    if held.first is not None or held.hosts is not None or held.cleanup is not None:
        fut._cleanup = [held] if not fut._cleanup else [*fut._cleanup, held]


def _new_held(ranges: Any, fut: GPUFuture) -> "_Held":
    """A ``_Held`` for ``fut`` (made without a call to ``__init__``: this runs per operation)."""
    held = _Held.__new__(_Held)
    held.ranges, held.fut = ranges, fut
    held.first = held.second = None
    held.more = held.hosts = held.cleanup = None
    held.views = []
    held.twice = False
    return held


class _Held:
    """What ``track`` hangs on a future's cleanup: the allocations it counts as a user (the
    first two in fields of their own, so that the common launch of two buffers builds no
    list for them), the host ranges it used (of ``ranges``, the runtime's Hazards) and the
    operation's own cleanup. Called once the future retired (under the lock): the cleanup
    runs, then each allocation lets go of the future (its memory goes back if it was freed
    meanwhile, and its ordering state forgets the future: finished work, and the results it
    holds, are not kept alive by the memory it touched), then each host range forgets what
    retired. Holds the future until then (a cycle that its retirement breaks)."""

    __slots__ = ("ranges", "fut", "first", "second", "more", "hosts", "cleanup", "views", "twice")

    if TYPE_CHECKING:
        ranges: Any
        fut: GPUFuture | None
        first: Any                      # the allocations used, once each
        second: Any
        more: list | None
        hosts: list | None
        cleanup: list | None
        views: list                     # the buffers and views used, once each (kept alive)
        # An allocation read twice, or used through two of its views (the future may then be
        # its last writer and one of its readers, or a reader twice): ``release`` then looks
        # for every entry.
        twice: bool

    def add(self, s: Any, write: bool) -> None:
        """Count ``s`` (one of an operation's reads, then its writes) as used."""
        if isinstance(s, BufferState):
            views = self.views
            for v in views:             # (identity: Buffer defines no __eq__)
                if v is s:
                    if not write:       # read twice: recorded twice (``hazards.record``); a
                        self.twice = True   # read that is written too is recorded as the write
                    return
            views.append(s)
            buf = s
            base = buf._base
            root = buf if base is None else base
            if root is self.first or root is self.second:
                self.twice = True
                return
            if self.first is None:
                self.first = root
            elif self.second is None:
                self.second = root
            elif self.more is None:
                self.more = [root]
            else:
                for r in self.more:
                    if r is root:
                        self.twice = True
                        return
                self.more.append(root)
            root.users += 1             # (one user per operation, however often it names it)
        elif type(s) is hazards.HostRange:
            if self.hosts is None:
                self.hosts = [s]
            elif s not in self.hosts:   # (identity: HostRange defines no __eq__)
                self.hosts.append(s)

    def __call__(self) -> None:
        if self.cleanup is not None:
            for fn in self.cleanup:
                fn()
        if self.first is not None:
            self.release(self.first)
            if self.second is not None:
                self.release(self.second)
                if self.more is not None:
                    for buf in self.more:
                        self.release(buf)
        if self.hosts is not None:
            for state in self.hosts:
                self.ranges.prune_host(state)
        self.fut = None

    def release(self, buf: Any) -> None:
        """``buf`` (an allocation) lets go of the retired future."""
        users = buf.users - 1
        buf.users = users
        if users == 0 and buf.freed:
            buf._last_user_retired()
        if buf.ranges is not None:
            hazards.prune(buf)
            return
        fut = self.fut
        if buf.last_write is fut:
            if fut._exc is None:        # (a failed write leaves the memory undefined: it stays)
                buf.last_write = None
            if not self.twice:
                return                  # (used once, as a write: it is none of the readers)
        reads = buf.reads
        n = len(reads)
        i = 0
        while i < n:
            if reads[i] is fut:
                del reads[i]
                if not self.twice:
                    return
                n -= 1
            else:
                i += 1
