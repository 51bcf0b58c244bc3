"""A lane's launches leave its completion word to a later write (``encode.Lane.lazy``): one
write per ``LAZY_LAUNCHES`` launches in a row, and every ticket is covered before anything needs
it. Each way of needing a ticket is attacked here with the lane held (``fakecuda_controls.hold``:
its writes and host functions wait, in stream order, as on a GPU still running the work):

- the waiter's scan, with nobody waiting: the futures retire though the word never showed them
  (it queries the stream);
- an await's spin: the word is written before it polls;
- a parked await (no spin): the write is queued before the wake-up host function;
- ``done()`` in a polling loop, and ``wait()`` from a thread;
- work on another lane after it (an upload of what it writes): the write comes before the other
  lane's wait on the word;
- another library's stream made to wait for it (``wait_on``);
- launches awaited one by one write it at once (``Lane.eager``), until a burst comes;
- a runtime with a watchdog writes the word after every launch.

On the fake driver, in child processes; the scan and spin cases on both hot paths.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from backends import build_libcuda, needs_fake_libcuda, on_fake_cuda, run_on_fake_cuda

pytestmark = on_fake_cuda

PROLOGUE = r"""
import asyncio, json, threading, time
import fakecuda_controls as fc
import aiogpu
import aiogpu.cuda.driver as D
from aiogpu.cuda.encode import EAGER_GAP, LAZY_LAUNCHES

@aiogpu.kernel("u32", cuda='extern "C" __global__ void noop(unsigned n) {}')
def noop(launch, n):
    pass

rt = aiogpu.Runtime("cuda", queues_per_device=1, **OPTIONS)
dev = rt.devices[0]
dev.launch(noop, (1,), (1,), (0,)).wait(10)     # (compiled and loaded: the plain launch)
lane = next(l for l in dev.lanes if l.kind == "compute")
out = {"hot": D.HOT.name, "lazy": lane.lazy, "max": LAZY_LAUNCHES}
lane.eager = False      # (the warm-up's wait may have awaited its launch: see the last test)

async def awaiting(fut):
    return await fut

def held_entries():
    # What the held lane queues, in stream order: ("write", ticket) and ("host",).
    return [("write", e[2]) if e[0] == "write" else (e[0],) for e in fc._queues.get(int(lane.stream), ())]

def finish():
    out["leaks"] = rt.leaks(5)
    rt.close()
    print(json.dumps(out))
"""


def _run(body: str, options: str = "{}", **env: str) -> dict:
    script = PROLOGUE.replace("**OPTIONS", f"**{options}") + textwrap.dedent(body) + "\nfinish()\n"
    proc = run_on_fake_cuda(script, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Both hot paths: cuda-bindings, and the C one over the fake libcuda.so.1 (compiled lanes then
# call the driver themselves: ``Lane.direct``).
HOT_PATHS = pytest.mark.parametrize("hot", ["cuda-bindings", pytest.param("c", marks=needs_fake_libcuda)])


def _run_on(hot: str, body: str) -> dict:
    out = _run(body, **({"LD_LIBRARY_PATH": build_libcuda.build()} if hot == "c" else {}))
    if out["hot"] != hot:
        pytest.fail(f"the {hot} hot path did not load: {out}")
    return out


# -- nobody waits: one write per LAZY_LAUNCHES launches, and the waiter's scan retires them --------
UNAWAITED = r"""
futs, gaps = [], []
for i in range(3 * LAZY_LAUNCHES + 5):
    futs.append(dev.launch(noop, (1,), (1,), (i,)))
    gaps.append(lane.ticket - lane.written)
out["gaps"] = gaps
out["word_before"] = lane.word.value
out["ticket"] = lane.ticket
deadline = time.monotonic() + 10
while rt.hub.pending_count and time.monotonic() < deadline:   # (no done(): it would cover them)
    time.sleep(0.005)
