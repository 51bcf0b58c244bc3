"""The HSA waiter wakes for the work someone waits for, not for every completion.

Its wait holds the wake signal and the signals of futures someone waits for (``FutureHub.arm``:
a parked awaiter, a done-callback, a thread in ``wait()``, host work that must follow a
completion); work nobody waits for is settled by its periodic scan. Most tests here stretch the
waiter's timeouts far beyond their deadlines (``long_timeouts``): whatever settles within a
deadline was woken for, not found by a periodic scan. They fail if an arm is missing on some
path (the awaiter would sleep out the timeout) and if the waiter woke for every completion.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

import aiogpu
from aiogpu.hsa import signals
from aiogpu.hsa.device import HsaDevice
from gpu_kernels import Gate, add_into, fail_if, sleep_ms

LONG_S = 60.0       # the waiter's timeouts under ``long_timeouts``
DEADLINE_S = 10.0   # what a woken-for completion gets (far below LONG_S)


@pytest.fixture
def long_timeouts(monkeypatch):
    """The waiter's timeouts (periodic scan and lost-wakeup guard) at LONG_S; the waiter reads
    them when its thread starts, so make the runtime after this fixture."""
    monkeypatch.setattr(signals, "POLL_S", LONG_S)
    monkeypatch.setattr(signals, "LOST_WAKEUP_GUARD_S", LONG_S)


def retire_the_rest(rt):
    """Work nobody waits for retires at the periodic scan, which ``long_timeouts`` stretches:
    have the waiter scan now (wake it) until nothing is pending (the leak check follows)."""
    deadline = time.monotonic() + DEADLINE_S
    while rt.stats()["pending"]:
        assert time.monotonic() < deadline, rt.hub.pending_futures()
        rt.hub.wake()
        time.sleep(0.01)


def until_device_done(rt, fut, timeout=DEADLINE_S):
    """Block until ``fut``'s signal reads complete (read directly, not through the hub)."""
    deadline = time.monotonic() + timeout
    while not rt.hub.is_complete(fut.signal):
        assert time.monotonic() < deadline, f"{fut!r} did not complete on the device"
        time.sleep(0.0005)


def wait_calls(rt, monkeypatch):
    """Record the signal handles of each ``hsa_amd_signal_wait_any`` call of the waiter; a
    condition is notified at each call."""
    calls: list[set] = []
    cond = threading.Condition()
    real = rt.api.hsa_amd_signal_wait_any

    def spy(n, sigs, conds, vals, timeout, hint, out):
        with cond:
            calls.append({sigs[i].handle for i in range(n)})
            cond.notify_all()
        return real(n, sigs, conds, vals, timeout, hint, out)

    monkeypatch.setattr(rt.api, "hsa_amd_signal_wait_any", spy)
    return calls, cond


def fresh_wait(rt, calls, cond):
    """Wake the waiter until it has started a wait built after this call; that wait's handles.
    (The first wait after a wake-up may have been built before it: the second was not.)"""
    for _ in range(2):
        with cond:
            target = len(calls) + 1
        rt.hub.wake()
        with cond:
            assert cond.wait_for(lambda: len(calls) >= target, DEADLINE_S), "the waiter did not wait again"
    return calls[-1]


