"""What ``CudaHub`` does per operation (``LaneHub``): a future's key, watching it on its lane,
``done()``'s look at its lane, and the adaptive spin of an ``await`` (waiter.py's doc, item 1).
Compiled where the package is (lanehub.pxd), as ``Hub`` is the compiled part of ``FutureHub``.
It imports nothing of the driver up front: ``aiogpu info`` imports every compiled module, also
where CUDA is absent."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from ..errors import GPUError
from .._core.futures import PENDING, GPUFuture, submission_scope
from .._core.hub import Hub
from .._core.submit import REAP_AT
from .encode import awaited, flush_word

try:
    import cython  # type: ignore[import-untyped,import-not-found,unused-ignore]
except ImportError:            # interpreted, where Cython is not installed (see _core/interrupts.py)
    globals()["cython"] = type("cython", (), {"compiled": False})
if not cython.compiled:
    # The .pxd's C names, used only compiled (here for type checkers).
    sem_post: Any = None
    sem_t: Any = None
    get_value: Any = None

SPIN_MIN_S = 20e-6
PRESLEEP_MIN_S = 2e-3      # copies predicted to need longer sleep on the loop first ...
PRESLEEP_MARGIN_S = 1e-3   # ... until this long before their predicted end (timer granularity)
LEARN_MIN_BYTES = 1 << 20


def _predicted_wait(fut: GPUFuture) -> float:
    """Seconds until a copy of ``fut.nbytes`` should complete at its lane's learned rate."""
    lane = fut.lane
    if not fut.nbytes or lane is None or not lane.rate:
        return 0.0
    return fut.submitted_at + fut.nbytes / lane.rate - time.monotonic()


def _learn(fut: GPUFuture) -> None:
    """Learn the lane's copy bandwidth from a copy that just completed (an upper bound on its
    duration: submission to now)."""
    lane = fut.lane
    if fut.nbytes >= LEARN_MIN_BYTES and lane is not None and fut._exc is None:
        sample = fut.nbytes / max(time.monotonic() - fut.submitted_at, 1e-6)
        lane.rate = sample if lane.rate is None else max(sample, 0.7 * lane.rate + 0.3 * sample)