out["pending_after"] = rt.hub.pending_count
out["word_after"] = lane.word.value
out["states"] = sorted({f._state for f in futs})
"""


@HOT_PATHS
def test_launches_nobody_awaits_write_the_word_once_per_lazy_run_and_still_retire(hot):
    out = _run_on(hot, UNAWAITED)
    assert out["lazy"] == out["max"] > 1, out
    gaps = out["gaps"]
    # Each launch leaves the word, until LAZY_LAUNCHES tickets went unwritten: then it writes.
    assert max(gaps) == out["max"] - 1 and gaps.count(0) == len(gaps) // out["max"], gaps
    # The tail was never written, and yet every future completed and retired: the waiter's scan
    # queried the stream beyond the word.
    assert out["word_after"] < out["ticket"], out
    assert out["pending_after"] == 0 and out["states"] == [1], out
    assert out["leaks"] == {}, out


# -- an await's spin covers the ticket before it polls ---------------------------------------------
SPIN = r"""
async def main():
    fc.hold(lane.stream)
    fut = dev.launch(noop, (1,), (1,), (1,))
    out["left"] = lane.written < fut.ticket
    task = asyncio.ensure_future(awaiting(fut))
    for _ in range(3):
        await asyncio.sleep(0)
    out["written"] = lane.written == fut.ticket
    out["held"] = held_entries()
    out["ticket"] = fut.ticket
    out["pending_while_held"] = not task.done()
    fc.release(lane.stream)
    await asyncio.wait_for(task, 10)
    out["done"] = fut.done() and fut.exception() is None