@pytest.mark.asyncio
async def test_work_nobody_waits_for_does_not_wake_the_waiter(make_runtime, long_timeouts):
    """N launches and copies that complete one after another, none awaited, then one awaited
    launch: the waiter wakes a few times (new work while it idled, the arm, the awaited
    completion), not once per completion; the awaited completion's scan retires them all."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    buf, host = d0.alloc(4096), np.ones(1024, np.float32)
    await aiogpu.copy(buf, host)
    n = 40
    before = rt.hub.wakeups
    for i in range(n):
        fut = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,)) if i % 2 else aiogpu.copy(buf, host)
        until_device_done(rt, fut)
    unwaited = rt.hub.wakeups - before
    await asyncio.wait_for(d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,)), DEADLINE_S)
    woke = rt.hub.wakeups - before
    assert woke < n // 4, f"the waiter woke {woke} times for {n} completions nobody waited for " \
                          f"({unwaited} before the awaited one)"
    assert rt.stats()["pending"] == 0 and rt.stats()["signals_in_use"] == 0


def test_a_completion_whose_retirement_waits_for_the_lock_holder_is_not_spun_on(make_runtime,
                                                                                long_timeouts):
    """A waited-for future that completes while another thread holds the runtime lock settles
    at once (its callback runs), but it retires only when the holder lets go: meanwhile its
    signal, complete, must leave the wait (else the wait returns at once, again and again)."""
    rt = make_runtime(gpus=1)
    fired = threading.Event()
    with rt.lock:
        fut = rt.devices[0].launch(sleep_ms, grid=(1,), block=(1,), args=(0,))
        fut.add_done_callback(lambda f: fired.set())
        assert fired.wait(DEADLINE_S), "settling waited for the lock"
        before = rt.hub.wakeups
        time.sleep(0.2)
        woke = rt.hub.wakeups - before
        assert not fut.retired
    assert fut.retired                            # (the holder retired it as it let go)
    assert woke < 5, f"the waiter woke {woke} times in 0.2 s for one completed future"


def test_work_nobody_waits_for_is_scanned_for_periodically_not_spun_on(make_runtime):
    """A held kernel nobody waits for: the waiter wakes about every POLL_S to scan for it (it
    must be retired soon after it completes), never in a spin."""
    rt = make_runtime(gpus=1)
    g = Gate()
    held = g.launch(rt.devices[0])
    try:
        time.sleep(0.05)
        before = rt.hub.wakeups
        time.sleep(0.5)
        woke = rt.hub.wakeups - before
    finally:
        g.open()
    assert 0 < woke <= 2 * 0.5 / signals.POLL_S, f"{woke} wake-ups in 0.5 s"
    assert held.wait(DEADLINE_S)


@pytest.mark.asyncio
async def test_an_awaiter_puts_work_nobody_waited_for_into_the_wait_at_once(make_runtime, long_timeouts,
                                                                          monkeypatch):
    """A future nobody waits for is not in the waiter's wait; a task parking on it makes the
    waiter rebuild its wait with it and wait again, right away (the timeouts are LONG_S: only
    the arm's wake-up can start that wait), and its completion then wakes the task."""
    rt = make_runtime(gpus=1)
    calls, cond = wait_calls(rt, monkeypatch)
    g = Gate()
    fut = g.launch(rt.devices[0])
    try:
        assert fut.signal not in fresh_wait(rt, calls, cond), "work nobody waits for is in the wait"
        start = len(calls)
        task = asyncio.ensure_future(_await(fut))
        await asyncio.sleep(0)                   # the task parks (arms)
        seen = await asyncio.to_thread(_until_a_wait_holds, calls, cond, start, fut.signal)
        assert seen, "the awaiter's future did not enter the wait"
    finally:
        g.open()
    await asyncio.wait_for(task, DEADLINE_S)


def _until_a_wait_holds(calls, cond, start, handle):
    with cond:
        return cond.wait_for(lambda: any(handle in c for c in calls[start:]), DEADLINE_S)


async def _await(fut):
    return await fut


# How each kind of registration waits for a future, from the test's (asyncio) task.
async def by_await(fut):
    await fut


async def by_done_callback(fut):
    done = threading.Event()
    fut.add_done_callback(lambda f: done.set())      # a thread's callback: runs on the waiter
    assert await asyncio.to_thread(done.wait, DEADLINE_S)


async def by_thread_wait(fut):
    assert await asyncio.to_thread(fut.wait, DEADLINE_S)


async def by_asyncio_callback(fut):
    await asyncio.wait_for(fut.asyncio(), DEADLINE_S)


REGISTRATIONS = [by_await, by_done_callback, by_thread_wait, by_asyncio_callback]


@pytest.mark.asyncio
@pytest.mark.parametrize("register", REGISTRATIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("completes", ["before_the_arm", "after_the_arm"])
async def test_a_completion_between_the_check_and_the_registration_is_not_lost(
        make_runtime, long_timeouts, monkeypatch, register, completes):
    """The registration found the future pending, and it completes on the device before (or
    just after) the arm puts it in the wait, before the registration itself: the waiter's
    rescan after the arm's wake-up (or the wait that the arm starts) settles it, and the
    registration fires, within the deadline (the timeouts are LONG_S)."""
    rt = make_runtime(gpus=1)
    g = Gate()
    fut = g.launch(rt.devices[0])
    arm = rt.hub.arm

    def late_arm(f):
        if f is fut and completes == "before_the_arm":
            g.open()
            until_device_done(rt, fut)
        arm(f)
        if f is fut and completes == "after_the_arm":
            g.open()
            until_device_done(rt, fut)

    monkeypatch.setattr(rt.hub, "arm", late_arm)
    try:
        await asyncio.sleep(0.02)                # the waiter waits without the future
        assert not fut.done()
        await asyncio.wait_for(register(fut), DEADLINE_S)
    finally:
        g.open()
    assert fut.done() and fut.result() is None


@pytest.fixture
def held_compile(monkeypatch):
    """Kernels named ``held_*`` compile only once the returned event is set."""
    release, done = threading.Event(), set()

    def needs(self, kernel):
        return kernel.name.startswith("held_") and (kernel, self.index) not in done

    def compile_(self, kernel):
        assert release.wait(30)
        done.add((kernel, self.index))

    monkeypatch.setattr(HsaDevice, "_needs_compile", needs)
    monkeypatch.setattr(HsaDevice, "_compile", compile_)
    return release


@aiogpu.kernel("u32", name="held_noop")
def held_noop(launch, n):
    pass


@pytest.mark.asyncio
async def test_each_kind_of_awaited_work_wakes_the_waiter(make_runtime, long_timeouts, held_compile):
    """Launches, copies each way, joins, graph replays and deferred launches (awaited before and
    after their submission) settle within the deadline when awaited: each path arms the work
    the awaiter waits for."""
    rt = make_runtime()
    d0, d1 = rt.devices
    x, y = d0.alloc(4096), d1.alloc(4096)
    host = np.arange(1024, dtype=np.float32)

    async def awaited(fut):
        return await asyncio.wait_for(_await(fut), DEADLINE_S)

    await awaited(aiogpu.copy(x, host))
    await awaited(d0.launch(sleep_ms, grid=(1,), block=(1,), args=(1,)))
    await awaited(aiogpu.copy(y, x))
    assert (await awaited(y.to_numpy(np.float32)) == host).all()
    a = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(1,))
    b = d1.launch(sleep_ms, grid=(1,), block=(1,), args=(1,))
    await awaited(aiogpu.gather(a, b))
    with aiogpu.Graph() as graph:
        node = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(1,))
        aiogpu.copy(y, x, after=[node])
    exe = graph.instantiate()
    await awaited(exe.launch())
    early = d0.launch(held_noop, grid=(1,), block=(1,), args=(0,))      # deferred: compiling
    task = asyncio.ensure_future(awaited(early))
    await asyncio.sleep(0.02)                    # parked on it before its submission
    held_compile.set()
    await task
    late = d0.launch(held_noop, grid=(1,), block=(1,), args=(0,))
    await awaited(late)
    exe.destroy()


