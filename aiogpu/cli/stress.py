"""``python -m aiogpu stress``: randomised GPU work under injected faults, checked against NumPy.

Each of many concurrent tasks keeps a few device buffers and a NumPy *shadow* of what they must
hold. It submits random operations without awaiting them (kernels, host-to-device,
device-to-device and peer copies, gathers, replays of a small captured graph), relying on the
runtime to order them on the device, and now and then copies a buffer back and compares it with
the shadow. Meanwhile faults are injected at random points: queue errors, memory faults (on the
last GPU only: a memory fault loses its device for good, DeviceLost), lost
completions (caught by the runtime's watchdog), delayed completions, SDMA exhaustion and the eager
packet processor. A failed read-back must be a GPUError that follows from an injected fault (its
cause chain leads to one: see ``injected_cause``), then the task re-uploads its shadow; any other
failure is unexpected. A successful read-back must match. ``--ops N`` submits exactly N random
operations (a gather of three launches counts four, a graph replay two; read-backs and
re-uploads are checks, not counted). At the end every resource counter must be back at its
baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import aiogpu
from aiogpu.cli import closing
from aiogpu.errors import InjectedFault
from aiogpu.futures import cause_chain
from aiogpu.hsa_bindings import types as T
from aiogpu.runtime import Leaks

WORDS = 64          # int64 elements per buffer
OP_TIMEOUT_S = 60.0  # an await that takes longer than this counts as a hang
REPORT_S = 2.0       # seconds between progress lines
REPORT_TICK_S = 0.1  # how often the reporter looks whether the run has started draining


# Launched over grid=(WORDS,) on WORDS-word buffers: one work-item per word, so the OpenCL C
# (AMD agents; comgr compiles it) does what the bodies do to the whole buffer.
ADD_CONST_CL = """
__kernel void add_const(__global long* x, long c) {
    x[get_global_id(0)] += c;
}
"""

ADD_BUF_CL = """
__kernel void add_buf(__global long* dst, __global const long* src) {
    size_t i = get_global_id(0);
    dst[i] += src[i];
}
"""


@aiogpu.kernel("i64*, i64", opencl=ADD_CONST_CL)
def add_const(launch, x, c):
    x[:] += c


@aiogpu.kernel("i64*, const i64*", opencl=ADD_BUF_CL)
def add_buf(launch, dst, src):
    dst[:] += src[:]


@dataclass
class Stats:
    ops: int = 0
    checks: int = 0
    failed: int = 0          # futures whose GPUError follows from an injected fault
    unexpected: int = 0      # GPUErrors that no injected fault explains
    mismatches: int = 0
    hangs: int = 0
    faults: int = 0
    notes: list = field(default_factory=list)
    total: int = 0           # operations asked for
    started: float = 0.0     # monotonic time the run started
    tenths: list = field(default_factory=list)   # monotonic time as each tenth was submitted

    def count(self, n: int) -> None:
        """``n`` more operations submitted (notes the time at each tenth of the run)."""
        self.ops += n
        while self.total and len(self.tenths) < 10 and self.ops >= self.total * (len(self.tenths) + 1) / 10:
            self.tenths.append(time.monotonic())

    def tenth_rates(self, start: float) -> tuple[float, float] | None:
        """Operations per second over the first and the last tenth of the run."""
        if len(self.tenths) < 10:
            return None
        step = self.total / 10
        return step / max(self.tenths[0] - start, 1e-9), step / max(self.tenths[9] - self.tenths[8], 1e-9)


class World:
    """One task's buffers on random devices and their NumPy shadows."""

    def __init__(self, rng: random.Random, devices: list):
        self.rng = rng
        self.buffers = [devices[rng.randrange(len(devices))].alloc(WORDS * 8) for _ in range(3)]
        self.shadow = [np.zeros(WORDS, np.int64) for _ in self.buffers]
        self.graph: Any = None

    def upload(self) -> list:
        return [aiogpu.copy(b, s.copy()) for b, s in zip(self.buffers, self.shadow)]