class LaneHub(Hub):
    """The per-operation part of ``CudaHub`` (its fields: ``_pending``, ``_idle``,
    ``sem``, ``spin_s``, ``awaiting``, ``spin_hits``, ``spin_misses``; its ``observed``).
    Compiled, an extension type: the core calls its hooks (``watch``, ``reap``, ``arm``'s
    ``_wake_for``, an await's ``spin_poll`` and ``parked_done``) as C methods."""

    # -- futures -------------------------------------------------------------------------------
    def watch(self, fut: GPUFuture) -> GPUFuture:
        """Start watching ``fut`` (under lock). The waiter is not woken for it: its next scan
        finds it, and awaiters arm its lane when they park. Except when the waiter sleeps its
        long guard (nothing was left to its scans): then it is woken once, to sleep the short
        one, so that work nobody awaits retires (frees its buffers) within
        ``UNCOVERED_GUARD_S`` of completing, as on HSA."""
        return _watch(self, fut)

    def _wake_for(self, fut: GPUFuture) -> None:
        """Make sure a wake-up (a host function posting the semaphore) follows ``fut``'s work:
        its lane is armed, or, while a wake-up queued on it has not run yet, that wake-up's
        waiter arms it again for ``fut`` (``rearm``). ``FutureHub.arm`` decides who is waited
        for."""
        _wake_for(self, fut)

    def rearm(self) -> None:
        """On the waiter thread, after a wake-up and before its scan: arm each lane again whose
        parked tickets a wake-up queued earlier does not cover (``_wake_for``)."""
        _rearm(self)

    def observe(self, fut: GPUFuture) -> None:
        """``done()``: read the lane's completion word (one memory load) and settle the lane's
        prefix up to it when it shows ``fut`` done (host-settled futures have no lane)."""
        lane = fut.lane
        if lane is not None and lane.word is not None:
            _cover(self, lane, fut.ticket, False)        # (a poll: never waits for the lock)
            if lane.word.value >= fut.ticket:
                self.observed(lane, fut.ticket, 0)

    def reap(self) -> None:
        """Settle each lane's prefix that its completion word shows done (see
        ``CompletionHooks.reap``); lanes without a word are left to the waiter's scan."""
        _reap(self)

    def parked_done(self, fut: GPUFuture) -> None:
        """A parked await of ``fut`` was woken: a long copy teaches its lane's copy rate."""
        work = fut._submitted_work()
        if work is not None and work.lane is not None:
            _learn(work)

    # -- observing lanes -------------------------------------------------------------------------
    # Completions are observed and settled without the runtime lock (see ``FutureHub``); the
    # hub's ``_observe`` lock makes whoever observes (the waiter, an awaiter's spin, ``done()``,
    # a reap) take each lane's prefix and run its host steps one at a time, so that host steps
    # run in submission order. Its holders never wait for the runtime lock (only ``try_run``)
    # and wake no awaiters under it.
    def observed(self, lane: Any, ticket: int, code: int) -> None:
        """The event of ``ticket`` on ``lane`` read ``code``: settle the lane's prefix up to it
        (without the runtime lock), or fail the device on a sticky error (under it)."""
        _observed(self, lane, ticket, code)

    def _settle(self, completed: list) -> None:
        """Settle futures whose events read complete (without the runtime lock)."""
        _settle_batch(self, completed)

    # -- the spin --------------------------------------------------------------------------------
    def spin_poll(self, fut: GPUFuture) -> bool:
        """Done at the first poll (short work, the common case of a request): the spin's hit,
        without reading the clock or starting the spin."""
        return _first_poll(self, fut)

    def spin_await(self, fut: GPUFuture):
        """A long copy first lets the loop sleep until near its predicted end; then the spin."""
        lane = fut.lane
        if lane is None:                 # a host-settled future (a compile, deferred work)
            return
        if self.spin_poll(fut):
            return True
        ahead = _predicted_wait(fut)
        if ahead > PRESLEEP_MIN_S:
            yield from asyncio.sleep(ahead - PRESLEEP_MARGIN_S).__await__()
        return (yield from self.spin(fut, PRESLEEP_MARGIN_S * 2 if ahead > PRESLEEP_MIN_S else 0.0))

    def spin(self, fut: GPUFuture, at_least: float = 0.0):
        """Poll ``fut``'s completion on the loop for up to its lane's adaptive window (or
        ``at_least`` seconds), yielding in between. With a completion word a poll is one memory
        load; without, one ``cuEventQuery``. Returns True when the word showed the work done and
        nothing needs settling now (see ``_completed_now``)."""
        lane = fut.lane
        start = time.perf_counter()
        deadline = start + max(lane.spin, at_least)
        word, ticket = lane.word, fut.ticket
        if word is not None:
            _cover(self, lane, ticket, True)      # (its launch may have left the word behind)
            while fut._state == PENDING:
                if word.value >= ticket:
                    _hit(self, lane, fut, time.perf_counter() - start)
                    return _completed_now(self, fut)
                if time.perf_counter() > deadline or self.awaiting > 1:
                    break
                yield
        else:
            from . import driver as D     # (not at import: see the module doc)

            query, event, not_ready = D.HOT.query, fut.event, D.NOT_READY
            while fut._state == PENDING:
                code = query(event)
                if code != not_ready:
                    if fut._state == PENDING:
                        self.observed(lane, ticket, code)
                    _hit(self, lane, fut, time.perf_counter() - start)
                    return False
                if time.perf_counter() > deadline or self.awaiting > 1:
                    break
                yield
        if fut._state == PENDING and self.awaiting == 1:     # (others came: not a miss)
            self.spin_misses += 1
            lane.spin = max(SPIN_MIN_S, lane.spin / 2)
        return False


# (Functions, not methods: compiled, they are C functions over the hub's and the future's C
# fields, ``h`` being the hub typed: a ``Hub``, or a ``LaneHub`` where they read its own fields.)
def _watch(hub: Any, fut: GPUFuture) -> GPUFuture:
    h = hub
    # (compiled, the context variable read by a C call, not a method call)
    scope = get_value(submission_scope) if cython.compiled else submission_scope.get()
    if scope is not None:
        scope.append(fut)
    h._pending[fut.signal] = fut
    lane = fut.lane
    if lane is not None:
        lane.pending.append(fut)
    if h._idle:                      # (read after the append: see CudaHub._run)
        h._idle = False
        _post(hub)
    return fut


