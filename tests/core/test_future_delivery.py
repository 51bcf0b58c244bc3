"""How completions reach awaiters and done-callbacks: one batch per loop, each callback on its
own (a raising callback stops nothing else), the slots of a turn of the loop (an asyncio
iteration, a trio batch), a half-imported trio, closed loops, and trio's checkpoint rule."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import trio
import trio.testing

from aiogpu.futures import GPUFuture
from backends import Batches, Ticks
from fakes.fake_hub import ManualHub


async def _await(fut):
    await fut


def fixed_slice(monkeypatch, n: int) -> None:
    """Exactly ``n`` awaits admitted per loop iteration: woken ``n`` at a time, admission
    closed after ``n`` (a zero time budget), no adapting."""
    from aiogpu import _loops
    for name in ("WAKE_SLICE", "SLICE_MIN", "SLICE_MAX"):
        monkeypatch.setattr(_loops, name, n)
    monkeypatch.setattr(_loops, "TURN_BUDGET_S", 0.0)


@pytest.mark.asyncio
async def test_a_raising_callback_stops_no_other_wakeup_on_asyncio():
    hub, loop = ManualHub(), asyncio.get_running_loop()
    reported = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    first, second = hub.new(1), hub.new(2)
    ran = []
    first.add_done_callback(lambda f: 1 / 0)
    first.add_done_callback(ran.append)           # a later callback of the same future
    tasks = [asyncio.ensure_future(_await(second)) for _ in range(63)]
    await asyncio.sleep(0)                          # every task parks on ``second``
    hub.complete(first, second)                     # one batch: callbacks, then the awaiters
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert ran == [first]
    assert len(reported) == 1 and isinstance(reported[0]["exception"], ZeroDivisionError)


@pytest.mark.asyncio
async def test_a_large_batch_is_woken_in_slices_with_the_loop_running_between(monkeypatch):
    """64 tasks parked on one future are woken in slices of WAKE_SLICE per loop iteration: a
    callback that re-schedules itself every iteration (as timers and I/O get their turn) runs
    between the slices, so one completion never makes one long iteration of every task."""
    fixed_slice(monkeypatch, 8)
    hub = ManualHub()
    fut = hub.new(1)
    ticks, seen = Ticks(), []

    async def task() -> None:
        await fut
        seen.append(ticks.n)

    tasks = [asyncio.ensure_future(task()) for _ in range(64)]
    await asyncio.sleep(0)
    ticks.start()
    hub.complete(fut)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    ticks.stop()
    per_iteration = max(seen.count(t) for t in set(seen))
    assert len(seen) == 64 and per_iteration <= 8
    assert len(set(seen)) >= 8
    assert seen == sorted(seen)                      # in order: no task woken twice or skipped


@pytest.mark.asyncio
async def test_completions_posted_separately_are_still_woken_in_slices(monkeypatch):
    """The slice bounds the wake-ups of one loop iteration, not of one post: 64 futures
    completed one at a time (64 posts before the loop runs again, as a waiter thread that wakes
    per completion makes them) still wake at most WAKE_SLICE tasks per iteration, in order."""
    fixed_slice(monkeypatch, 8)
    hub = ManualHub()
    futs = [hub.new(k) for k in range(1, 65)]
    ticks, seen = Ticks(), []

    async def task(i: int) -> None:
        await futs[i]
        seen.append((ticks.n, i))

    tasks = [asyncio.ensure_future(task(i)) for i in range(64)]
    await asyncio.sleep(0)
    ticks.start()
    for f in futs:                                   # 64 separate posts, the loop blocked meanwhile
        hub.complete(f)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    ticks.stop()
    at = [t for t, _ in seen]
    assert max(at.count(t) for t in set(at)) <= 8
    assert [i for _, i in seen] == list(range(64))   # in completion order


@pytest.mark.asyncio
async def test_awaits_of_done_futures_take_slots_of_the_iteration_too(monkeypatch):
    """A burst of tasks whose GPU work finished before they awaited it (no wake-up needed)
    still goes on at most WAKE_SLICE per iteration: otherwise one iteration runs every
    request's host work and the loop's timers and sockets wait for all of it. Nothing is
    lost or reordered, and a done future awaited alone still returns without yielding."""
    fixed_slice(monkeypatch, 8)
    hub = ManualHub()
    futs = [hub.new(k) for k in range(1, 65)]
    hub.complete(*futs)
    ticks, seen = Ticks(), []

    async def task(i: int) -> None:
        await futs[i]
        seen.append((ticks.n, i))

    await asyncio.sleep(0)                           # a fresh iteration: no slot taken yet
    lone = _await(futs[0]).__await__()
    with pytest.raises(StopIteration):               # done, the first of its iteration: no yield
        lone.send(None)
    tasks = [asyncio.ensure_future(task(i)) for i in range(64)]
    ticks.start()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    ticks.stop()
    at = [t for t, _ in seen]
    assert max(at.count(t) for t in set(at)) <= 8
    assert len(set(at)) >= 8
    assert sorted(i for _, i in seen) == list(range(64))


async def _burst(hub, n: int, work_s: float) -> list[int]:
    """``n`` tasks parked on one future, each doing ``work_s`` of blocking host work once
    woken; the loop iteration each one resumed in."""
    fut = hub.new(1)
    ticks, seen = Ticks(), []

    async def task() -> None:
        await fut
        seen.append(ticks.n)
        if work_s:
            time.sleep(work_s)

    tasks = [asyncio.ensure_future(task()) for _ in range(n)]
    await asyncio.sleep(0)
    ticks.start()
    hub.complete(fut)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    ticks.stop()
    return seen


@pytest.mark.asyncio
async def test_the_slots_shrink_while_iterations_run_long():
    """Tasks that each do 1 ms of host work on waking: the slots per iteration fall to what
    fits the budget (1 ms: SLICE_MIN, the least), and at the end at most that many wake per
    iteration; the first iterations already stay within the initial slots."""
    from aiogpu import _loops
    seen = await _burst(ManualHub(), 48, 0.001)
    port = _loops.current_port()
    assert port.slice == _loops.SLICE_MIN
    last = seen[-12:]
    assert max(last.count(t) for t in set(last)) <= _loops.SLICE_MIN
    assert max(seen.count(t) for t in set(seen)) <= _loops.WAKE_SLICE


@pytest.mark.asyncio
async def test_the_slots_grow_while_iterations_are_short():
    """Tasks that do nothing on waking: iterations stay short, the slots grow, and a burst
    of 1,000 needs far fewer than 1,000 / WAKE_SLICE iterations."""
    from aiogpu import _loops
    seen = await _burst(ManualHub(), 1000, 0.0)
    assert _loops.current_port().slice > _loops.WAKE_SLICE
    assert len(set(seen)) < 1000 // _loops.WAKE_SLICE // 2
    assert max(seen.count(t) for t in set(seen)) <= _loops.SLICE_MAX


@pytest.mark.asyncio
async def test_other_work_in_the_loop_does_not_shrink_the_slots():
    """A task doing 5 ms of host work each iteration (not aiogpu's) makes every iteration
    long, and the cost per slot look high; a backlog of 400 cheap awaits still gets through
    in about BACKLOG_ITERATIONS iterations, not held to SLICE_MIN per iteration (that would
    take 200 iterations, a second here)."""
    from aiogpu import _loops
    busy = []

    async def other() -> None:
        while not busy:
            time.sleep(0.005)
            await asyncio.sleep(0)

    hog = asyncio.ensure_future(other())
    await asyncio.sleep(0)
    seen = await _burst(ManualHub(), 400, 0.0)
    busy.append(1)
    await hog
    assert len(set(seen)) < 2 * _loops.BACKLOG_ITERATIONS + 8


@pytest.mark.asyncio
async def test_a_task_cancelled_while_waiting_for_a_slot_leaves_the_others_going(monkeypatch):
    """One slot per iteration: tasks awaiting done futures queue for slots; cancelling one
    of them raises CancelledError in it alone, and every other task still goes on."""
    fixed_slice(monkeypatch, 1)
    hub = ManualHub()
    futs = [hub.new(k) for k in range(1, 9)]
    hub.complete(*futs)
    await asyncio.sleep(0)
    got = []

    async def task(i: int) -> None:
        await futs[i]
        got.append(i)

    tasks = [asyncio.ensure_future(task(i)) for i in range(8)]
    await asyncio.sleep(0)                   # the first goes on, the rest wait for slots
    tasks[5].cancel()
    done, _ = await asyncio.wait(tasks, timeout=5)
    assert len(done) == 8
    assert tasks[5].cancelled()
    assert sorted(got) == [0, 1, 2, 3, 4, 6, 7]


def test_a_raising_callback_stops_no_other_wakeup_on_trio(caplog):
    hub = ManualHub()
    first, second = hub.new(1), hub.new(2)
    ran, woken = [], []

    async def awaiter():
        await second
        woken.append(1)

    async def main():
        first.add_done_callback(lambda f: 1 / 0)
        first.add_done_callback(ran.append)
        async with trio.open_nursery() as nursery:
            for _ in range(63):
                nursery.start_soon(awaiter)
            await trio.sleep(0.01)
            with trio.fail_after(5):
                await trio.to_thread.run_sync(hub.complete, first, second)
        assert len(woken) == 63

    with caplog.at_level(logging.ERROR, logger="aiogpu"):
        trio.run(main)
    assert ran == [first]
    assert any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)


@pytest.mark.asyncio
async def test_half_imported_trio_is_not_touched(monkeypatch):
    # While another thread imports trio, sys.modules["trio"] is a module still being executed.
    monkeypatch.setitem(sys.modules, "trio", types.ModuleType("trio"))
    hub = ManualHub()
    pending, done = hub.new(1), hub.new(2)
    hub.complete(done)
    got = []
    pending.add_done_callback(got.append)
    await done
    task = asyncio.ensure_future(_await(pending))
    await asyncio.sleep(0)
    hub.complete(pending)
    await asyncio.wait_for(task, 5)
    await asyncio.sleep(0)
    assert got == [pending]


def test_closing_a_loop_with_parked_awaiters_prints_no_traceback(tmp_path):
    script = tmp_path / "closed_loop.py"
    script.write_text(textwrap.dedent("""
        import asyncio, gc, threading
        import aiogpu

        @aiogpu.kernel("u32")
        def hold(launch, key):
            GATE.wait(10)

        GATE = threading.Event()
        rt = aiogpu.Runtime("emulator", gpus=1)
        fut = rt.devices[0].launch(hold, grid=(1,), block=(1,), args=(0,))

        async def waiter():
            await fut

        loop = asyncio.new_event_loop()
        tasks = [loop.create_task(waiter()) for _ in range(20)]
        loop.run_until_complete(asyncio.sleep(0.05))
        loop.close()                   # with 20 tasks still parked on the GPU future
        GATE.set()
        assert fut.wait(10)
        del tasks
        gc.collect()
        rt.close()
        print("ok")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert "Event loop is closed" not in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_awaiting_a_done_future_is_a_trio_checkpoint():
    hub = ManualHub()
    fut = hub.new(1)
    hub.complete(fut)
    seen = []

    async def main():
        with trio.CancelScope() as scope:
            scope.cancel()
            await fut                       # a cancellation point even though it is done
            seen.append("not cancelled")
        assert scope.cancelled_caught

        progress = [0]
        finished = trio.Event()

        async def other():
            while not finished.is_set():
                progress[0] += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await trio.sleep(0)
            before = progress[0]
            for _ in range(50):
                await fut                   # a schedule point: ``other`` runs in between
            seen.append(progress[0] - before)
            finished.set()

    trio.run(main)
    assert len(seen) == 1 and seen[0] >= 25, seen


# -- trio: the slots of a batch ------------------------------------------------------------------
# trio runs the tasks runnable at the start of a batch in that batch, in an order of its own
# choosing; a task woken (rescheduled) during a batch runs in the next. A batch is trio's loop
# iteration: ``Batches`` counts them, as ``Ticks`` counts asyncio's.

def _per_batch(at: list[int]) -> int:
    """The most entries of ``at`` (batch numbers) that fall in one batch."""
    return max(at.count(n) for n in set(at))


def _trio_wakeups(n: int, one_post: bool) -> list[int]:
    """``n`` trio tasks parked on their own futures, then all completed in one post or one
    post each (the run blocked meanwhile): the batch each task woke in, in completion order."""
    hub = ManualHub()
    futs = [hub.new(k) for k in range(1, n + 1)]
    batches, seen = Batches(), []

    async def task(i: int) -> None:
        await futs[i]
        seen.append((batches.n, i))

    async def main() -> None:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(task, i)
                await trio.testing.wait_all_tasks_blocked()
                batches.start()
                if one_post:
                    hub.complete(*futs)
                else:
                    for f in futs:
                        hub.complete(f)

    trio.run(main)
    assert len(seen) == n                            # none lost
    return [b for b, _ in sorted(seen, key=lambda s: s[1])]


def test_a_large_post_is_woken_in_slices_on_trio(monkeypatch):
    """200 tasks parked on their own futures, all completed in one post: at most WAKE_SLICE
    of them wake per batch, in completion order batch by batch (within a batch trio orders
    the tasks as it likes); none is lost."""
    fixed_slice(monkeypatch, 8)
    at = _trio_wakeups(200, one_post=True)
    assert _per_batch(at) <= 8 and len(set(at)) >= 25
    assert at == sorted(at)                          # in completion order


def test_completions_posted_separately_are_woken_in_slices_on_trio(monkeypatch):
    """The slice bounds the wake-ups of a batch, not of a post: 64 futures completed one at a
    time (64 posts before the run goes on) still wake at most WAKE_SLICE tasks per batch, in
    completion order."""
    fixed_slice(monkeypatch, 8)
    at = _trio_wakeups(64, one_post=False)
    assert _per_batch(at) <= 8 and at == sorted(at)


def test_awaits_of_done_futures_take_slots_of_the_batch_on_trio(monkeypatch):
    """64 tasks awaiting futures that are done already: at most WAKE_SLICE of them go on per
    batch (each await a checkpoint still), none lost."""
    fixed_slice(monkeypatch, 8)
    hub = ManualHub()
    futs = [hub.new(k) for k in range(1, 65)]
    hub.complete(*futs)
    batches, seen = Batches(), []

    async def task(i: int) -> None:
        await futs[i]
        seen.append((batches.n, i))

    async def main() -> None:
        batches.start()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in range(64):
                    nursery.start_soon(task, i)

    trio.run(main)
    at = [n for n, _ in seen]
    assert sorted(i for _, i in seen) == list(range(64))
    assert _per_batch(at) <= 8 and len(set(at)) >= 8


def _trio_cancel_in_line(n: int, cancelled: range, posted_while_parked: bool) -> list[int]:
    """One slot per batch: ``n`` trio tasks await their own futures, completed before the
    tasks start (awaits of done futures, in line for slots) or in one post once all are
    parked (woken one a batch); once the first has gone on, the ``cancelled`` tasks (in the
    middle of the line) are cancelled. Checks that each raised Cancelled alone, or had gone
    on before the cancel came, that at least one was still waiting, and that every task not
    cancelled went on; returns the order in which tasks went on."""
    hub = ManualHub()
    futs = [hub.new(k) for k in range(1, n + 1)]
    if not posted_while_parked:
        hub.complete(*futs)
    scopes = [trio.CancelScope() for _ in range(n)]
    got: list[int] = []

    async def task(i: int) -> None:
        with scopes[i]:
            await futs[i]
            got.append(i)

    async def main() -> None:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(task, i)
                if posted_while_parked:
                    await trio.testing.wait_all_tasks_blocked()
                    hub.complete(*futs)
                while not got:                       # the first went on: the rest wait in line
                    await trio.sleep(0)
                # A batch or two later, the tasks in the middle of the line (trio may have run
                # the tasks in either order when they lined up) wait for their slots still: at
                # least one of them surely does (one a batch goes on).
                for i in cancelled:
                    scopes[i].cancel()

    trio.run(main)
    caught = [i for i in cancelled if scopes[i].cancelled_caught]
    assert caught, "no cancelled task was still waiting for its slot"
    assert all((i in got) != (i in caught) for i in cancelled), (got, caught)
    assert sorted(got) == [i for i in range(n) if i not in caught]
    return got


def test_a_task_cancelled_while_waiting_for_a_slot_leaves_the_others_going_on_trio(monkeypatch):
    """One slot per batch: tasks awaiting done futures wait in line for slots; cancelling
    some of them raises Cancelled in each alone, and every other task still goes on."""
    fixed_slice(monkeypatch, 1)
    _trio_cancel_in_line(16, range(6, 11), posted_while_parked=False)


def test_a_woken_task_cancelled_before_its_slot_takes_no_one_elses_wakeup_on_trio(monkeypatch):
    """One slot per batch: eight tasks parked on eight futures completed in one post go on one
    per batch; those cancelled after their completions were posted but before their turns
    raise Cancelled alone, and the wake-ups of the others all arrive, in completion order."""
    fixed_slice(monkeypatch, 1)
    got = _trio_cancel_in_line(8, range(3, 6), posted_while_parked=True)
    assert got == sorted(got)                            # in completion order


def test_done_callbacks_take_slots_and_a_raising_one_stops_none_on_trio(monkeypatch, caplog):
    """64 done-callbacks completed in one post run at most WAKE_SLICE per batch; one that
    raises is logged on the ``aiogpu`` logger and the others all run."""
    fixed_slice(monkeypatch, 8)
    hub = ManualHub()
    futs = [hub.new(k) for k in range(1, 65)]
    batches, ran = Batches(), []

    def record(fut: GPUFuture) -> None:
        if fut is futs[10]:
            raise ZeroDivisionError
        ran.append(batches.n)

    async def main() -> None:
        batches.start()
        for f in futs:
            f.add_done_callback(record)
        hub.complete(*futs)
        with trio.fail_after(10):
            while len(ran) < 63:
                await trio.sleep(0)

    with caplog.at_level(logging.ERROR, logger="aiogpu"):
        trio.run(main)
    assert len(ran) == 63 and _per_batch(ran) <= 8
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [ZeroDivisionError]


def test_keyboard_interrupt_from_a_callback_propagates_after_the_rest_is_handed_on_on_trio(monkeypatch):
    """A done-callback raising KeyboardInterrupt ends the run with it (delivered to the main
    task as a Ctrl-C is), and the 20 callbacks completed after it, in the same post, still run
    (over several drains of 2)."""
    fixed_slice(monkeypatch, 2)
    hub = ManualHub()
    futs = [hub.new(k) for k in range(1, 22)]
    ran = []

    def interrupt(_fut: GPUFuture) -> None:
        raise KeyboardInterrupt

    async def main() -> None:
        futs[0].add_done_callback(interrupt)
        for f in futs[1:]:
            f.add_done_callback(ran.append)
        hub.complete(*futs)
        await trio.sleep(5)

    with pytest.raises(KeyboardInterrupt):
        trio.run(main)
    assert ran == futs[1:]


def test_the_slots_shrink_while_batches_run_long_on_trio():
    """Tasks that each do 1 ms of host work on waking: the slots per batch fall to what fits
    the budget (SLICE_MIN, the least), and at the end at most that many wake per batch."""
    from aiogpu import _loops
    hub = ManualHub()
    fut = hub.new(1)
    batches, seen, slices = Batches(), [], []

    async def task() -> None:
        await fut
        seen.append(batches.n)
        time.sleep(0.001)

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for _ in range(48):
                    nursery.start_soon(task)
                await trio.testing.wait_all_tasks_blocked()
                batches.start()
                hub.complete(fut)
            slices.append(_loops.current_port().slice)

    trio.run(main)
    assert slices == [_loops.SLICE_MIN]
    last = seen[-12:]
    assert _per_batch(last) <= _loops.SLICE_MIN
    assert _per_batch(seen) <= _loops.WAKE_SLICE


def test_a_trio_run_keeps_its_port_however_many_runs_there_are():
    """A trio run's port (its queue, its slots) is the same object for as long as the run
    lasts, with 80 runs going on at once in as many threads."""
    from aiogpu import _loops
    runs, same = 80, []
    started = threading.Barrier(runs)

    async def main() -> None:
        first = _loops.current_port()
        started.wait(30)                            # every run has its port now
        same.append(_loops.current_port() is first)

    threads = [threading.Thread(target=trio.run, args=(main,)) for _ in range(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert same == [True] * runs
