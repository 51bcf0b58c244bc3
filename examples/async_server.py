"""An asyncio server whose requests do GPU work, without ever blocking the event loop.

Each connection sends a line with a number n; the server computes sum(k * factor for k < n) on a
GPU (spread over all devices) and answers. A heartbeat task measures the loop's responsiveness
while requests are in flight.

    python examples/async_server.py          # serves, runs 50 concurrent clients, prints a summary
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

import aiogpu


RAMP_CU = r"""
extern "C" __global__ void scaled_ramp(float* out, float factor, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (float)i * factor;
}
"""


@aiogpu.kernel("f32*, f32, u32", cuda=RAMP_CU)
def scaled_ramp(launch, out, factor, n):
    out[:n] = np.arange(n, dtype=np.float32) * factor


async def handle(reader, writer, devices, counter):
    line = await reader.readline()
    n = int(line)
    dev = devices[next(counter) % len(devices)]
    buf = dev.alloc(n * 4)
    dev.launch(scaled_ramp, grid=(n,), block=(256,), args=(buf, 0.5, n))
    result = float((await buf.to_numpy(np.float32)).sum())   # the loop serves others meanwhile
    buf.free()
    writer.write(f"{result}\n".encode())
    await writer.drain()
    writer.close()


async def client(port, n):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{n}\n".encode())
    await writer.drain()
    answer = float(await reader.readline())
    writer.close()
    return answer


async def heartbeat(stop, lags):
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.005)
        lags.append(time.perf_counter() - t - 0.005)


async def main(clients: int = 50) -> int:
    import itertools

    devices = aiogpu.devices()
    counter = itertools.count()
    server = await asyncio.start_server(lambda r, w: handle(r, w, devices, counter), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    stop, lags = asyncio.Event(), []
    beat = asyncio.ensure_future(heartbeat(stop, lags))
    sizes = [1000 + 37 * i for i in range(clients)]
    t0 = time.perf_counter()
    answers = await asyncio.gather(*(client(port, n) for n in sizes))
    elapsed = time.perf_counter() - t0
    stop.set()
    await beat
    server.close()
    await server.wait_closed()
    wrong = sum(abs(a - 0.5 * n * (n - 1) / 2) > 1e-3 * a for a, n in zip(answers, sizes))
    print(f"{clients} requests on {len(devices)} GPU(s) ({aiogpu.runtime().backend}) in {elapsed:.2f} s; "
          f"{wrong} wrong answers; worst event-loop lag {max(lags) * 1000:.1f} ms")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