@pytest.mark.asyncio
async def test_a_task_group_exits_as_soon_as_the_work_nobody_awaited_completes(make_runtime, long_timeouts):
    """The group waits for the GPU work submitted in it, awaited or not: once its body and tasks
    are done, it waits for that work like an awaiter."""
    rt = make_runtime()
    d0, d1 = rt.devices
    g = Gate()

    async def group():
        async with aiogpu.TaskGroup() as tg:
            held = g.launch(d0)
            for d in (d0, d1):
                d.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[held])
            asyncio.get_running_loop().call_later(0.05, g.open)
        return tg.submitted

    try:
        submitted = await asyncio.wait_for(group(), DEADLINE_S)
    finally:
        g.open()
    assert len(submitted) == 3 and all(f.done() for f in submitted)


@pytest.mark.asyncio
async def test_a_back_log_drains_without_the_periodic_scan(make_runtime, long_timeouts):
    """A ring of 4 with 30 launches nobody waits for but the last: the host must learn when the
    ring has room to publish the back-log (the queue's room marks), not at its periodic scan."""
    rt = make_runtime(ring_size=4, queues_per_device=1, gpus=1, emulator_min_queue_size=4)
    d0 = rt.devices[0]
    g = Gate()
    held = g.launch(d0)
    futs = [d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[held]) for _ in range(30)]
    assert d0.queues[0].backlog
    g.open()
    await asyncio.wait_for(_await(futs[-1]), DEADLINE_S)
    retire_the_rest(rt)


