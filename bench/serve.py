"""The service benchmark: an aiohttp server doing a little GPU work per request, loaded by many
concurrent clients in a separate process, with the server's event-loop lag measured.

    python bench/serve.py --backend cuda --json bench/results/serve_h200.json
    python bench/serve.py --backend emulator --modes aiogpu --duration 2 --clients 8   # smoke

Each request POSTs ``n`` float32 values; the server answers ``2 * x + 1`` computed on the GPU
(work ``trivial``), or the same followed by about 1 ms of GPU time (work ``1ms``). Modes, same
work per request:

- ``aiogpu``: written the natural way: two ``dev.alloc`` per request, ``aiogpu.copy`` from the
  request's bytes, the kernels, ``await y.to_numpy()``, two ``free``;
- ``torch_executor``: PyTorch in ``loop.run_in_executor`` (the default thread pool);
- ``torch_blocking``: PyTorch called in the handler (blocks the loop while it synchronises);
- ``cupy_executor``: CuPy in ``loop.run_in_executor``;
- ``host_only`` (not run by default): NumPy on the loop, no GPU: aiohttp's own ceiling here.

The server runs on uvloop (``--loop asyncio`` for plain asyncio); a heartbeat task sleeps 1 ms at a
time and records how late it wakes (the event-loop lag). The load process keeps ``--clients``
requests in flight for ``--duration`` seconds after a warm-up, checks every answer, and records
latencies. One JSON entry per ``mode/work``: ``req_per_s``, ``p50_ms``, ``p99_ms``,
``lag_p99_ms``, ``wrong`` (and ``errors``, ``requests``, ``lag_max_ms``, and ``loop_cpu`` /
``process_cpu``: the server's CPU seconds per second on its loop thread / in all its threads, so
1.0 on the loop thread means the loop itself is the bottleneck).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

MODES = ("aiogpu", "torch_executor", "torch_blocking", "cupy_executor")
WORKS = ("trivial", "1ms")
SPIN_NS = 1_000_000

# -- GPU work, one implementation per mode ------------------------------------------------------
AFFINE_CU = r"""
extern "C" __global__ void affine(float* y, const float* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i] + 1.0f;
}
"""
SPIN_CU = r"""
extern "C" __global__ void spin(float* y, unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
"""


def _aiogpu_kernels():
    import aiogpu

    @aiogpu.kernel("f32*, const f32*, u32", cuda=AFFINE_CU)
    def affine(launch, y, x, n):
        y[:n] = 2.0 * x[:n] + 1.0

    @aiogpu.kernel("f32*, u64", cuda=SPIN_CU)
    def spin(launch, y, ns):
        time.sleep(ns / 1e9)

    return affine, spin


def make_aiogpu_handler(work: str, backend: str | None):
    import aiogpu

    devices = aiogpu.devices(backend)
    affine, spin = _aiogpu_kernels()
    turn = [0]

    async def compute(body: bytes) -> bytes:
        x_host = np.frombuffer(body, np.float32)
        n = x_host.size
        turn[0] += 1
        dev = devices[turn[0] % len(devices)]
        x, y = dev.alloc(x_host.nbytes), dev.alloc(x_host.nbytes)
        aiogpu.copy(x, x_host)
        dev.launch(affine, grid=(n,), block=(256,), args=(y, x, n))
        if work == "1ms":
            dev.launch(spin, grid=(1,), block=(1,), args=(y, SPIN_NS))
        out = await y.to_numpy(np.float32)
        x.free()
        y.free()
        return out.tobytes()

    return compute, lambda: aiogpu.runtime().close()


def _torch_compute(work: str):
    import torch

    dev = torch.device("cuda")
    cycles = _torch_cycles_per_ms(torch) if work == "1ms" else 0

    def run(body: bytes) -> bytes:
        x = torch.from_numpy(np.frombuffer(body, np.float32).copy()).to(dev, non_blocking=True)
        y = 2.0 * x + 1.0
        if cycles:
            torch.cuda._sleep(cycles)
        return y.cpu().numpy().tobytes()      # .cpu() synchronises

    return run


def _torch_cycles_per_ms(torch) -> int:
    """GPU clock cycles in 1 ms, measured with ``torch.cuda._sleep`` and events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 / start.elapsed_time(end))


