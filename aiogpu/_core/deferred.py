"""Work submitted later: a launch whose kernel is still compiling, and the work ordered after it.

Compiling a kernel (NVRTC, comgr) takes from tens of milliseconds to seconds: it never runs on the
event loop. ``Device.load(kernel)`` compiles on a worker thread; a ``launch`` of a kernel that is
not compiled yet starts that compile and returns at once. The rule, kept here once:

- An operation is *deferred* when its kernel is still compiling, or when one of its dependencies
  (buffer hazards, ``after=``, a gather's members) is deferred work not submitted yet. Its
  future, a ``Deferred``, is returned at once.
- Its ordering is fixed at the call, as for any operation: its hazards are recorded then (later
  operations on the same buffers order after it, and are deferred behind it while it waits),
  and it waits for the dependencies it had then.
- It is submitted, with those dependencies, as soon as its compile has finished and every
  deferred operation it depends on has been submitted: by the thread that finished the last of
  them (the compile worker), under the runtime lock, in call order among the work released
  together. From then on the device orders it like any other work.
- Its future mirrors the submitted work: it completes or fails with it, and retires (lets its
  buffers go) with it. A failed compile fails it (a ``GPUError`` whose cause is the compiler's
  error); so does a failed input, as for work submitted at once; closing the runtime first fails
  it as abandoned. Nothing deferred is lost: ``Runtime.close`` waits for it too.

Deferred operations are the core's business: backends see only ordinary submissions.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable

from . import hazards
from ..errors import GPUError
from .futures import PENDING, GPUFuture, submission_scope


class Deferred(GPUFuture):
    """The future of an operation whose submission waits (see the module doc); also the future
    of a compile (``Device.load``), which is never submitted: it settles on the host."""

    __slots__ = ("real", "waiters", "blocked", "deps", "submit", "compile", "runtime")

    def __init__(self, hub: Any, label: str):
        super().__init__(hub, label)
        self.retired = False              # (a plain future without a signal starts retired)
        self.real: GPUFuture | None = None   # the submitted work, once submitted
        self.waiters: list[Deferred] = []    # deferred work released when this one is
        self.blocked = 0                  # unreleased blockers of this one
        self.deps: dict = {}
        self.submit: Callable[[dict], GPUFuture] | None = None
        self.compile: Deferred | None = None
        self.runtime: Any = None

    @property
    def submitted(self) -> bool:
        return self.real is not None

    def _submitted_work(self) -> GPUFuture | None:
        """The work this was submitted as; None while it waits for its submission (or, for a
        compile, while it runs); itself once settled without being submitted."""
        return self.real if self.real is not None or self._state == PENDING else self


def resolve(deps: dict) -> tuple[dict, list]:
    """``deps`` with each submitted Deferred replaced by its submitted work; and the deferred
    dependencies not submitted yet (still pending)."""
    for f in deps:                  # (a loop, not any(): this runs per operation ordered after others)
        if isinstance(f, Deferred):
            break
    else:
        return deps, []
    out: dict = {}
    blockers = []
    for f, semantic in deps.items():
        if isinstance(f, Deferred):
            if f.real is not None:
                f = f.real
            elif f._state == PENDING:
                blockers.append(f)
        out[f] = out.get(f, False) or semantic
    return out, blockers


def defer(rt: Any, device: Any, label: str, reads: list, writes: list, deps: dict,
          submit: Callable[[dict], GPUFuture], compile: "Deferred | None" = None,
          blockers: list | None = None) -> Deferred:
    """A Deferred for an operation (under the lock): hazards recorded now, submitted later."""
    fut = Deferred(rt.hub, label)
    fut.device, fut.runtime = device, rt
    fut.deps, fut.submit, fut.compile = deps, submit, compile
    from .submit import track
    track(rt, fut, reads, writes, deps)
    scope = submission_scope.get()
    if scope is not None:
        scope.append(fut)
    blockers = list(blockers or [])
    if compile is not None and compile._state == PENDING:
        blockers.append(compile)
    rt._deferred.add(fut)
    if not blockers:
        _run_all(rt, [fut])
        return fut
    fut.blocked = len(blockers)
    for b in blockers:
        b.waiters.append(fut)
    return fut


def new_compile(rt: Any, label: str) -> Deferred:
    """A compile's future (settled on the host by ``finish_compile``)."""
    fut = Deferred(rt.hub, label)
    fut.runtime = rt
    fut.kind = "compile"
    return fut


def finish_compile(rt: Any, fut: Deferred, exc: BaseException | None) -> None:
    """The compile of ``fut`` finished (under the lock): settle it, then submit (or fail) the
    work waiting for it."""
    posts: dict = {}
    if fut._state == PENDING:
        rt.hub._finish(fut, exc, posts)
    rt.hub._retire(fut)
    rt.hub._post(posts)
    _release(rt, fut)