def test_a_failed_reader_retires_as_soon_as_the_writer_it_waited_for_does(make_runtime, long_timeouts):
    """A reader whose queue died while it waited for an earlier writer retires only once that
    writer has (``retire_failed``), and the next writer of what it read waits for it on the
    device: the host acts on the earlier writer's retirement, so it waits for it (nobody else
    does here)."""
    n = 64
    rt = make_runtime(gpus=2, queues_per_device=2)
    d0, d1 = rt.devices
    buf, out = d0.alloc(n * 8), d0.alloc(n * 8)
    assert aiogpu.gather(aiogpu.copy(buf, np.zeros(n, np.int64)),
                         aiogpu.copy(out, np.zeros(n, np.int64))).wait(DEADLINE_S)
    gate = Gate()
    held = gate.launch(d1)
    aiogpu.copy(buf, np.full(n, 5, np.int64), after=[held])          # the earlier writer
    rt.api.emulator.faults.queue_error_at(1, agent=0)
    reader = d0.launch(add_into, grid=(n,), block=(n,), args=(out, buf, n))
    try:
        assert reader.wait(DEADLINE_S) and isinstance(reader.exception(), aiogpu.GPUError)
        assert not reader.retired
        overwrite = aiogpu.copy(buf, np.full(n, 7, np.int64))
    finally:
        gate.open()
    assert overwrite.wait(DEADLINE_S) and overwrite.exception() is None
    got = buf.to_numpy(np.int64)
    assert got.wait(DEADLINE_S) and (got.result() == 7).all()
    retire_the_rest(rt)


@pytest.mark.asyncio
@pytest.mark.parametrize("eager", [False, True], ids=["doorbell", "eager"])
async def test_injected_queue_errors_fail_unawaited_work_and_its_awaited_dependents(make_runtime, long_timeouts,
                                                                                   eager):
    """A queue error on work nobody waits for reaches its awaited dependent on the other device
    at once (the error callback wakes the waiter), with the eager packet processor too."""
    rt = make_runtime(eager=eager)
    rt.api.emulator.faults.queue_error_at(1, agent=0)
    bad = await _fault_reaches_the_awaited_dependent(rt)
    assert bad.done() and isinstance(bad.exception(), aiogpu.GPUError)
    retire_the_rest(rt)      # (the dependent failed before it was awaited: nobody waits for it)


@pytest.mark.asyncio
async def test_a_memory_fault_fails_unawaited_work_and_its_awaited_dependents(make_runtime, long_timeouts):
    rt = make_runtime()
    rt.api.emulator.faults.memory_fault_at(1, agent=0)
    await _fault_reaches_the_awaited_dependent(rt)
    retire_the_rest(rt)


async def _fault_reaches_the_awaited_dependent(rt) -> Any:
    """A launch on device 0 that nobody awaits (the fault injected for it hits it), and a launch
    on device 1 after it that is awaited: the await raises GPUError within the deadline.
    Returns the faulting launch."""
    d0, d1 = rt.devices
    bad = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))
    dependent = d1.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[bad])
    with pytest.raises(aiogpu.GPUError):
        await asyncio.wait_for(_await(dependent), DEADLINE_S)
    return bad