async def _guarded(fut: Any, stats: Stats, faults: Any) -> bool:
    """Await ``fut``; True if it completed. Failures and hangs are counted: a failure is
    expected only when an injected fault caused it (``injected_cause``)."""
    try:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the cancellation
        # Ctrl-C sends, and the run would go on.
        async with asyncio.timeout(OP_TIMEOUT_S):
            await fut
        return True
    except TimeoutError:
        stats.hangs += 1
        stats.notes.append(f"hang: {fut!r}")
    except aiogpu.GPUError as exc:
        if injected_cause(exc, faults) is not None:
            stats.failed += 1
        else:
            stats.unexpected += 1
            chain = " <- ".join(f"{type(e).__name__}: {e}" for e in cause_chain(exc))
            stats.notes.append(f"failure no injected fault explains: {chain}")
    return False


def injected_cause(exc: BaseException, faults: Any) -> Any:
    """The injected fault that ``exc`` follows from, or None.

    A failure carries its cause chain: a dependent's GPUError names the failure it follows from,
    a queue-mate's names the queue's error, and a queue error names what the emulator saw
    (``EmulatedLibrary.queue_error_cause``): an ``InjectedFault`` for an injected queue error or
    memory fault. A lost completion shows as the runtime's WatchdogTimeout for that packet: it is
    injected if the emulator lost a completion of that GPU at that packet index.
    """
    for e in cause_chain(exc):
        if isinstance(e, InjectedFault):
            return e.record
        if isinstance(e, aiogpu.WatchdogTimeout):
            gpu = _gpu_of(e.queue)
            return next((f for f in list(faults.fired) if f.kind == "lost_completion" and f.agent == gpu
                         and f.packet == e.packet), None)
    return None


