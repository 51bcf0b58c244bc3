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
from typing import Any, Callable, Iterable, Sequence

from . import hazards
from . import deferred
from ..errors import GPUError
from ..kernels import copy_kernel, fill_kernel
from ..memory import Buffer
from .futures import PENDING, GPUFuture


def guarded(rt: Any, device: Any, label: str, reads: list, writes: list, after: list,
            submit: Callable[[dict], GPUFuture], *, compile: Any = None,
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
        deps = hazards.dependencies(reads, writes, after)
        err = hazards.failed_dependency(deps) if deps else None
    else:                                     # the fast path: nothing to order after
        deps, err = {}, None
    if err is not None:
        return hazards.failed_without_running(rt.hub, label, err, writes)
    if deps or compile is not None:          # (deferred work in deps: its submitted work)
        resolved, blockers = deferred.resolve(deps)
        if blockers or compile is not None:
            if deferred_rw is not None:
                reads, writes = deferred_rw
            return deferred.defer(rt, device, label, reads, writes, deps, submit, compile, blockers)
        deps = resolved
    return submit(deps)


# -- lanes ---------------------------------------------------------------------------------------
def pick_lane(device: Any, deps: dict) -> Any:
    """The compute lane of the newest live dependency on ``device`` (lane order then suffices
    for it), else the least loaded compute lane (an idle one if there is one; ties in
    round-robin order), so independent work spreads and never queues behind a long kernel
    while another lane is free. ``deps``: an operation's dependencies, oldest first."""
    if deps:
        for fut in reversed(deps):
            lane = fut.lane
            if lane is not None and not fut.retired and getattr(lane, "device", None) is device \
                    and getattr(lane, "kind", "") == "compute":
                return lane
    lanes = device.compute
    start = next(device._rr)
    best, least = None, None
    for i in range(len(lanes)):
        lane = lanes[(start + i) % len(lanes)]
        load = device._lane_load(lane)
        if load == 0:
            return lane
        if least is None or load < least:
            best, least = lane, load
    return best


# -- the operations --------------------------------------------------------------------------------
def launch(rt: Any, device: Any, loaded: Any, label: str, grid: tuple, block: tuple, values: Sequence,
           lengths: Sequence, deps: dict, reads: list, writes: list, keep: Iterable = (),
           cleanup: Iterable = (), copy: Any = None, foreign: Sequence = ()) -> GPUFuture:
    """One dispatch of ``loaded`` on a compute lane of ``device`` after ``deps`` (resolved,
    none failed)."""
    lane = pick_lane(device, deps)
    fut = rt.hub.new_future(label)
    fut.device, fut.kind = device, "dispatch"
    waits = [d for d in deps if not d.retired] if deps else []
    todo = list(cleanup)
    own = len(todo)
    try:
        keys = device._encode_kernel(fut, lane, loaded, grid, block, values, lengths, waits, todo, copy, foreign)
    except GPUError as exc:
        return _refused(rt, fut, exc, todo, writes)
    except BaseException:
        _withdraw(rt, fut, todo[own:])       # (the caller's cleanup stays the caller's to run)
        raise
    _submitted(rt, fut, deps, waits, keys, reads, writes, keep, todo)
    return fut


def fill(rt: Any, device: Any, buf: Buffer, word: int, deps: dict) -> GPUFuture:
    """A fill of ``buf`` with a 32-bit word: the backend's own fill where it has one
    (``native_fill``), else the built-in fill kernel."""
    label = f"fill {buf.nbytes} B"
    if not device.native_fill:
        count = buf.nbytes // 4
        return launch(rt, device, device._loaded_kernel(fill_kernel), label, device._fill_grid(count), (256,),
                      [buf.address, word, count], [buf.nbytes], deps, [buf], [buf])
    return encoded(rt, device, pick_lane(device, deps), label, "dispatch", deps, [], [buf], (), (),
                   functools.partial(_encode_fill, device, buf, word))


def _encode_fill(device: Any, buf: Buffer, word: int, fut: GPUFuture, lane: Any, waits: list,
                 cleanup: list) -> Iterable[int]:
    return device._encode_fill(fut, lane, buf, word, waits, cleanup)


def copy(rt: Any, op: Any, deps: dict) -> GPUFuture:
    """Copy ``op`` (a ``copies.CopyOp``, validated, its route decided): its small host source
    staged, or host pointers from the backend where a host side has none yet, then an engine
    when one can take it, else a shader copy (the built-in copy kernel on a compute lane). What
    the host sides locked, or the pinned blocks staged, is released here if submitting raises."""
    try:
        if op.stage:
            op.stage_source()
        src, dst = op.src, op.dst
        if (src.host and src.ptr is None) or (dst.host and dst.ptr is None):
            rt._host_pointers(op)
        fut = None
        if rt.copy_engines or not rt._shader_can_copy(op):
            fut = _engine_copy(rt, op, deps)
        if fut is None:
            dev, n = op.device, op.nbytes
            fut = launch(rt, dev, dev._loaded_kernel(copy_kernel), op.label + " (shader)", dev._copy_grid(n),
                         (256,), [dst.ptr, src.ptr, n], [n, n], deps, op.reads, op.writes(),
                         op.keep, op.cleanup, op)
            rt.shader_copies += 1
    except BaseException:
        for fn in op.cleanup:
            fn()
        raise
    fut.kind, fut.nbytes = "copy", op.nbytes
    return fut


def _engine_copy(rt: Any, op: Any, deps: dict) -> GPUFuture | None:
    """``op`` on the copy lane the backend gives it; None when none takes it."""
    lane = rt._copy_lane(op, deps)
    if lane is None:
        return None
    hub = rt.hub
    fut = hub.new_future(op.label)
    fut.device, fut.kind, fut.nbytes = op.device, "copy", op.nbytes
    waits = [d for d in deps if not d.retired] if deps else []
    todo = op.cleanup
    try:
        keys = rt._encode_copy(fut, op, lane, waits, todo)
    except GPUError as exc:
        op.cleanup = []                      # (run by _refused: not again by ``copy``)
        return _refused(rt, fut, exc, todo, op.writes())
    except BaseException:
        hub.discard(fut)
        raise
    if keys is None:                         # refused after all: a shader copies it
        hub.discard(fut)
        return None
    _submitted(rt, fut, deps, waits, keys, op.reads, op.writes(), op.keep, todo)
    return fut


def encoded(rt: Any, device: Any, lane: Any, label: str, kind: str, deps: dict, reads: list, writes: list,
            keep: Iterable, cleanup: Iterable, encode: Callable[..., Iterable[int] | None]) -> GPUFuture:
    """Any other operation on ``lane``: ``encode(fut, lane, waits, cleanup)`` queues it (the
    backend's graph replays, other libraries' streams and events), under the same rules."""
    fut = rt.hub.new_future(label)
    fut.device, fut.kind = device, kind
    waits = [d for d in deps if not d.retired] if deps else []
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


# -- after the encode ----------------------------------------------------------------------------
def _submitted(rt: Any, fut: GPUFuture, deps: dict, waits: list, keys: Iterable[int] | None,
               reads: list, writes: list, keep: Iterable, cleanup: list) -> None:
    """The bookkeeping of an encoded operation: the keys its work names (held until it
    retires), its dependents (it fails when a semantic dependency fails), the host steps it
    must run after, its hazards and held memory (``track``); then it is watched."""
    hub = rt.hub
    if keys and not fut.retired:     # (retired while encoded: see below; it names nothing now)
        for key in keys:
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
    rt.hub.discard(fut)
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
        for d in deps:
            if not d.retired:
                fut.preds.append(d)
        fut.keep = [*fut.keep, *keep]
        fut._cleanup = [*fut._cleanup, *cleanup]
        return
    if not (reads or writes or deps or keep or cleanup):
        return                          # (work touching no memory: nothing to record)
    if type(reads) is not list:
        reads = list(reads)
    if type(writes) is not list:
        writes = list(writes)
    hazards.record(fut, reads, writes, deps)
    views: list[Buffer] = []            # the buffers and views used, once each (kept alive)
    roots: list[Buffer] = []            # their allocations, once each (counted as users)
    hosts: list[hazards.HostRange] = []
    # (``in`` compares by identity here: Buffer and HostRange define no __eq__.)
    for group in (reads, writes):
        for s in group:
            kind = type(s)
            if kind is Buffer:
                if s not in views:
                    views.append(s)
                    root = s if s._base is None else s._base
                    if root not in roots:
                        roots.append(root)
            elif kind is hazards.HostRange and s not in hosts:
                hosts.append(s)
    for buf in roots:
        buf.users += 1
    if views or keep:
        fut.keep = [*fut.keep, *views, *keep]
    cleanup = list(cleanup) if cleanup else []
    if roots or hosts or cleanup:
        fut._cleanup = [*fut._cleanup, functools.partial(_retired, rt.hazards, cleanup, roots, hosts)]


def _retired(ranges: Any, cleanup: list, bufs: list, hosts: list) -> None:
    """What ``track`` runs once an operation retired: its cleanup, then the buffers and host
    ranges (of ``ranges``, the runtime's Hazards) it used let go of it."""
    for fn in cleanup:
        fn()
    for buf in bufs:
        buf._unuse()
        hazards.prune(buf)         # finished work (and its results) is not kept alive
    for state in hosts:
        ranges.prune_host(state)
