"""Leaving a Loader's ``async with`` gives its device buffers back (once the copies into them
and the work that used them have retired), however the block is left: at the end of the data,
by an exception, by cancellation. A service that keeps ``self.loader`` holds no memory for it.
A batch the consumer still holds, unreleased, stays usable; releasing it later gives its
buffers back too."""
from __future__ import annotations

import anyio
import numpy as np
import pytest

import aiogpu
from backends import wait_for_baseline
from gpu_kernels import Gate, scale
from loader_batches import batches, use_batch


def held(rt) -> int:
    """Live device allocations once the work in flight has retired."""
    stats = wait_for_baseline(rt, timeout=10)
    assert stats["pending"] == 0
    return stats["small_allocations"] + stats["large_allocations"]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_pool_goes_back_when_the_data_ends(rt, backend):
    async def main():
        async with aiogpu.Loader(batches(12), rt.devices, prefetch=2) as loader:
            async for batch in loader:
                assert await use_batch(batch) == 2.0 * batch.index
        return loader

    loader = anyio.run(main, backend=backend)
    assert loader.allocated > 0
    assert held(rt) == 0            # the old code: every pooled buffer, while `loader` lives


def test_the_pool_and_unconsumed_batches_go_back_on_an_exception(rt):
    async def main():
        loader = aiogpu.Loader(batches(40), rt.devices, prefetch=3)
        with pytest.raises(KeyError):
            async with loader:
                async for batch in loader:
                    await use_batch(batch)
                    if batch.index == 4:
                        for _ in range(10_000):     # let the producer prefetch batches
                            if loader.batches >= 7:
                                break
                            await anyio.sleep(0)
                        raise KeyError("the consumer failed")
        return loader

    loader = anyio.run(main)
    assert loader.batches >= 7                      # batches were prefetched, never consumed
    assert held(rt) == 0


def test_the_pool_goes_back_when_cancelled(rt):
    async def main():
        loader = aiogpu.Loader(batches(40), rt.devices, prefetch=2)
        with anyio.CancelScope() as scope:
            async with loader:
                async for batch in loader:
                    await use_batch(batch)
                    if batch.index == 3:
                        scope.cancel()
                        await anyio.sleep(1)         # cancelled here
        assert scope.cancelled_caught
        return loader

    loader = anyio.run(main)
    assert held(rt) == 0


def test_a_batch_held_past_the_exit_stays_usable_and_goes_back_when_released(rt):
    async def main():
        async with aiogpu.Loader(batches(6), rt.devices[:1], prefetch=2) as loader:
            kept = None
            async for batch in loader:
                if batch.index == 2:
                    kept = batch                    # not released
                else:
                    await use_batch(batch)
        values = await kept.data.to_numpy(np.float32)   # still the device's, unfreed
        return loader, kept, values

    loader, kept, values = anyio.run(main)
    assert (values == 2.0).all()
    assert held(rt) == 1
    kept.release()
    assert held(rt) == 0
    kept.release()                                  # idempotent
    assert held(rt) == 0


class _Abort(BaseException):
    """Not an Exception: what a Ctrl-C or SystemExit through the body is to the loader."""


def test_the_pool_goes_back_on_a_base_exception(rt):
    async def main():
        loader = aiogpu.Loader(batches(40), rt.devices, prefetch=2)
        with pytest.raises(_Abort):
            async with loader:
                async for batch in loader:
                    await use_batch(batch)
                    if batch.index == 3:
                        raise _Abort
        return loader

    loader = anyio.run(main)
    assert held(rt) == 0


def test_leaving_after_the_runtime_closed_raises_nothing(make_runtime):
    rt = make_runtime()

    async def main():
        async with aiogpu.Loader(batches(10), rt.devices, prefetch=2) as loader:
            async for batch in loader:
                await use_batch(batch)
                if batch.index == 2:
                    rt.close()
                    break
        return loader

    loader = anyio.run(main)
    assert rt.closed and loader.batches >= 3


def test_a_pooled_buffer_still_used_goes_back_only_when_its_work_retired(rt):
    """The consumer's kernel on a released batch is still waiting when the block is left: the
    buffer is freed but its memory is not handed out again until that kernel has retired."""
    dev = rt.devices[0]
    gate = Gate()

    async def main():
        async with aiogpu.Loader(batches(3), [dev], prefetch=1) as loader:
            async for batch in loader:
                if batch.index == 2:
                    held = gate.launch(dev)
                    late = dev.launch(scale, grid=(256,), block=(256,), args=(batch.data, 2.0, 256),
                                      after=[batch.ready, held])
                    address = batch.data.address
                batch.release()
        return loader, late, address

    loader, late, address = anyio.run(main)
    assert not late.done()
    others = [dev.alloc(1024) for _ in range(4)]    # the busy piece's size class
    assert address not in {o.address for o in others}
    stats = rt.stats()
    assert stats["small_allocations"] == 5          # 4 new, and the busy one
    gate.open()
    assert late.wait(10) and late.exception() is None
    for o in others:
        o.free()
    assert held(rt) == 0
