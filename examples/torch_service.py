"""An aiohttp service that runs a small PyTorch model between aiogpu pre- and post-processing
kernels, awaiting all of it on the event loop (no executor, no torch.cuda.synchronize).

    python examples/torch_service.py                    # 64 clients for 5 s, on the first GPU
    python examples/torch_service.py --clients 64 --duration 10

Per request (``IN`` float32 values in, ``OUT`` out):
1. aiogpu: upload the body, ``normalize`` kernel (pre-processing) into a Buffer;
2. torch: ``pre.wait_on(stream)`` makes the request's torch stream wait for that kernel on the
   device; the model (two linear layers, on one of a few torch streams) reads the Buffer
   zero-copy (DLPack) and writes its output into another Buffer;
3. ``aiogpu.stream_future(stream)``: a future for the torch work, passed in ``after=`` of the
   ``clamp`` post-processing kernel (a wait on the device), then ``await out.to_numpy()``.

The server runs on uvloop in a child process with a heartbeat that records the event-loop lag;
this process is the load: ``--clients`` concurrent clients, every answer checked against the
model on the CPU. It prints req/s, p50/p99 latency and the loop lag p99. Without torch, CUDA or
aiogpu's CUDA backend it says what is missing and exits with status 0.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from serve import drive, serve_forever  # noqa: E402  (bench/serve.py: the service harness, heartbeat and all)

IN, HIDDEN, OUT = 256, 512, 64

NORMALIZE_CU = r"""
extern "C" __global__ void normalize(float* y, const float* x, float shift, float scale, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = (x[i] - shift) * scale;
}
"""
CLAMP_CU = r"""
extern "C" __global__ void clamp(float* y, const float* x, float lo, float hi, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fminf(fmaxf(x[i], lo), hi);
}
"""
SHIFT, SCALE, LO, HI = 0.5, 2.0, -1.0, 1.0


def missing() -> str | None:
    """Why this example cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA GPU"
    from aiogpu.runtime import cuda_available
    ok, why = cuda_available()
    if not ok:
        return f"aiogpu's CUDA backend is unavailable ({why})"
    try:
        import aiohttp  # noqa: F401
        import uvloop  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed"
    return None


def model_on(device: str):
    import torch
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    return model.to(device).eval()


def reference(model, x: np.ndarray) -> np.ndarray:
    """The whole pipeline on the CPU (the load checks every answer against it)."""
    import torch
    with torch.no_grad():
        h = torch.from_numpy((x - SHIFT) * SCALE)
        return np.clip(model(h[None])[0].numpy(), LO, HI)


