"""Copies: engine choice (source-device SDMA, shader fallback), directions, host arrays."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from gpu_kernels import scale


async def copy_workload(rt, rounds=6, n=4096):
    """H2D, kernel, peer D2D both ways, D2H: returns the final arrays."""
    d0, d1 = rt.devices
    outs = []
    for r in range(rounds):
        data = np.arange(n, dtype=np.float32) + r
        a, b = d0.alloc(n * 4), d1.alloc(n * 4)
        aiogpu.copy(a, data)
        d0.launch(scale, grid=(n,), block=(256,), args=(a, 2.0, n))
        aiogpu.copy(b, a)
        d1.launch(scale, grid=(n,), block=(256,), args=(b, 3.0, n))
        aiogpu.copy(a, b)
        outs.append(a.to_numpy(np.float32))
    return [await f for f in outs]


def expected(rounds=6, n=4096):
    return [(np.arange(n, dtype=np.float32) + r) * 6.0 for r in range(rounds)]


@pytest.mark.asyncio
@pytest.mark.parametrize("engines", [0, 1, 2])
async def test_same_results_with_0_1_2_engines(make_runtime, engines):
    rt = make_runtime(sdma_engines=engines)
    got = await copy_workload(rt)
    for g, e in zip(got, expected()):
        np.testing.assert_array_equal(g, e)
    copies = [r for r in rt.api.emulator.timeline if r.kind == "copy"]
    if engines == 0:
        assert copies == [], "no SDMA engine exists, yet a copy ran on one"
    else:
        assert copies, "SDMA engines exist but every copy ran as a shader copy"


@pytest.mark.asyncio
async def test_engines_exhausted_mid_run_fall_back_to_shader_copies(make_runtime):
    rt = make_runtime(sdma_engines=2)
    first = await copy_workload(rt, rounds=3)
    rt.api.emulator.faults.exhaust_sdma()
    n_copies = len([r for r in rt.api.emulator.timeline if r.kind == "copy"])
    second = await copy_workload(rt, rounds=3)
    assert len([r for r in rt.api.emulator.timeline if r.kind == "copy"]) == n_copies
    shader = [r for r in rt.api.emulator.timeline if r.kind == "dispatch" and r.name == "aiogpu_copy"]
    assert shader, "exhausted engines did not fall back to the shader copy"
    for g, e in zip(first + second, expected(3) + expected(3)):
        np.testing.assert_array_equal(g, e)
    rt.api.emulator.faults.restore_sdma()


@pytest.mark.asyncio
async def test_copy_engines_follow_the_direction_rules(rt):
    d0, d1 = rt.devices
    n = 1024
    a, b = d0.alloc(n), d1.alloc(n)
    h2d = aiogpu.copy(a, np.ones(n, np.uint8))
    peer = aiogpu.copy(b, a)
    d2h = aiogpu.copy(np.empty(n, np.uint8), b)
    await aiogpu.gather(h2d, peer, d2h)
    assert h2d.queue.startswith("gpu0.sdma")   # host-to-device: the destination's engine
    assert peer.queue.startswith("gpu0.sdma")  # peer: the SOURCE device's engine
    assert d2h.queue.startswith("gpu1.sdma")   # device-to-host: the source's engine


@pytest.mark.asyncio
async def test_host_arrays_are_locked_while_in_use_and_unlocked_after(rt):
    d0 = rt.devices[0]
    buf = d0.alloc(1 << 20)
    data = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8)
    f = aiogpu.copy(buf, data)
    assert rt.host.count == 1
    await f
    out = await buf.to_numpy()
    assert rt.stats()["host_locks"] == 0
    np.testing.assert_array_equal(out, data)


@pytest.mark.asyncio
async def test_large_and_small_allocations(rt):
    d0 = rt.devices[0]
    big = d0.alloc(5 << 20)
    assert big.address % (2 << 20) == 0
    assert d0.memory.large[big.address] == 6 << 20
    smalls = [d0.alloc(100) for _ in range(50)]
    blocks = {s.address >> 21 for s in smalls}
    assert len(blocks) == 1, "small buffers did not share one 2 MiB block"
    data = np.arange(5 << 18, dtype=np.float32)
    await aiogpu.copy(big, data)
    np.testing.assert_array_equal(await big.to_numpy(np.float32), data)
