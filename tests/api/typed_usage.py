"""Typical use of the public API, type-checked by test_typing.py (mypy must accept it, and
the ``reveal_type`` lines must reveal what each comment says)."""
import asyncio
from typing import TYPE_CHECKING

import numpy as np
import aiogpu

if not TYPE_CHECKING:
    def reveal_type(obj: object) -> None:   # (run as a script: mypy's builtin does not exist)
        pass


@aiogpu.kernel("f32*, const f32*, f32, u32")
def saxpy(launch: object, y: np.ndarray, x: np.ndarray, a: float, n: int) -> None:
    y[:n] += a * x[:n]


async def main() -> None:
    devs: list[aiogpu.Device] = aiogpu.devices()
    d0 = devs[0]
    n = 1024
    x: aiogpu.Buffer = d0.alloc(n * 4)
    y = d0.alloc(n * 4)
    f1: aiogpu.GPUFuture[None] = aiogpu.copy(x, np.ones(n, np.float32))
    f2 = d0.launch(saxpy, grid=(n,), block=(256,), args=(y, x, 2.0, n), after=[f1])
    await f2
    arr = await y.to_numpy(np.float32)
    print(arr.sum())
    reveal_type(y.to_numpy(np.float32))          # expect: GPUFuture[ndarray]
    reveal_type(arr)                              # expect: ndarray
    reveal_type(await f2)                         # expect: None
    reveal_type(f2)                               # expect: GPUFuture[None]
    reveal_type(aiogpu.copy(y, x))                # expect: GPUFuture[None]
    reveal_type(y.fill(0))                        # expect: GPUFuture[None]
    reveal_type(aiogpu.gather(f1, f2))            # expect: GPUFuture[None]
    down = y.to_numpy()
    await down
    reveal_type(down.result())                    # expect: ndarray
    reveal_type(y.to_numpy().asyncio())           # expect: Future[ndarray]
    with aiogpu.Graph() as g:
        d0.launch(saxpy, grid=(n,), block=(256,), args=(y, x, 2.0, n))
    exe: aiogpu.GraphExec = g.instantiate()
    replay = exe.launch()
    reveal_type(replay)                           # expect: GPUFuture[None]
    await replay
    await aiogpu.gather(f1, f2)
    ready: aiogpu.GPUFuture = d0.load(saxpy)             # compile off the loop (warm-up)
    await ready
    await saxpy.compile(d0)
    # views and slices
    v: aiogpu.Buffer = y.view(np.float32, (n // 4, 4))
    rows = v[2:10]
    head = y[0:64]
    count: int = len(rows) + len(head)
    await aiogpu.copy(rows, np.zeros((8, 4), np.float32))
    await d0.launch(saxpy, grid=(32,), block=(32,), args=(v[0:8], x.view(np.float32)[0:32], 1.0, 32))
    part = await rows.to_numpy()
    print(part.shape, count, v.shape, v.dtype, v.base is y)
    await head.fill(0)
    # asyncio's future protocol
    done, pending = await asyncio.wait([f1, f2], return_when=asyncio.FIRST_COMPLETED)
    for nxt in asyncio.as_completed([f1, f2]):
        await nxt
    assert asyncio.isfuture(f1) and not f1.cancelled()
    await asyncio.wait_for(f2.asyncio(), 5.0)
    print(len(done) + len(pending))
    rt: aiogpu.Runtime = aiogpu.runtime()
    if rt.backend == "cuda":
        import torch  # type: ignore[import-not-found]
        s = torch.cuda.Stream()
        torch_done: aiogpu.GPUFuture = aiogpu.stream_future(s, runtime=rt)
        f3 = d0.launch(saxpy, grid=(n,), block=(256,), args=(y, x, 2.0, n), after=[torch_done])
        f3.wait_on(s)
        await f3
    rt.close()

if __name__ == "__main__":
    asyncio.run(main())
