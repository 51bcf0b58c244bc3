"""Copies: engine choice (source-device SDMA, shader fallback), directions, host arrays."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from gpu_kernels import Gate, scale


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
async def test_exhausted_sdma_queues_turn_into_shader_copies(make_runtime):
    """Issue 14.2: when ROCr cannot create an SDMA queue it runs that engine's copies as its own
    blit kernel and reports success; only engine status tells (the engine is never free again).
    The runtime then runs its shader copy instead of queueing behind such an engine (ROCm 5.7's
    engine calls: on 5.2.3 ROCr's blit kernels do the copies, see test_copy_engines_rocr523)."""
    rt = make_runtime(sdma_engines=2, rocr_version="5.7")
    emu = rt.api.emulator
    emu.faults.exhaust_sdma()
    got = await copy_workload(rt, rounds=4)
    for g, e in zip(got, expected(4)):
        np.testing.assert_array_equal(g, e)
    assert not [r for r in emu.timeline if r.kind == "copy"], "an SDMA queue ran although none could be created"
    for gpu in (0, 1):   # each engine's first copy revealed it; then shader copies
        assert len([r for r in emu.timeline if r.kind == "blit" and r.agent == gpu]) <= 2
    shader = [r for r in emu.timeline if r.kind == "dispatch" and r.name == "aiogpu_copy"]
    assert len(shader) >= 4 * 4 - 2 * 2, "the runtime kept queueing behind blit-kernel engines"
    emu.faults.restore_sdma()


@pytest.mark.asyncio
async def test_a_busy_engine_of_another_direction_is_never_used(make_runtime):
    """Issue 14.1: on gfx90a SDMA engine 0 serves host-to-device copies only. With both engines
    busy, a device-to-host copy must not fall back to an engine seen for another direction
    (ROCr: INVALID_ARGUMENT); it queues behind a proven engine of its own direction or runs as a
    shader copy (ROCm 5.7's engine calls)."""
    rt = make_runtime(gpus=1, rocr_version="5.7")
    d0 = rt.devices[0]
    n = 4096
    gate = Gate()
    held = gate.launch(d0)
    bufs = [d0.alloc(n) for _ in range(4)]
    ups = [aiogpu.copy(b, np.full(n, i, np.uint8), after=[held]) for i, b in enumerate(bufs[:2])]
    assert {u.queue for u in ups} == {"gpu0.sdma0", "gpu0.sdma1"}   # both engines now busy
    downs = [bufs[2].to_numpy(), bufs[3].to_numpy()]
    gate.open()
    for i, u in enumerate(ups):
        await u
        np.testing.assert_array_equal(await bufs[i].to_numpy(), np.full(n, i, np.uint8))
    await aiogpu.gather(*downs)
    assert all(not d.queue.startswith("gpu0.sdma0") for d in downs)


@pytest.mark.asyncio
async def test_copies_within_one_device_run_as_shader_copies(rt):
    """ROCr reports INVALID_AGENT for engine status within one agent (its own choice there is a
    blit kernel): the runtime's shader copy does it."""
    d0 = rt.devices[0]
    a, b = d0.alloc(1024), d0.alloc(1024)
    await aiogpu.copy(a, np.arange(1024, dtype=np.uint8))
    f = aiogpu.copy(b, a)
    await f
    assert f.queue.startswith("gpu0.q")
    np.testing.assert_array_equal(await b.to_numpy(), np.arange(1024, dtype=np.uint8))


@pytest.mark.asyncio
@pytest.mark.parametrize("version", ["5.2.3", "5.7"])
async def test_copy_engines_follow_the_direction_rules(make_runtime, version):
    rt = make_runtime(rocr_version=version)
    d0, d1 = rt.devices
    n = 1024
    a, b = d0.alloc(n), d1.alloc(n)
    h2d = aiogpu.copy(a, np.ones(n, np.uint8))
    peer = aiogpu.copy(b, a)
    d2h = aiogpu.copy(np.empty(n, np.uint8), b)
    await aiogpu.gather(h2d, peer, d2h)
    assert d0.engines.runs(h2d.queue)   # host-to-device: the destination's engine
    assert d0.engines.runs(peer.queue)  # peer: the SOURCE device's engine
    assert d1.engines.runs(d2h.queue)   # device-to-host: the source's engine


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


@pytest.mark.asyncio
async def test_overlapping_host_arrays_in_flight_lock_and_unlock_cleanly(rt):
    """Issue 13.10: uploads from h[:16] and h in flight together. ROCr's unlock takes only the
    start address and unlocks nothing when two registrations start there, so the runtime must
    never make two: views share their root buffer's registration (at its agent address)."""
    d0 = rt.devices[0]
    mib = 1 << 20                      # views larger than what uploads stage: they are locked
    h = np.arange(4 * mib, dtype=np.uint8)
    small, big, mid = d0.alloc(mib), d0.alloc(h.nbytes), d0.alloc(mib)
    gate = Gate()
    held = gate.launch(d0)
    ups = [aiogpu.copy(small, h[:mib], after=[held]), aiogpu.copy(big, h, after=[held]),
           aiogpu.copy(mid, h[mib + 100:2 * mib + 100], after=[held])]
    assert rt.host.count == 1, "overlapping views made separate registrations"
    gate.open()
    await aiogpu.gather(*ups)
    np.testing.assert_array_equal(await small.to_numpy(), h[:mib])
    np.testing.assert_array_equal(await big.to_numpy(), h)
    np.testing.assert_array_equal(await mid.to_numpy(), h[mib + 100:2 * mib + 100])
    assert rt.api.emulator.memory_faults == []
    user_locks = [r for r in rt.api.emulator.locked_ranges()            # (the pinned pool's
                  if rt.pinned.device_pointer(r[0]) is None]                 # slabs stay locked)
    assert rt.stats()["host_locks"] == 0 and user_locks == []