def _gpu_of(queue: str | None) -> int | None:
    """The GPU index of a runtime queue or engine name ("gpu1.q0", "gpu1.sdma0")."""
    if not queue or not queue.startswith("gpu"):
        return None
    head = queue[3:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _take(budget: list, n: int) -> bool:
    """Reserve ``n`` operations of the run's budget (all or none)."""
    if budget[0] < n:
        return False
    budget[0] -= n
    return True


def random_op(world: World, budget: list, stats: Stats) -> int:
    """Submit one random operation that fits the budget and update the shadow as the device
    will; returns how many GPU operations it submitted (0: the budget is spent)."""
    rng, bufs, shadow = world.rng, world.buffers, world.shadow
    choice = rng.random()
    i, j = rng.randrange(len(bufs)), rng.randrange(len(bufs))
    if choice >= 0.9 and _take(budget, len(bufs) + 1):   # a launch per buffer and their gather
        futs = [bufs[k].device.launch(add_const, grid=(WORDS,), block=(64,), args=(bufs[k], 1))
                for k in range(len(bufs))]
        aiogpu.gather(*futs)
        for s in shadow:
            s += 1
        n = len(bufs) + 1
    elif 0.8 <= choice < 0.9 and _take(budget, 2):       # a graph replay: a launch and a copy
        if world.graph is None:
            with aiogpu.Graph() as g:
                a = bufs[0].device.launch(add_const, grid=(WORDS,), block=(64,), args=(bufs[0], 3))
                aiogpu.copy(bufs[1], bufs[0], after=[a])
            world.graph = g.instantiate()
        world.graph.launch()
        shadow[0] += 3
        shadow[1] = shadow[0].copy()
        n = 2
    elif not _take(budget, 1):
        return 0
    elif 0.35 <= choice < 0.5 and i != j and bufs[i].device is bufs[j].device:
        bufs[i].device.launch(add_buf, grid=(WORDS,), block=(64,), args=(bufs[i], bufs[j]))
        shadow[i] += shadow[j]
        n = 1
    elif 0.5 <= choice < 0.7 and i != j:
        aiogpu.copy(bufs[i], bufs[j])                    # D2D or peer
        shadow[i] = shadow[j].copy()
        n = 1
    elif 0.7 <= choice < 0.8:
        data = np.arange(WORDS, dtype=np.int64) * rng.randrange(1, 9)
        aiogpu.copy(bufs[i], data)                        # H2D (the future keeps data alive)
        shadow[i] = data.copy()
        n = 1
    else:                                                 # (and what did not fit the budget)
        c = rng.randrange(1, 100)
        bufs[i].device.launch(add_const, grid=(WORDS,), block=(64,), args=(bufs[i], c))
        shadow[i] += c
        n = 1
    stats.count(n)
    return n


async def worker(seed: int, devices: list, budget: list, stats: Stats, faults: Any) -> None:
    world = World(random.Random(seed), devices)
    await _guarded(aiogpu.gather(*world.upload()), stats, faults)
    while budget[0] > 0:
        for _ in range(world.rng.randrange(4, 16)):
            if not random_op(world, budget, stats):
                break
        k = world.rng.randrange(len(world.buffers))
        out = world.buffers[k].to_numpy(np.int64)
        stats.checks += 1
        if await _guarded(out, stats, faults):
            if not np.array_equal(out.result(), world.shadow[k]):
                stats.mismatches += 1
                stats.notes.append(f"mismatch in task {seed}, buffer {k}")
        else:                                   # resynchronise the device with the shadow
            await _guarded(aiogpu.gather(*world.upload()), stats, faults)
    for b in world.buffers:
        b.free()


async def injector(rt: Any, rng: random.Random, stop: asyncio.Event, stats: Stats, period: float) -> None:
    """Arm a random fault every ``period`` seconds on average while the workers run. The loop
    is busy with the workers' bursts, so this task may wake late: it then arms the faults that
    fell due meanwhile (up to 8 at a time), keeping the rate whatever the load."""
    faults = rt.api.emulator.faults
    gpus = len(rt.devices)
    loop = asyncio.get_running_loop()
    last = loop.time()
    while not stop.is_set():
        await asyncio.sleep(period * (0.5 + rng.random()))
        now = loop.time()
        due, last = max(1, min(8, round((now - last) / period))), now
        for _ in range(due):
            kind = rng.choice(["queue_error", "memory_fault", "lost", "delay", "sdma", "eager"])
            stats.faults += 1
            if kind == "queue_error":
                faults.queue_error_at(rng.randrange(1, 50), status=rng.choice(
                    [T.HSA_STATUS_ERROR_EXCEPTION, T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT]),
                    agent=rng.randrange(gpus))
            elif kind == "memory_fault":
                # A memory fault loses its device for the rest of the process (DeviceLost): only
                # the last GPU takes them, so the others stay to be stressed.
                if gpus > 1:
                    faults.memory_fault_at(rng.randrange(1, 50), agent=gpus - 1)
            elif kind == "lost":
                faults.lose_completion_at(rng.randrange(1, 50))
            elif kind == "delay":
                faults.delay_completions(0.05, count=rng.randrange(1, 5))
            elif kind == "sdma":              # a state for a while: the rest waits for next time
                faults.exhaust_sdma(rng.randrange(gpus))
                await asyncio.sleep(period)
                faults.restore_sdma()
                break
            else:
                faults.eager = True
                await asyncio.sleep(period)
                faults.eager = False
                break


def wait_idle(rt: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while rt.hub.pending_count and time.monotonic() < deadline:
        time.sleep(0.01)


def count_leaks(rt: Any) -> Leaks:
    """What the runtime still holds once no work is pending (the runtime's one leak check)."""
    return rt.leaks(5.0, buffers=True)


async def run_async(rt: Any, ops: int, tasks: int, seed: int, faults: bool, period: float,
                    progress: Any) -> Stats:
    stats, budget = Stats(total=ops), [ops]
    stats.started = time.monotonic()
    rng = random.Random(seed)
    stop = asyncio.Event()
    inj = asyncio.ensure_future(injector(rt, rng, stop, stats, period)) if faults else None
    fault_log = rt.api.emulator.faults
    workers = [asyncio.ensure_future(worker(seed * 1000 + i, rt.devices, budget, stats, fault_log))
               for i in range(tasks)]
    report = asyncio.ensure_future(_report(rt, stats, ops, budget, workers, progress, stop))
    await asyncio.gather(*workers)
    stop.set()
    for t in (inj, report):
        if t is not None:
            await t
    return stats


async def _report(rt: Any, stats: Stats, total: int, budget: list, workers: list, progress: Any,
                  stop: asyncio.Event) -> None:
    """Progress every ``REPORT_S`` while the workers run, and at once when every operation has
    been submitted: from then on the run is draining (the tasks' last read-backs, what is still
    pending on the device), which the line says instead of repeating "N/N ops"."""
    loop = asyncio.get_running_loop()
    said_at, draining = None, False
    while not stop.is_set():
        now, spent = loop.time(), budget[0] <= 0
        if said_at is None or now - said_at >= REPORT_S or spent != draining:
            draining, said_at = spent, now
            if draining:
                running = sum(not w.done() for w in workers)
                progress(f"draining: {stats.ops}/{total} ops submitted; waiting for {running} of {len(workers)} "
                         f"tasks' last checks, {rt.hub.pending_count} operations pending on the device")
            else:
                progress(f"{stats.ops}/{total} ops, {stats.faults} faults, {stats.failed} failed as expected, "
                         f"{stats.mismatches} mismatches")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REPORT_TICK_S):
                await stop.wait()


def run_stress(*, ops: int, gpus: int, seed: int, tasks: int = 256, faults: bool = True,
               period: float = 0.2, progress: Any = lambda msg: None) -> tuple[Stats, Leaks]:
    """Run the stress workload on a fresh emulated runtime; returns (stats, leaks)."""
    rt = aiogpu.Runtime("emulator", gpus=gpus, watchdog_s=3.0)
    with closing(rt):
        stats = asyncio.run(run_async(rt, ops, tasks, seed, faults, period, progress))
        rt.api.emulator.faults.reset()
        progress(f"draining: every task done; {rt.hub.pending_count} operations pending on the device")
        wait_idle(rt, 30)
        gc.collect()
        progress("checking for leaks")
        leaks = count_leaks(rt)
        stats.faults = max(stats.faults, len(rt.api.emulator.faults.fired))
    return stats, leaks


def summary_line(stats: Stats, leaks: dict) -> str:
    line = (f"stress: {stats.ops} ops, {stats.faults} faults injected, {stats.failed} futures failed as "
            f"expected, {stats.mismatches} mismatches, {sum(leaks.values())} leaks, {stats.hangs} hangs")
    rates = stats.tenth_rates(stats.started)
    if rates is not None:
        line += f" (ops/s first tenth {rates[0]:.0f}, last tenth {rates[1]:.0f})"
    return line


def run(args: argparse.Namespace) -> int:
    ops = args.ops or (10_000 if args.quick else 100_000)
    tasks = 64 if args.quick else 256
    t0 = time.monotonic()

    def progress(msg: str) -> None:
        print(f"  [{time.monotonic() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    stats, leaks = run_stress(ops=ops, gpus=args.gpus, seed=args.seed, tasks=tasks, progress=progress)
    for note in stats.notes[:20]:
        print(f"  note: {note}")
    if leaks:
        print("  leaks: " + leaks.describe().replace("\n", "\n  "))
    if stats.unexpected:
        print(f"  {stats.unexpected} unexpected failures")
    print(summary_line(stats, leaks))
    ok = not (stats.mismatches or leaks or stats.hangs or stats.unexpected)
    return 0 if ok else 1