def _release(rt: Any, fut: Deferred) -> None:
    ready = []
    waiters, fut.waiters = fut.waiters, []
    for w in waiters:
        w.blocked -= 1
        if w.blocked == 0:
            ready.append(w)
    if ready:
        _run_all(rt, ready)


def _run_all(rt: Any, ready: list) -> None:
    """Submit (or fail) each ready deferred operation, then those it releases, in order."""
    work = deque(ready)
    token = submission_scope.set(None)    # (their futures joined their TaskGroup when deferred)
    try:
        while work:
            fut = work.popleft()
            _run(rt, fut)
            waiters, fut.waiters = fut.waiters, []
            for w in waiters:
                w.blocked -= 1
                if w.blocked == 0:
                    work.append(w)
    finally:
        submission_scope.reset(token)


def _run(rt: Any, fut: Deferred) -> None:
    # ``fut`` leaves ``rt._deferred`` only once its work is submitted (watched by the hub) or it
    # failed: ``close`` reads the deferred set, then the hub's pending count, without the lock,
    # and must never see neither.
    try:
        _submit_deferred(rt, fut)
    finally:
        rt._deferred.discard(fut)


def _submit_deferred(rt: Any, fut: Deferred) -> None:
    hub = rt.hub
    if fut._state != PENDING:               # abandoned by close meanwhile
        hub.retire_failed(fut)
        return
    deps, _ = resolve(fut.deps)
    err: BaseException | None = None
    if rt._abandoning:
        err = GPUError(f"{fut.label}: abandoned: the runtime was closed before it could be submitted")
    elif fut.compile is not None and fut.compile._exc is not None:
        cause = fut.compile._exc
        err = GPUError(f"{fut.label}: its kernel did not compile: {cause}")
        err.__cause__ = cause
    else:
        broken = getattr(fut.device, "broken", None)
        if broken is not None:      # a lost device first, as submit.guarded does
            err = hazards.broken_error(fut.label, broken)
        else:
            err = hazards.failed_dependency(deps) if deps else None
    if err is None:
        rt._replaying += 1
        try:
            got = fut.submit(deps)         # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - becomes the future's failure
            err = GPUError(f"{fut.label}: submitting it failed: {exc!r}")
            err.__cause__ = exc
        finally:
            rt._replaying -= 1
    fut.submit, fut.deps = None, {}
    if err is not None:
        hub.fail(fut, err)
        hub.retire_failed(fut)
        return
    adopt(hub, fut, got)


def adopt(hub: Any, fut: Deferred, got: GPUFuture) -> None:
    """``fut`` mirrors the submitted ``got``: it settles and retires with it (under the lock).
    If someone waits for ``fut``, the waiter is woken for ``got`` (see ``FutureHub.arm``)."""
    fut.real = got
    if fut.waited:              # (read after ``real`` is set; arm sets ``waited`` before reading it)
        hub.arm(got)
    fut.queue, fut.packet, fut.kind, fut.nbytes = got.queue, got.packet, got.kind or "dispatch", got.nbytes
    if got._state != PENDING:
        _mirror(hub, fut, got)
    else:
        got._notify(None, lambda g: _mirror(hub, fut, g))
    if got.retired:
        hub._retire(fut)
    else:
        got._on_retired(lambda: hub._retire(fut))


def _mirror(hub: Any, fut: Deferred, got: GPUFuture) -> None:
    """Settle ``fut`` as ``got`` settled (any thread; never waits for the lock: a failure is
    spread by the lock's holder). It retires with ``got`` (``adopt``), or at once if done."""
    posts: dict = {}
    hub._completed(fut, got._exc, posts, retire=got._exc is None)
    hub._flush(posts)


def abandon(rt: Any, timeout: float) -> int:
    """Fail every deferred operation still waiting at close (under the lock); how many."""
    waiting = list(rt._deferred)
    for fut in waiting:
        if fut._state == PENDING:
            rt.hub.fail(fut, GPUError(f"{fut.label}: abandoned: the runtime was closed while it waited "
                                      f"for its kernel to compile (close timeout {timeout:g} s)"))
        rt.hub._retire(fut)
    rt._deferred.clear()
    from ..errors import RuntimeClosedError
    for dev in rt.devices:                 # compiles not finished: their futures fail too
        for compiling in list(getattr(dev, "_compiling", {}).values()):
            if compiling._state == PENDING:
                finish_compile(rt, compiling, RuntimeClosedError("the runtime was closed before the kernel compiled"))
    return len(waiting)