@pytest.mark.asyncio
async def test_the_watchdog_fails_a_lost_completion_nobody_waits_for(make_runtime):
    """The watchdog runs at the waiter's scans, which pending work nobody waits for keeps
    coming: a lost completion nobody waits for fails, and so does the awaited work on another
    device that waits for it."""
    rt = make_runtime(watchdog_s=0.3)
    d0, d1 = rt.devices
    rt.api.emulator.faults.lose_completion_at(1, agent=0)
    lost = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))
    dependent = d1.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[lost])
    with pytest.raises(aiogpu.GPUError):
        await asyncio.wait_for(_await(dependent), DEADLINE_S)
    assert isinstance(lost.exception(), aiogpu.GPUError)


def test_a_loop_closed_with_work_pending_leaks_nothing(make_runtime):
    """Tasks parked on a future when their loop closes, and work nobody waits for, pending at
    the close: everything settles, retires and recycles its signal (the fixture's leak check)."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    g = Gate()
    held = g.launch(d0)
    unwaited = [d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[held]) for _ in range(20)]
    awaited = d0.launch(fail_if, grid=(1,), block=(1,), args=(d0.alloc(4), 0), after=[held])
    loop = asyncio.new_event_loop()
    tasks = [loop.create_task(_await(awaited)) for _ in range(5)]
    loop.run_until_complete(asyncio.sleep(0.05))
    loop.close()                                 # with the tasks parked on ``awaited``
    for task in tasks:                           # (they can never finish: that is the point)
        task._log_destroy_pending = False
    g.open()
    assert awaited.wait(DEADLINE_S)
    assert rt.leaks(DEADLINE_S) == {}
    assert all(f.done() for f in unwaited)
    del tasks


def test_a_back_log_drains_through_room_marks_with_nobody_waiting(make_runtime, long_timeouts):
    """Nobody waits for anything and the periodic scan is off: the queue's room marks (barrier
    packets on its own signals, with ROCr's asynchronous handlers) alone publish the back-log."""
    from backends import wait_until

    rt = make_runtime(ring_size=4, queues_per_device=1, gpus=1, emulator_min_queue_size=4)
    d0 = rt.devices[0]
    queue = d0.queues[0]
    g = Gate()
    held = g.launch(d0)
    futs = [d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[held]) for _ in range(30)]
    assert queue.backlog and queue._marks, "a back-log should have a room mark on its way"
    g.open()
    assert wait_until(lambda: not queue.backlog, DEADLINE_S), "the back-log never drained"
    assert rt.api.emulator._state.async_handlers.calls >= 1
    assert futs[-1].wait(DEADLINE_S) and futs[-1].exception() is None
    retire_the_rest(rt)


def test_a_launch_waiting_for_kernarg_room_runs_with_nobody_waiting_on_the_head(make_runtime, long_timeouts,
                                                                             monkeypatch):
    """The back-log's head waits for kernarg space that a gated kernel holds: the room mark then
    waits for completions (barrier bit), so that the scan after its event retires the gated
    kernel and frees its space; nobody waits on that kernel."""
    import aiogpu.hsa.runtime as hsa_runtime
    monkeypatch.setattr(hsa_runtime, "KERNARG_RING_BYTES", 16 * 64)     # 16 entries
    rt = make_runtime(gpus=1, queues_per_device=1)
    d0 = rt.devices[0]
    g = Gate()
    g.launch(d0)
    for _ in range(15):
        assert d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,)).wait(DEADLINE_S)
    waiting = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))
    assert len(d0.queues[0].backlog) == 1 and d0.queues[0]._short_of_kernargs
    g.open()
    assert waiting.wait(DEADLINE_S), "the launch waiting for kernarg room never ran"
    assert waiting.exception() is None
    retire_the_rest(rt)