asyncio.run(main())
"""


@HOT_PATHS
def test_an_await_covers_the_ticket_before_it_spins(hot):
    out = _run_on(hot, SPIN)
    assert out["left"] and out["written"] and out["pending_while_held"] and out["done"], out
    assert out["held"] == [["write", out["ticket"]]], out
    assert out["leaks"] == {}, out


# -- a parked await: the write before the wake-up ----------------------------------------------
def test_a_parked_await_queues_the_write_before_its_wake_up():
    out = _run(r"""
    async def main():
        fc.hold(lane.stream)
        futs = [dev.launch(noop, (1,), (1,), (i,)) for i in range(3)]
        out["left"] = lane.written < futs[0].ticket
        task = asyncio.ensure_future(awaiting(futs[0]))   # (the oldest: later work is queued)
        for _ in range(3):
            await asyncio.sleep(0)
        out["held"] = held_entries()
        out["newest"] = lane.ticket
        fc.release(lane.stream)
        await asyncio.wait_for(task, 10)
        out["done"] = futs[0].done()
    asyncio.run(main())
    """, options="{'spin_s': 0}")
    assert out["left"] and out["done"], out
    # The lane's newest ticket written, then the host function: the waiter it wakes reads the
    # word showing the awaited ticket (and every one before it) done.
    assert out["held"] == [["write", out["newest"]], ["host"]], out
    assert out["leaks"] == {}, out


# -- done() polled, wait() from a thread -------------------------------------------------------
def test_done_polled_and_wait_from_a_thread_see_a_launch_left_unwritten():
    out = _run(r"""
    fc.hold(lane.stream)
    a = dev.launch(noop, (1,), (1,), (1,))
    b = dev.launch(noop, (1,), (1,), (2,))
    out["left"] = lane.written < a.ticket
    out["first_done"] = a.done()                     # (the device has not run it: held)
    out["written"] = lane.written == b.ticket
    fc.release(lane.stream)
    polls = 0
    deadline = time.monotonic() + 10
    while not a.done() and time.monotonic() < deadline:
        polls += 1
    out["a_done"] = a.done()
    fc.hold(lane.stream)
    c = dev.launch(noop, (1,), (1,), (3,))
    got = []
    t = threading.Thread(target=lambda: got.append(c.wait(10)))
    t.start()
    time.sleep(0.05)
    out["c_pending"] = not c.done() or not lane.written
    fc.release(lane.stream)
    t.join(20)
    out["c_done"] = got == [True] and b.done()
    """)
    assert out["left"] and not out["first_done"] and out["written"], out
    assert out["a_done"] and out["c_pending"] and out["c_done"], out
    assert out["leaks"] == {}, out


# -- work on another lane waits on the device: the write comes first ------------------------------
def test_work_on_another_lane_waits_only_after_the_ticket_is_written():
    out = _run(r"""
    x = dev.alloc(4096)
    k = aiogpu.kernel("f32*, u32", cuda='extern "C" __global__ void k(float* a, unsigned n) {}',
                      name="k")(lambda launch, a, n: None)
    import numpy as np
    dev.launch(k, (1,), (1,), (x, 0)).wait(10)
    lane.eager = False                                 # (as after the prologue's warm-up)
    fc.hold(lane.stream)
    fut = dev.launch(k, (1,), (1,), (x, 1))           # writes x, left unwritten
    out["left"] = lane.written < fut.ticket
    up = aiogpu.copy(x, np.ones(1024, np.float32))    # the upload (another lane) must wait for it
    out["up_lane_other"] = up.lane is not lane
    out["written_before_wait"] = lane.written >= fut.ticket
    out["held"] = held_entries()
    out["ticket"] = fut.ticket
    fc.release(lane.stream)
    out["done"] = up.wait(10) and fut.done()
    x.free()
    """)
    assert out["left"] and out["up_lane_other"] and out["done"], out
    assert out["written_before_wait"] and out["held"] == [["write", out["ticket"]]], out
    assert out["leaks"] == {}, out


# -- another library's stream made to wait ---------------------------------------------------------
def test_wait_on_a_foreign_stream_covers_the_ticket_first():
    out = _run(r"""
    from cuda.bindings import driver as cu
    err, s = cu.cuStreamCreate(0)
    fc.hold(lane.stream)
    fut = dev.launch(noop, (1,), (1,), (1,))
    out["left"] = lane.written < fut.ticket
    fut.wait_on(int(s))
    out["written"] = lane.written == fut.ticket
    out["held"] = held_entries()
    out["ticket"] = fut.ticket
    fc.release(lane.stream)
    out["done"] = fut.wait(10)
    """)
    assert out["left"] and out["written"] and out["done"], out
    assert out["held"] == [["write", out["ticket"]]], out
    assert out["leaks"] == {}, out


# -- a watchdog reads the word: every launch writes it ---------------------------------------------
def test_a_runtime_with_a_watchdog_writes_the_word_after_every_launch():
    out = _run(r"""
    gaps = []
    for i in range(LAZY_LAUNCHES + 3):
        dev.launch(noop, (1,), (1,), (i,))
        gaps.append(lane.ticket - lane.written)
    out["gaps"] = gaps
    """, options="{'watchdog_s': 5.0}")
    assert out["lazy"] == 0 and set(out["gaps"]) == {0}, out
    assert out["leaks"] == {}, out


# -- launches awaited one by one write the word at once --------------------------------------------
def test_launches_awaited_one_by_one_write_the_word_at_once_until_a_burst():
    out = _run(r"""
    import numpy as np
    async def main():
        gaps = []
        for i in range(2 * LAZY_LAUNCHES):              # launch, await; launch, await; ...
            fut = dev.launch(noop, (1,), (1,), (i,))
            gaps.append(lane.ticket - lane.written)
            await fut
        out["one_by_one"] = gaps
        fc.hold(lane.stream)                            # (so that the burst is pending when awaited)
        futs = [dev.launch(noop, (1,), (1,), (i,)) for i in range(EAGER_GAP + 2)]
        task = asyncio.ensure_future(awaiting(futs[-1]))   # a burst, its last awaited: lazy again
        await asyncio.sleep(0)
        fc.release(lane.stream)
        await task
        gaps = []
        for i in range(4):
            futs.append(dev.launch(noop, (1,), (1,), (i,)))
            gaps.append(lane.ticket - lane.written)
        out["after_burst"] = gaps
        x = dev.alloc(4096)
        for i in range(4):                              # copies awaited change nothing
            await aiogpu.copy(x, np.zeros(1024, np.float32))
        gaps = []
        for i in range(3):
            dev.launch(noop, (1,), (1,), (i,))
            gaps.append(lane.ticket - lane.written)
        out["after_copies"] = gaps
        await asyncio.gather(*futs)
        x.free()
    asyncio.run(main())
    """)
    # The first launches left the word (the lane was lazy); once an await found its launch
    # pending (the first, as a rule; the waiter may settle one before its await looks), each
    # launch wrote the word at once.
    assert out["one_by_one"][0] >= 1 and set(out["one_by_one"][8:]) == {0}, out
    assert out["after_burst"] == [1, 2, 3, 4] and out["after_copies"][0] >= 1, out
    assert out["leaks"] == {}, out