def _post(hub: Any) -> int:
    """Post the hub's semaphore (wake the waiter): compiled, libc's ``sem_post`` itself (the
    ``Semaphore.post`` method is a ctypes call, some 2,000 instructions)."""
    h = hub
    if cython.compiled:
        sem_post(cython.cast(cython.pointer(sem_t), cython.cast(cython.size_t, h.sem.address)))
    else:
        h.sem.post()
    return 0


def _first_poll(hub: Any, fut: GPUFuture) -> bool:
    lane = fut.lane
    if lane is None:                 # a host-settled future (a compile, deferred work)
        return False
    awaited(lane, fut)
    word = lane.word
    if word is not None and fut._state == PENDING and word.value >= fut.ticket:
        _hit(hub, lane, fut, 0.0)
        return _completed_now(hub, fut)
    return False


def _cover(hub: Any, lane: Any, ticket: int, wait: bool) -> int:
    """Someone waits for ``ticket`` on ``lane``: its word is made to reach it where the lane's
    launches left it behind (``encode.flush_word``), under the plain lock (as ``_wake_for``);
    ``wait`` false: only if that lock is free now (else a later look covers it). A failed write
    wakes the waiter, whose scan queries the stream and finds the error."""
    if ticket <= lane.written:
        return 0
    h = hub
    raw = h.lock.raw
    if not raw._take(wait, -1.0):
        return 0
    try:
        code = flush_word(lane, ticket)
    finally:
        raw._give()
    if code:
        _post(hub)
    return 0


def _completed_now(hub: Any, fut: GPUFuture) -> bool:
    """The spin read ``fut``'s ticket in its lane's completion word: the work completed
    successfully (a lane writes the word only after it; a failing context stops the lane).
    The awaiter returns at once, with no lock and no state change on the loop: settling
    (other awaiters, callbacks) and retiring (its event, buffers, host memory) are left to
    the waiter's next scan, which reads the same word, within its guard interval (returns
    True). Unless the waiter has fallen behind (``REAP_AT`` futures pending: a loop busy with
    requests leaves it short of the GIL): then this loop settles and retires, in one batch,
    what the lanes' words show done (``_reap``), so that a request's futures, buffers and host
    blocks do not outlive a few garbage collections. Futures with host-side completion
    steps, and joins (whose members decide how they settle), settle fully now. Returns True
    when the awaiter may return the future's value unsettled (it has no host steps)."""
    h = hub
    steps = fut.on_complete or fut.host_deps or fut.members is not None
    # (A reap settles its own lane's prefix too, host steps and all.)
    reaped = len(h._pending) >= REAP_AT and _reap(hub)
    if not reaped:
        if not steps:
            return True
        hub.observed(fut.lane, fut.ticket, 0)
    return not steps and fut._state == PENDING


def _reap(hub: Any) -> bool:
    """Settle the prefix of each lane that its completion word shows done: every lane under one
    hold of ``_observe``, their awaiters and retirements in one flush. Not inside this thread's
    section of the runtime lock (as ``observe``): there it does nothing and returns False."""
    h = hub
    if h.lock.raw._is_owned():
        return False
    found = None
    for lane in hub.lanes:
        pending = lane.pending
        if pending and lane.word is not None:
            upto = lane.word.value
            try:
                first = pending[0]
            except IndexError:           # (the waiter took it meanwhile)
                continue
            if first.ticket <= upto:
                if found is None:
                    found = []
                found.append((lane, upto))
    if found is None:
        return True
    posts: dict = {}
    with hub._observe:
        for item in found:
            _take(hub, item[0], item[1], posts)
    h._flush(posts)
    return True


def _hit(hub: Any, lane: Any, fut: GPUFuture, waited: float) -> int:
    """A spin saw ``fut`` complete after ``waited`` seconds: the lane's window grows."""
    h = hub
    hub.spin_hits += 1
    lane.spin = min(h.spin_s, max(lane.spin * 2, 2 * waited))
    if fut.nbytes >= LEARN_MIN_BYTES:
        _learn(fut)
    return 0