# -- the service -------------------------------------------------------------------------------------
async def serve(streams: int, host_slots: int) -> None:
    import torch
    from aiohttp import web

    import aiogpu

    rt = aiogpu.Runtime("cuda")
    dev = rt.devices[0]
    torch.cuda.set_device(dev.index)
    model = model_on(f"cuda:{dev.index}")

    @aiogpu.kernel("f32*, const f32*, f32, f32, u32", cuda=NORMALIZE_CU)
    def normalize(launch, y, x, shift, scale, n):
        y[:n] = (x[:n] - shift) * scale

    @aiogpu.kernel("f32*, const f32*, f32, f32, u32", cuda=CLAMP_CU)
    def clamp(launch, y, x, lo, hi, n):
        y[:n] = np.clip(x[:n], lo, hi)

    await aiogpu.gather(dev.load(normalize), dev.load(clamp))      # compiled before serving
    pool = [torch.cuda.Stream(device=dev.index) for _ in range(streams)]
    turn = [0]
    # The loop stays responsive when few requests do their host work (torch's dispatch, the
    # submissions: about a millisecond each) in any one turn of the loop: with 64 clients ready
    # at once, 64 of them back to back would hold the loop for tens of milliseconds. The GPU
    # work still overlaps across requests: a request lets go of its slot once it is submitted.
    slots = asyncio.Semaphore(host_slots) if host_slots > 0 else None

    async def infer(body: bytes) -> bytes:
        x_host = np.frombuffer(body, np.float32)
        if x_host.size != IN:
            raise web.HTTPBadRequest(text=f"expected {IN} float32 values")
        if slots is None:
            return await run(x_host)
        async with slots:
            done = submit(x_host)
            # Hand the loop on while holding the slot: a slot is taken and given back within one
            # turn otherwise, and then any number of requests would submit in that turn.
            await asyncio.sleep(0)
        return await finish(*done)

    async def run(x_host: np.ndarray) -> bytes:
        return await finish(*submit(x_host))

    def submit(x_host: np.ndarray) -> tuple:
        """Everything up to the download, queued without waiting (the request's host work)."""
        raw, pre_out, mid, out = dev.alloc(IN * 4), dev.alloc(IN * 4), dev.alloc(OUT * 4), dev.alloc(OUT * 4)
        aiogpu.copy(raw, x_host)
        pre = dev.launch(normalize, (IN,), (IN,), (pre_out, raw, SHIFT, SCALE, IN))
        stream = pool[turn[0] % len(pool)]
        turn[0] += 1
        pre.wait_on(stream)                              # torch waits for the kernel, on the GPU
        with torch.cuda.stream(stream), torch.no_grad():
            t_in = torch.from_dlpack(pre_out).view(torch.float32)
            t_out = torch.from_dlpack(mid).view(torch.float32)
            t_out.copy_(model(t_in[None])[0])
        torch_done = aiogpu.stream_future(stream, runtime=rt)
        dev.launch(clamp, (OUT,), (OUT,), (out, mid, LO, HI, OUT), after=[torch_done])
        del t_in, t_out                                  # torch lets go of the buffers
        return out.to_numpy(np.float32), (raw, pre_out, mid, out)

    async def finish(download: Any, buffers: tuple) -> bytes:
        result = await download
        for b in buffers:
            b.free()                                     # (freed once the GPU is done with them)
        return result.tobytes()

    # freeze: the objects of the imports (torch's, a million) go to the collector's permanent
    # generation, so that no full collection scans them mid-request (tens of ms each, here).
    await serve_forever(infer, rt.close, path="/infer", freeze=True)


# -- the load ------------------------------------------------------------------------------------------
async def load(port: str, clients: int, duration: float, warmup: float) -> dict:
    model = model_on("cpu")
    rng = np.random.default_rng(1)
    inputs = [rng.random(IN, dtype=np.float32) for _ in range(16)]
    expect = [reference(model, x) for x in inputs]

    def right(k: int, body: bytes) -> bool:
        return bool(np.allclose(np.frombuffer(body, np.float32), expect[k], rtol=1e-3, atol=1e-4))

    return await drive(port, "/infer", [x.tobytes() for x in inputs], right, clients=clients,
                       warmup=warmup, duration=duration)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--streams", type=int, default=8, help="torch streams the requests take turns on")
    p.add_argument("--host-slots", type=int, default=2,
                   help="requests doing their host work at once (0: no limit)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    why = missing()
    if why is not None:
        print(f"torch_service: skipped: {why} (this example needs PyTorch with CUDA and aiogpu's CUDA backend)")
        return 0
    import uvloop
    if args.serve:
        uvloop.run(serve(args.streams, args.host_slots))
        return 0
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--streams", str(args.streams),
                               "--host-slots", str(args.host_slots)],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if not line.startswith("READY"):
            print(f"torch_service: the server did not start (said {line!r})", file=sys.stderr)
            return 1
        got = uvloop.run(load(line.split()[1], args.clients, args.duration, args.warmup))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    print(f"torch_service: {got['req_per_s']:.0f} req/s at {got['clients']} clients, p50 {got['p50_ms']:.2f} ms, "
          f"p99 {got['p99_ms']:.2f} ms, loop lag p99 {got['lag_p99_ms']:.2f} ms (max {got['lag_max_ms']:.2f}), "
          f"{got['wrong']} wrong, {got['errors']} errors")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f, indent=1)
    return 1 if got["wrong"] or got["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
