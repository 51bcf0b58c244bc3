"""Graphs: capture, instantiate, replay with patches, ordering, re-launch safety, failures."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from aiogpu.hsa_bindings import types as T
from aiogpu.cli.stress import add_const
from gpu_kernels import saxpy, scale


@pytest.mark.asyncio
async def test_capture_does_not_run_and_replay_does(rt, host):
    d0, d1 = rt.devices
    n = 256
    xs, ys = host(n), host(n)
    x, y, z = d0.alloc(n * 4), d0.alloc(n * 4), d1.alloc(n * 4)
    await aiogpu.gather(aiogpu.copy(x, xs), aiogpu.copy(y, ys))
    with aiogpu.Graph() as g:
        a = d0.launch(saxpy, grid=(n,), block=(64,), args=(y, x, 2.0, n))
        b = aiogpu.copy(z, y, after=[a])
        d1.launch(scale, grid=(n,), block=(64,), args=(z, 0.5, n), after=[b])
    assert len(g.nodes) == 3 and rt.hub.pending_count == 0   # nothing ran
    np.testing.assert_array_equal(await y.to_numpy(np.float32), ys)
    exe = g.instantiate()
    await exe.launch()
    expect_y = ys + 2.0 * xs
    np.testing.assert_allclose(await y.to_numpy(np.float32), expect_y, rtol=1e-6)
    np.testing.assert_allclose(await z.to_numpy(np.float32), expect_y * 0.5, rtol=1e-6)
    await exe.launch()
    expect_y = expect_y + 2.0 * xs
    np.testing.assert_allclose(await z.to_numpy(np.float32), expect_y * 0.5, rtol=1e-6)


@pytest.mark.asyncio
async def test_patched_arguments_apply_to_one_replay_only(rt):
    d0 = rt.devices[0]
    x1, x2 = d0.alloc(8), d0.alloc(8)
    await aiogpu.gather(aiogpu.copy(x1, np.zeros(1, np.int64)), aiogpu.copy(x2, np.zeros(1, np.int64)))
    with aiogpu.Graph() as g:
        node = d0.launch(add_const, grid=(1,), block=(1,), args=(x1, 1))
    exe = g.instantiate()
    exe.launch()
    exe.launch(args={node: (x2, 10)})
    exe.launch(args={node: (x1, 100)})
    await exe.launch()
    assert (await x1.to_numpy(np.int64))[0] == 102
    assert (await x2.to_numpy(np.int64))[0] == 10


@pytest.mark.asyncio
async def test_bad_patches_are_rejected_before_submission(rt):
    d0, d1 = rt.devices
    x, other = d0.alloc(8), d1.alloc(8)
    with aiogpu.Graph() as g:
        node = d0.launch(add_const, grid=(1,), block=(1,), args=(x, 1))
    exe = g.instantiate()
    pending = rt.hub.pending_count
    with pytest.raises(ValueError, match="not on gpu0"):
        exe.launch(args={node: (other, 1)})
    with pytest.raises(TypeError, match="takes 2 arguments"):
        exe.launch(args={node: (x,)})
    with pytest.raises(ValueError, match="not a node of this graph"):
        exe.launch(args={object(): (x, 1)})
    with pytest.raises(ValueError, match="grid entries"):
        exe.launch(grid={node: (0,)})
    assert rt.hub.pending_count == pending


@pytest.mark.asyncio
async def test_a_thousand_replays_without_awaiting_are_exact(rt):
    d0, d1 = rt.devices
    a, b = d0.alloc(8), d1.alloc(8)
    await aiogpu.gather(aiogpu.copy(a, np.zeros(1, np.int64)), aiogpu.copy(b, np.zeros(1, np.int64)))
    with aiogpu.Graph() as g:
        n1 = d0.launch(add_const, grid=(1,), block=(1,), args=(a, 1))
        cp = aiogpu.copy(b, a, after=[n1])
        d1.launch(add_const, grid=(1,), block=(1,), args=(b, 1), after=[cp])
    exe = g.instantiate()
    futs = [exe.launch() for _ in range(1000)]
    await aiogpu.gather(*futs)
    assert (await a.to_numpy(np.int64))[0] == 1000
    assert (await b.to_numpy(np.int64))[0] == 1001   # b = a + 1 after the last replay


@pytest.mark.asyncio
async def test_failing_node_fails_that_replay_and_later_replays_work(rt):
    d0 = rt.devices[0]
    c = d0.alloc(8)
    await aiogpu.copy(c, np.zeros(1, np.int64))
    with aiogpu.Graph() as g:
        d0.launch(add_const, grid=(1,), block=(1,), args=(c, 1))
    exe = g.instantiate()
    await exe.launch()
    rt.api.emulator.faults.queue_error_at(1, status=T.HSA_STATUS_ERROR_EXCEPTION)
    with pytest.raises(aiogpu.GPUError):
        await exe.launch()
    # c's failed write left it undefined: a replay reading it fails, as a launch would,
    # until something only writes it again; then replays work.
    with pytest.raises(aiogpu.GPUError, match="dependency failed"):
        await exe.launch()
    await aiogpu.copy(c, np.ones(1, np.int64))
    await exe.launch()
    await exe.launch()
    assert (await c.to_numpy(np.int64))[0] == 3


@pytest.mark.asyncio
async def test_graph_with_host_copies_and_gather(rt):
    d0, d1 = rt.devices
    src = np.arange(64, dtype=np.int64)
    out = np.zeros(64, np.int64)
    a, b = d0.alloc(512), d1.alloc(512)
    with aiogpu.Graph() as g:
        up = aiogpu.copy(a, src)
        up2 = aiogpu.copy(b, src)
        k1 = d0.launch(add_const, grid=(64,), block=(64,), args=(a, 1), after=[up])
        k2 = d1.launch(add_const, grid=(64,), block=(64,), args=(b, 2), after=[up2])
        j = aiogpu.gather(k1, k2)
        aiogpu.copy(out, a, after=[j])
    exe = g.instantiate()
    await exe.launch()
    np.testing.assert_array_equal(out, src + 1)
    np.testing.assert_array_equal(await b.to_numpy(np.int64), src + 2)


@pytest.mark.asyncio
async def test_replay_after_a_buffer_was_freed_is_refused_every_time(rt):
    """Unpatched replays reuse the buffer lists computed at the first one: the freed-buffer
    check must still run on every replay, before anything is submitted."""
    d0 = rt.devices[0]
    x = d0.alloc(8)
    await aiogpu.copy(x, np.zeros(1, np.int64))
    with aiogpu.Graph() as g:
        d0.launch(add_const, grid=(1,), block=(1,), args=(x, 1))
    exe = g.instantiate()
    await exe.launch()
    await exe.launch()
    assert (await x.to_numpy(np.int64))[0] == 2
    x.free()
    pending = rt.hub.pending_count
    for _ in range(2):
        with pytest.raises(ValueError, match="freed"):
            exe.launch()
    assert rt.hub.pending_count == pending
