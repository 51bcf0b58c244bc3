"""Typical use of the public API, type-checked by test_typing.py (mypy must accept it)."""
import asyncio
import numpy as np
import aiogpu


@aiogpu.kernel("f32*, const f32*, f32, u32")
def saxpy(launch: object, y: np.ndarray, x: np.ndarray, a: float, n: int) -> None:
    y[:n] += a * x[:n]


async def main() -> None:
    devs: list[aiogpu.Device] = aiogpu.devices()
    d0 = devs[0]
    n = 1024
    x: aiogpu.Buffer = d0.alloc(n * 4)
    y = d0.alloc(n * 4)
    f1: aiogpu.GPUFuture = aiogpu.copy(x, np.ones(n, np.float32))
    f2 = d0.launch(saxpy, grid=(n,), block=(256,), args=(y, x, 2.0, n), after=[f1])
    await f2
    arr = await y.to_numpy(np.float32)
    print(arr.sum())
    with aiogpu.Graph() as g:
        d0.launch(saxpy, grid=(n,), block=(256,), args=(y, x, 2.0, n))
    exe: aiogpu.GraphExec = g.instantiate()
    await exe.launch()
    await aiogpu.gather(f1, f2)
    ready: aiogpu.GPUFuture = d0.load(saxpy)             # compile off the loop (warm-up)
    await ready
    await saxpy.compile(d0)
    rt: aiogpu.Runtime = aiogpu.runtime()
    if rt.backend == "cuda":
        import torch  # type: ignore[import-not-found]
        s = torch.cuda.Stream()
        done: aiogpu.GPUFuture = aiogpu.stream_future(s, runtime=rt)
        f3 = d0.launch(saxpy, grid=(n,), block=(256,), args=(y, x, 2.0, n), after=[done])
        f3.wait_on(s)
        await f3
    rt.close()

if __name__ == "__main__":
    asyncio.run(main())