def _observed(hub: Any, lane: Any, ticket: int, code: int) -> int:
    h = hub
    if code != 0:
        hub.device_failed(lane.device, code, lane)
        return 0
    posts: dict = {}
    with hub._observe:
        _take(hub, lane, ticket, posts)
    h._flush(posts)
    return 0


def _settle_batch(hub: Any, completed: list) -> int:
    h = hub
    posts: dict = {}
    with hub._observe:
        if len(completed) > 1:    # (in submission order)
            completed.sort(key=_key_of)
        _complete_each(hub, completed, posts)
    h._flush(posts)
    return 0


def _take(hub: Any, lane: Any, ticket: int, posts: dict) -> int:
    """Settle ``lane``'s pending prefix up to ``ticket`` (under ``_observe``), in its order,
    which is its submission order."""
    done = []
    pending = lane.pending
    while pending:
        f = pending[0]
        if f.ticket > ticket:
            break
        pending.popleft()
        if not f.retired:
            done.append((f.signal, f))
    if done:
        _complete_each(hub, done, posts)
    return 0


def _key_of(item: tuple) -> int:
    return item[0]


def _complete_each(hub: Any, completed: list, posts: dict) -> int:
    """Settle completed futures in the given order (under ``_observe``), running their
    host-side completion steps (staged device-to-host copies) first, and those of the work
    they depend on; a failed step fails its future (under the runtime lock, later)."""
    h = hub
    for item in completed:
        key, fut = item
        if h._pending.get(key) is not fut:
            continue
        exc = None
        if fut._state == PENDING and (fut.host_deps or fut.on_complete):
            for dep in fut.host_deps or ():
                if dep._state == PENDING:   # complete on the device: settle it first
                    _take(hub, dep.lane, dep.ticket, posts)
            fut.host_deps = None
            for hook in fut.on_complete or ():
                try:
                    hook()
                except Exception as e:  # noqa: BLE001 - becomes the future's failure
                    exc = GPUError(f"{fut.label}: completing on the host failed: {e}")
            fut.on_complete = None       # (run once, even when a rescan sees it again)
        h._completed(fut, exc, posts)
    return 0


def _wake_for(hub: Any, fut: GPUFuture) -> int:
    lane = fut.lane
    if lane is None:                 # (settled on the host: a compile, deferred work)
        return 0
    awaited(lane, fut)
    if lane.armed >= fut.ticket:
        return 0
    # The plain lock (no Ctrl-C hold, no signal-handler swap): an interrupt here at worst
    # leaves ``armed`` behind, and the next arm queues one more wake-up.
    h = hub
    raw = h.lock.raw                # (its C calls, compiled)
    raw._take(True, -1.0)
    try:
        if fut._state != PENDING or lane.armed >= fut.ticket or lane.stream is None:
            return 0
        word = lane.word
        if word is not None and word.value < lane.armed:
            # The wake-up queued after ``armed`` has not run (the lane writes the word before
            # it): the waiter it wakes arms the lane again for this ticket before it scans
            # (``_rearm``), so a burst of parked awaits queues one host function, not one
            # each (a cuLaunchHostFunc costs about a launch, on the loop).
            if fut.ticket > lane.wanted:
                lane.wanted = fut.ticket
            return 0
        _arm(hub, lane)
    finally:
        raw._give()
    return 0


def _rearm(hub: Any) -> int:
    """``LaneHub.rearm``: each lane with a parked ticket beyond its last wake-up's, and not
    complete by its word, is armed after its current work (under the plain lock, as
    ``_wake_for``): the scan that follows settles what completed before the arm."""
    h = hub
    for lane in hub.lanes:
        if lane.wanted <= lane.armed:
            continue
        raw = h.lock.raw
        raw._take(True, -1.0)
        try:
            word = lane.word
            if lane.wanted > lane.armed and lane.stream is not None and word is not None \
                    and word.value < lane.wanted:
                _arm(hub, lane)
        finally:
            raw._give()
    return 0


def _arm(hub: Any, lane: Any) -> int:
    """Queue the wake-up host function on ``lane`` after its current work (under the plain
    lock)."""
    h = hub
    err = lane.arm(h.sem_post, h.sem.address)      # (the word covers the lane's work first)
    h.arms += 1
    if err == 0:
        lane.armed = lane.ticket
    else:                          # a broken context: let the waiter find out now
        _post(hub)
    return 0
