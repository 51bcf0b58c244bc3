"""aiogpu.Loader: prefetch, back-pressure, ordering modes, buffer recycling, cancellation."""
from __future__ import annotations

import anyio
import numpy as np
import pytest

import aiogpu
from backends import wait_for_baseline
from loader_batches import batches, use_batch


async def consume(rt, loader, results):
    async for batch in loader:
        name = batch.device.name
        value = await use_batch(batch)
        results.append((batch.index, name, value))


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ordered_loader_feeds_two_gpus(rt, backend):
    results = []

    async def main():
        async with aiogpu.Loader(batches(20), rt.devices, prefetch=2) as loader:
            await consume(rt, loader, results)
        assert loader.allocated <= 2 * len(rt.devices) + 2, "buffers were not recycled"

    anyio.run(main, backend=backend)
    assert [r[0] for r in results] == list(range(20))
    assert {r[1] for r in results} == {"gpu0", "gpu1"}
    assert all(r[2] == 2.0 * r[0] for r in results)


def test_unordered_loader_yields_every_batch_once(rt):
    results = []

    async def main():
        async with aiogpu.Loader(batches(12), rt.devices, prefetch=3, ordered=False) as loader:
            await consume(rt, loader, results)

    anyio.run(main)
    assert sorted(r[0] for r in results) == list(range(12))
    assert all(r[2] == 2.0 * r[0] for r in results)


def test_back_pressure_bounds_how_far_the_source_is_read(rt):
    read = []

    def source():
        for i in range(100):
            read.append(i)
            yield np.zeros(64, np.float32)

    async def main():
        async with aiogpu.Loader(source(), rt.devices, prefetch=2) as loader:
            first = await loader.__anext__()
            await anyio.sleep(0.2)          # the producer runs ahead as far as it may
            ahead = len(read)
            first.release()
        return ahead

    ahead = anyio.run(main)
    assert ahead <= 2 * len(rt.devices) + 1, f"read {ahead} batches ahead with prefetch 2"


def test_structured_batches_and_async_sources(rt):
    async def source():
        for i in range(4):
            yield {"x": np.full(8, i, np.int32), "y": (np.full(4, -i, np.int64),)}

    async def main():
        seen = []
        async with aiogpu.Loader(source(), rt.devices[:1]) as loader:
            async for batch in loader:
                async with batch:
                    await batch.ready
                    x = await batch.data["x"].to_numpy(np.int32)
                    y = await batch.data["y"][0].to_numpy(np.int64)
                    seen.append((int(x[0]), int(y[0])))
        return seen

    assert anyio.run(main) == [(i, -i) for i in range(4)]


def test_leaving_early_waits_for_started_copies(rt):
    async def main():
        async with aiogpu.Loader(batches(50, size=1 << 16), rt.devices, prefetch=4) as loader:
            async for batch in loader:
                break
        return loader

    loader = anyio.run(main)
    assert all(f.done() for f in loader._inflight)
    assert wait_for_baseline(rt, timeout=10)["pending"] == 0    # (unawaited work retires at a scan)


def test_bad_batches_raise_clear_errors(rt):
    async def main():
        async with aiogpu.Loader([[1, 2, 3]], rt.devices) as loader:
            async for _ in loader:
                pass

    with pytest.raises(TypeError, match="expected NumPy arrays"):
        anyio.run(main)
    with pytest.raises(ValueError, match="prefetch"):
        aiogpu.Loader([], rt.devices, prefetch=0)


@pytest.mark.asyncio
async def test_fresh_large_batches_are_staged_off_the_loop(any_rt):
    """A new (unpinned) array each step: large ones are copied into pinned memory by worker
    threads and uploaded from there; the data arrive intact and nothing stays locked."""
    devs = any_rt.devices
    n = (3 << 20) // 4 + 5                       # 3 MiB + a tail: several chunks, uneven
    expect = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(4)]

    def fresh():
        for e in expect:
            yield {"x": e.copy(), "small": np.arange(8, dtype=np.int32)}   # new arrays each step

    got = []
    async with aiogpu.Loader(fresh(), devs[:1], prefetch=2, stage_threads=3) as loader:
        async for b in loader:
            await b.ready
            got.append(await b.data["x"].to_numpy(np.float32))
            assert (await b.data["small"].to_numpy(np.int32) == np.arange(8)).all()
            b.release()
        staged = loader.staged_bytes
    assert staged == sum(e.nbytes for e in expect)          # the small arrays were not staged
    for g, e in zip(got, expect):
        np.testing.assert_array_equal(g, e)
    assert any_rt.stats()["host_locks"] == 0


def test_stage_threads_is_checked(any_rt):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stage_threads"):
            aiogpu.Loader([], any_rt.devices, stage_threads=bad)