def _cupy_compute(work: str):
    import cupy as cp

    affine = cp.RawKernel(AFFINE_CU, "affine")
    spin = cp.RawKernel(SPIN_CU, "spin")

    def run(body: bytes) -> bytes:
        x = cp.asarray(np.frombuffer(body, np.float32))
        y = cp.empty_like(x)
        n = x.size
        affine(((n + 255) // 256,), (256,), (y, x, np.uint32(n)))
        if work == "1ms":
            spin((1,), (1,), (y, np.uint64(SPIN_NS)))
        return cp.asnumpy(y).tobytes()        # synchronises

    return run


def make_handler(mode: str, work: str, backend: str | None):
    """(async compute(body) -> bytes, close())"""
    if mode == "aiogpu":
        return make_aiogpu_handler(work, backend)
    if mode == "host_only":          # the reference ceiling: aiohttp and NumPy, no GPU at all
        async def compute(body: bytes) -> bytes:
            return (2.0 * np.frombuffer(body, np.float32) + 1.0).astype(np.float32).tobytes()
        return compute, lambda: None
    run = _torch_compute(work) if mode.startswith("torch") else _cupy_compute(work)
    run(np.zeros(256, np.float32).tobytes())                       # warm up (context, kernels)
    if mode.endswith("_blocking"):
        async def compute(body: bytes) -> bytes:
            return run(body)
    else:
        async def compute(body: bytes) -> bytes:
            return await asyncio.get_running_loop().run_in_executor(None, run, body)
    return compute, lambda: None


# -- the server ----------------------------------------------------------------------------------
async def serve(args: argparse.Namespace) -> None:
    compute, close = make_handler(args.mode, args.work, args.backend)
    await serve_forever(compute, close, freeze=args.gc == "freeze")


async def serve_forever(compute: Any, close: Any, *, path: str = "/work", freeze: bool = False) -> None:
    """Serve ``POST path`` with ``await compute(body)`` on the running loop until SIGTERM, then
    ``close()``. Prints ``READY <port>`` once listening; ``GET /stats`` reports the loop's lag
    (a 1 ms heartbeat's lateness) and the cyclic collector's pauses since ``POST /reset``.
    ``freeze``: ``gc.freeze()`` first, as services do once started."""
    from aiohttp import web

    lags: list[float] = []
    stop = asyncio.Event()
    since = [time.perf_counter(), time.thread_time(), time.process_time()]

    async def heartbeat() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    async def work(request: web.Request) -> web.Response:
        return web.Response(body=await compute(await request.read()))

    gc_pauses: list[float] = []      # the cyclic garbage collector's pauses (they are loop lag too)
    gc_started = [0.0]

    def gc_watch(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_pauses.append(time.perf_counter() - gc_started[0])

    gc.callbacks.append(gc_watch)
    if freeze:                       # the objects of the imports (torch has a million) are
        gc.collect()                 # never scanned again
        gc.freeze()

    async def stats(request: web.Request) -> web.Response:
        got = np.array(lags or [0.0]) * 1e3
        pauses = np.array(gc_pauses or [0.0]) * 1e3
        wall = time.perf_counter() - since[0]
        return web.json_response({"loop_cpu": (time.thread_time() - since[1]) / wall,   # the loop thread
                                  "process_cpu": (time.process_time() - since[2]) / wall,  # every thread
                                  "lag_p99_ms": float(np.percentile(got, 99)), "lag_max_ms": float(got.max()),
                                  "lag_samples": len(lags), "gc_pauses": len(gc_pauses),
                                  "gc_pause_max_ms": float(pauses.max()), "gc_pause_total_ms": float(pauses.sum())})

    async def reset(request: web.Request) -> web.Response:
        lags.clear()
        gc_pauses.clear()
        since[:] = [time.perf_counter(), time.thread_time(), time.process_time()]
        return web.json_response({})

    app = web.Application(client_max_size=64 << 20)
    app.add_routes([web.post(path, work), web.get("/stats", stats), web.post("/reset", reset)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    beat = asyncio.ensure_future(heartbeat())
    print(f"READY {port}", flush=True)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await beat
    await runner.cleanup()
    close()


# -- the load ------------------------------------------------------------------------------------
async def load(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(1)
    payloads = [rng.standard_normal(args.n).astype(np.float32) for _ in range(16)]
    expect = [(2.0 * p + 1.0).astype(np.float32).tobytes() for p in payloads]
    got = await drive(args.port, "/work", [p.tobytes() for p in payloads], lambda k, body: body == expect[k],
                      clients=args.clients, warmup=args.warmup, duration=args.duration)
    return {**got, "n": args.n}


async def drive(port: str, path: str, bodies: list[bytes], right: Any, *, clients: int, warmup: float,
                duration: float) -> dict:
    """``clients`` concurrent clients posting ``bodies`` (in turn) to ``path`` for ``warmup``
    then ``duration`` seconds; each answer checked with ``right(index, body)``. Returns req/s,
    latency p50/p99, wrong answers and errors over ``duration``, with the server's ``/stats``."""
    import aiohttp

    url = f"http://127.0.0.1:{port}"
    latencies: list[float] = []
    counts = {"wrong": 0, "errors": 0}
    measuring = [False]
    deadline = time.perf_counter() + warmup + duration

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        k = i
        while time.perf_counter() < deadline:
            k = (k + 1) % len(bodies)
            t = time.perf_counter()
            try:
                async with session.post(url + path, data=bodies[k]) as resp:
                    got = await resp.read()
                    ok = resp.status == 200
            except aiohttp.ClientError:
                counts["errors"] += 1
                continue
            if not measuring[0]:
                continue
            latencies.append(time.perf_counter() - t)
            if not ok:
                counts["errors"] += 1
            elif not right(k, got):
                counts["wrong"] += 1

    connector = aiohttp.TCPConnector(limit=clients)
    # Control requests go through a session of their own: the load keeps every connection of
    # the other one busy.
    async with aiohttp.ClientSession(connector=connector) as session, aiohttp.ClientSession() as control:
        tasks = [asyncio.ensure_future(client(i, session)) for i in range(clients)]
        await asyncio.sleep(warmup)
        async with control.post(url + "/reset") as resp:
            await resp.read()
        measuring[0] = True
        t0 = time.perf_counter()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        async with control.get(url + "/stats") as resp:
            server = await resp.json()
    lat = np.array(latencies or [float("nan")]) * 1e3
    return {"req_per_s": len(latencies) / elapsed, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "lag_p99_ms": server["lag_p99_ms"],
            "lag_max_ms": server["lag_max_ms"], "wrong": counts["wrong"], "errors": counts["errors"],
            "gc_pauses": server["gc_pauses"], "gc_pause_max_ms": server["gc_pause_max_ms"],
            "gc_pause_total_ms": server["gc_pause_total_ms"], "loop_cpu": server["loop_cpu"],
            "process_cpu": server["process_cpu"], "requests": len(latencies), "clients": clients}


# -- the orchestrator ------------------------------------------------------------------------------
def run_one(mode: str, work: str, args: argparse.Namespace) -> dict:
    me = os.path.abspath(__file__)
    common = ["--backend", args.backend] if args.backend else []
    if args.profile and mode == "aiogpu":
        os.makedirs(args.profile, exist_ok=True)
        common += ["--profile", os.path.join(args.profile, f"profile_{mode}_{work}.txt")]
    if args.switch_interval:
        common += ["--switch-interval", str(args.switch_interval)]
    if args.wake_slice:
        common += ["--wake-slice", str(args.wake_slice)]
    if args.turn_budget_ms:
        common += ["--turn-budget-ms", str(args.turn_budget_ms)]
    if args.gc:
        common += ["--gc", args.gc]
    server = subprocess.Popen([sys.executable, me, "--serve", mode, work, "--loop", args.loop, *common],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"the {mode} server did not start (said {line!r})")
        port = line.split()[1]
        out = subprocess.run([sys.executable, me, "--load", port, "--duration", str(args.duration),
                              "--warmup", str(args.warmup), "--clients", str(args.clients), "--n", str(args.n)],
                             capture_output=True, text=True, timeout=args.duration + args.warmup + 120)
        if out.returncode != 0:
            raise RuntimeError(f"the load process failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def median_of(runs: list[dict]) -> dict:
    """The median of each figure over ``runs`` (wrong answers and errors: the sum), and the runs."""
    out = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    out["wrong"] = sum(r["wrong"] for r in runs)
    out["errors"] = sum(r["errors"] for r in runs)
    if len(runs) > 1:
        out["runs"] = runs
    return out


def available(mode: str) -> bool:
    if mode in ("aiogpu", "host_only"):
        return True
    try:
        if mode.startswith("torch"):
            import torch
            return torch.cuda.is_available()
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - absent or without a GPU: the mode is left out
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=None, help="aiogpu backend (default: auto)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--work", default=",".join(WORKS))
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--n", type=int, default=1024, help="float32 values per request")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--repeat", type=int, default=1, help="runs per mode/work; the median is reported")
    p.add_argument("--json", default=None)
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval in the server (seconds; an experiment knob)")
    p.add_argument("--gc", choices=("default", "freeze"), default=None,
                   help="freeze: gc.freeze() after start-up in the server (as services do)")
    p.add_argument("--wake-slice", type=int, default=None,
                   help="fixed aiogpu awaits resumed per loop iteration in the server (an experiment knob)")
    p.add_argument("--turn-budget-ms", type=float, default=None,
                   help="aiogpu._loops.TURN_BUDGET_S in the server, in ms (an experiment knob)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile each aiogpu server with pyinstrument; text reports go to DIR")
    p.add_argument("--serve", nargs=2, metavar=("MODE", "WORK"), help=argparse.SUPPRESS)
    p.add_argument("--load", metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        args.mode, args.work = args.serve
        if args.switch_interval:
            sys.setswitchinterval(args.switch_interval)
        from aiogpu import _loops
        if args.wake_slice:              # fixed slots per loop iteration (no adapting)
            _loops.WAKE_SLICE = _loops.SLICE_MIN = _loops.SLICE_MAX = args.wake_slice
        if args.turn_budget_ms:
            _loops.TURN_BUDGET_S = args.turn_budget_ms / 1e3
        runner = asyncio.run
        if args.loop == "uvloop":
            import uvloop
            runner = uvloop.run
        profiler = None
        if args.profile:
            from pyinstrument import Profiler
            profiler = Profiler(interval=0.0002, async_mode="disabled")
            profiler.start()
        runner(serve(args))
        if profiler is not None:
            profiler.stop()
            with open(args.profile, "w") as f:
                f.write(profiler.output_text(unicode=False, color=False, short_mode=False))
        return 0
    if args.load:
        args.port = args.load
        import uvloop
        print(json.dumps(uvloop.run(load(args))))
        return 0
    results = {}
    for work in args.work.split(","):
        for mode in args.modes.split(","):
            if not available(mode):
                print(f"{mode}: not available here, left out", file=sys.stderr)
                continue
            runs = [run_one(mode, work, args) for _ in range(args.repeat)]
            got = results[f"{mode}/{work}"] = median_of(runs)
            print(f"{mode + '/' + work:24s} {got['req_per_s']:9.0f} req/s  p50 {got['p50_ms']:7.2f} ms  "
                  f"p99 {got['p99_ms']:7.2f} ms  loop lag p99 {got['lag_p99_ms']:6.2f} ms  "
                  f"gc {got['gc_pauses']:.0f} pauses, max {got['gc_pause_max_ms']:.1f} ms  "
                  f"cpu loop {got['loop_cpu']:.2f} all {got['process_cpu']:.2f}  "
                  f"wrong {got['wrong']}  errors {got['errors']}", flush=True)
    if args.json:
        meta = {"clients": args.clients, "duration_s": args.duration, "n": args.n, "loop": args.loop,
                "repeat": args.repeat, "backend": args.backend}
        with open(args.json, "w") as f:
            json.dump({**results, "meta": meta}, f, indent=1)
    return 1 if any(r["wrong"] or r["errors"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
