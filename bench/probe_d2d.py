"""Where do D2D copies through aiogpu lose bandwidth against raw cuMemcpy? (H200 diagnostic)

Times 10 back-to-back 1 GiB device-to-device copies, one sync, for: raw cuMemcpyDtoDAsync;
raw cuMemcpyAsync; raw copies each followed by cuStreamWriteValue64 to host-mapped memory (what an
aiogpu lane adds); and aiogpu itself, with completion words and with events, timed both by
synchronizing its copy stream and by awaiting the joined futures (which adds the await path).
"""
import asyncio
import time

from cuda.bindings import driver as cu

import aiogpu

N, REPS = 1 << 30, 10


def gbs(t):
    return REPS * N / t / 1e9


def timed(fn, stream):
    fn()
    cu.cuStreamSynchronize(stream)
    t = time.perf_counter()
    for _ in range(REPS):
        fn()
    cu.cuStreamSynchronize(stream)
    return gbs(time.perf_counter() - t)


def main():
    for event_waits in (False, True):
        rt = aiogpu.Runtime("cuda", event_waits=event_waits)
        d = rt.devices[0]
        a, b = d.alloc(N), d.alloc(N)

        async def run():
            await aiogpu.copy(b, a)
            t = time.perf_counter()
            futs = [aiogpu.copy(b, a) for _ in range(REPS)]
            cu.cuStreamSynchronize(d.d2d.stream)
            synced = gbs(time.perf_counter() - t)
            await aiogpu.gather(*futs)
            return synced, gbs(time.perf_counter() - t)

        for attempt in (1, 2):
            synced, awaited = asyncio.run(run())
            print(f"aiogpu event_waits={event_waits} run {attempt}: stream-synchronized {synced:.0f} GB/s, "
                  f"awaited {awaited:.0f} GB/s")
        if not event_waits:
            d.make_current()
            _, s = cu.cuStreamCreate(1)
            print(f"raw cuMemcpyDtoDAsync: {timed(lambda: cu.cuMemcpyDtoDAsync(b.address, a.address, N, s), s):.0f}")
            print(f"raw cuMemcpyAsync:     {timed(lambda: cu.cuMemcpyAsync(b.address, a.address, N, s), s):.0f}")
            err, host = cu.cuMemHostAlloc(8, 0x2)            # DEVICEMAP
            err, dptr = cu.cuMemHostGetDevicePointer(host, 0)
            k = [0]

            def copy_and_write():
                k[0] += 1
                cu.cuMemcpyDtoDAsync(b.address, a.address, N, s)
                cu.cuStreamWriteValue64(s, dptr, k[0], 0)
            print(f"raw DtoD + WriteValue64 each: {timed(copy_and_write, s):.0f}")
            lane = d.d2d
            print(f"raw DtoD on aiogpu's d2d stream: {timed(lambda: cu.cuMemcpyDtoDAsync(b.address, a.address, N, lane.stream), lane.stream):.0f}")
            print("buffers", hex(a.address), hex(b.address))
        rt.close()


main()