@pytest.mark.asyncio
async def test_arrays_a_source_hands_out_again_are_staged_once(any_rt):
    """A source cycling through a few arrays: each is staged the first time only."""
    devs = any_rt.devices
    arrays = [np.full((1 << 20) // 4 + 3, i, np.float32) for i in range(2)]
    async with aiogpu.Loader([arrays[i % 2] for i in range(6)], devs[:1], prefetch=1) as loader:
        async for b in loader:
            assert (await b.data.to_numpy(np.float32) == arrays[b.index % 2][0]).all()
            b.release()
        staged = loader.staged_bytes
    assert staged == sum(a.nbytes for a in arrays)


@pytest.mark.asyncio
async def test_a_fresh_array_is_uploaded_piece_by_piece_as_it_is_staged(any_rt, monkeypatch):
    """Each staged piece has its own upload, submitted when the piece is staged (staging the
    rest overlaps it); the batch's ``ready`` joins them all and the data arrive whole, also
    into buffers recycled from earlier batches."""
    from aiogpu import dataloader
    monkeypatch.setattr(dataloader, "STAGE_CHUNK", 1 << 20)
    started = dataloader.Loader._started
    sizes: list[int] = []

    def spy(self, fut):
        sizes.append(fut.nbytes)
        return started(self, fut)

    monkeypatch.setattr(dataloader.Loader, "_started", spy)
    devs = any_rt.devices
    n = (3 << 20) // 4 + 7                                  # 4 pieces, the last one short
    expect = [np.random.default_rng(10 + i).standard_normal(n).astype(np.float32) for i in range(5)]
    got = []
    async with aiogpu.Loader((e.copy() for e in expect), devs[:1], prefetch=1, stage_threads=2) as loader:
        async for b in loader:
            await b.ready
            got.append(await b.data.to_numpy(np.float32))
            b.release()
        allocated = loader.allocated
    assert sorted(sizes) == sorted([1 << 20] * 15 + [n * 4 - (3 << 20)] * 5) and allocated == 1
    for g, e in zip(got, expect):
        np.testing.assert_array_equal(g, e)


@pytest.mark.asyncio
async def test_staging_threads_submit_the_uploads_one_hand_off_per_batch(any_rt, monkeypatch):
    """The worker that staged a piece submits its upload (the loop is not asked once per
    piece: that made each upload wait for the loop's turn); one thread hand-off per batch."""
    import threading
    from aiogpu import dataloader
    monkeypatch.setattr(dataloader, "STAGE_CHUNK", 1 << 20)
    rt_type = type(any_rt)
    copy, callers = rt_type.copy, []

    def spy_copy(self, dst, src, *a, **kw):
        callers.append((threading.current_thread() is threading.main_thread(), src.nbytes))
        return copy(self, dst, src, *a, **kw)

    hops = []
    run_sync = dataloader.anyio.to_thread.run_sync

    async def spy_hop(fn, *args, **kw):
        hops.append(fn)
        return await run_sync(fn, *args, **kw)

    monkeypatch.setattr(rt_type, "copy", spy_copy)
    monkeypatch.setattr(dataloader.anyio.to_thread, "run_sync", spy_hop)
    n = (4 << 20) // 4 + 3                                  # 5 pieces, the last one short
    expect = [np.random.default_rng(20 + i).standard_normal(n).astype(np.float32) for i in range(3)]
    async with aiogpu.Loader(((e.copy(), e.copy()) for e in expect), any_rt.devices[:1], prefetch=2,
                             stage_threads=3) as loader:
        async for b in loader:
            await b.ready
            for part in b.data:
                np.testing.assert_array_equal(await part.to_numpy(np.float32), expect[b.index])
            b.release()
    staged = [c for c in callers if c[1] <= 1 << 20]
    assert len(staged) == 3 * 2 * 5 and not any(main for main, _ in staged)
    assert len(hops) == 3                     # one per batch (two arrays, ten pieces each)


@pytest.mark.parametrize("fail_at", [None, 2])
def test_leaving_while_staging_waits_for_every_upload_submitted(rt, monkeypatch, fail_at):
    """The consumer leaves (or a piece's upload fails) while later batches are being staged:
    every upload a staging thread submitted is tracked and waited for; nothing stays pending."""
    from aiogpu import dataloader
    monkeypatch.setattr(dataloader, "STAGE_CHUNK", 1 << 20)
    started = dataloader.Loader._started
    tracked: list = []
    monkeypatch.setattr(dataloader.Loader, "_started", lambda self, f: (tracked.append(f), started(self, f))[1])
    rt_type, copy, count = type(rt), type(rt).copy, [0]

    def flaky(self, dst, src, *a, **kw):
        count[0] += 1
        if count[0] == fail_at:
            raise RuntimeError("injected upload failure")
        return copy(self, dst, src, *a, **kw)

    monkeypatch.setattr(rt_type, "copy", flaky)
    fresh = (np.full((3 << 20) // 4, i, np.float32) for i in range(8))

    async def main():
        seen = []
        async with aiogpu.Loader(fresh, rt.devices[:1], prefetch=3, stage_threads=2) as loader:
            try:
                async for b in loader:
                    seen.append(b.index)
                    break
            except RuntimeError as e:
                seen.append(str(e))
        return seen

    seen = anyio.run(main)
    assert seen == ([0] if fail_at is None else ["injected upload failure"])
    assert tracked and all(f.done() for f in tracked)
    assert wait_for_baseline(rt, timeout=10)["pending"] == 0    # (unawaited work retires at a scan)
