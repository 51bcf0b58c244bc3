"""Copies on the two ROCr copy interfaces the emulator models.

ROCr 5.2.3 (the emulator's default ``rocr_version``) has only ``hsa_amd_memory_async_copy``:
ROCr copies on the copy agent's blit (``Runtime::CopyMemory``: the source GPU, the destination
for host-to-device), an SDMA queue, or its blit kernels where it cannot create one. ROCm 5.7 and
later add ``hsa_amd_memory_async_copy_on_engine``, where aiogpu chooses the engine. Both paths
must copy right, on the device the direction rule names, and say which path ran.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiogpu
from gpu_kernels import Gate

ENGINE_CALLS = {"hsa_amd_memory_async_copy_on_engine", "hsa_amd_memory_copy_engine_status"}


async def three_directions(rt, n=1 << 16):
    """Host-to-device onto gpu0, peer gpu0 -> gpu1, device-to-host from gpu1: the futures
    and the array read back."""
    d0, d1 = rt.devices
    data = np.random.default_rng(5).integers(0, 255, n, dtype=np.uint8)
    a, b = d0.alloc(n), d1.alloc(n)
    out = np.zeros(n, np.uint8)
    h2d = aiogpu.copy(a, data)
    peer = aiogpu.copy(b, a, after=[h2d])
    d2h = aiogpu.copy(out, b, after=[peer])
    await asyncio.wait_for(aiogpu.gather(h2d, peer, d2h), 30)
    np.testing.assert_array_equal(out, data)
    return h2d, peer, d2h


@pytest.mark.asyncio
async def test_on_rocr_5_2_3_copies_run_on_the_blits_rocr_picks_for_the_copy_agent(make_runtime):
    rt = make_runtime()
    assert ENGINE_CALLS <= set(rt.api.missing)
    emu = rt.api.emulator
    h2d, peer, d2h = await three_directions(rt)
    # Host-to-device on the destination's host-to-device blit, peer and device-to-host on the
    # SOURCE device's device-to-host blit (ROCr: GpuAgent::GetPcieBlit), each an SDMA queue.
    assert (h2d.queue, peer.queue, d2h.queue) == ("gpu0.rocr-h2d", "gpu0.rocr-d2h", "gpu1.rocr-d2h")
    assert emu.blit_stats(0) == {"h2d": {"sdma": True, "copies": 1}, "d2h": {"sdma": True, "copies": 1}}
    assert emu.blit_stats(1) == {"d2h": {"sdma": True, "copies": 1}}
    assert rt.stats()["copies"] == {"gpu0.rocr-h2d": 1, "gpu0.rocr-d2h": 1, "gpu1.rocr-d2h": 1, "shader": 0}
    assert {r.kind for r in emu.timeline} - {"barrier"} == {"copy"}   # no dispatch: no shader copy
    assert "copies: hsa_amd_memory_async_copy (" in rt.describe()
    assert "emulated ROCr release: 5.2.3" in rt.describe()


@pytest.mark.asyncio
async def test_on_rocr_5_2_3_peer_copies_in_an_xgmi_hive_use_the_sources_xgmi_blit(make_runtime):
    """ROCr (GpuAgent::GetBlitObject -> GetXgmiBlit): GPUs of one hive copy to each other on the
    source's xGMI blits, one per peer in turn; host copies stay on the PCIe blits."""
    rt = make_runtime(xgmi_engines=2)
    emu = rt.api.emulator
    h2d, peer, d2h = await three_directions(rt)
    assert (h2d.queue, peer.queue, d2h.queue) == ("gpu0.rocr-h2d", "gpu0.rocr-d2h", "gpu1.rocr-d2h")
    assert emu.blit_stats(0) == {"h2d": {"sdma": True, "copies": 1}, "xgmi0": {"sdma": True, "copies": 1}}
    assert emu.blit_stats(1) == {"d2h": {"sdma": True, "copies": 1}}


@pytest.mark.asyncio
async def test_on_rocr_5_2_3_without_sdma_rocr_copies_with_its_blit_kernels(make_runtime):
    """ROCr (GpuAgent::InitDma's blit_lambda): an SDMA queue it cannot create is a blit kernel
    and the copy call still succeeds; aiogpu runs no shader copy of its own."""
    rt = make_runtime(sdma_engines=0)
    emu = rt.api.emulator
    h2d, peer, d2h = await three_directions(rt)
    assert (h2d.queue, peer.queue, d2h.queue) == ("gpu0.rocr-h2d", "gpu0.rocr-d2h", "gpu1.rocr-d2h")
    assert emu.blit_stats(0) == {"h2d": {"sdma": False, "copies": 1}, "d2h": {"sdma": False, "copies": 1}}
    assert emu.blit_stats(1) == {"d2h": {"sdma": False, "copies": 1}}
    assert {r.kind for r in emu.timeline} - {"barrier"} == {"blit"}
    assert rt.stats()["copies"]["shader"] == 0


@pytest.mark.asyncio
async def test_on_rocr_5_2_3_exhausted_sdma_queues_become_blit_kernels(make_runtime):
    rt = make_runtime()
    emu = rt.api.emulator
    emu.faults.exhaust_sdma(0)                  # KFD grants gpu0 no SDMA queue
    h2d, peer, d2h = await three_directions(rt)
    assert (h2d.queue, peer.queue, d2h.queue) == ("gpu0.rocr-h2d", "gpu0.rocr-d2h", "gpu1.rocr-d2h")
    assert emu.blit_stats(0) == {"h2d": {"sdma": False, "copies": 1}, "d2h": {"sdma": False, "copies": 1}}
    assert emu.blit_stats(1) == {"d2h": {"sdma": True, "copies": 1}}
    emu.faults.restore_sdma()


@pytest.mark.asyncio
async def test_on_rocr_5_2_3_a_busy_blit_takes_the_copy_behind_its_work(make_runtime):
    """Nothing is "busy" through hsa_amd_memory_async_copy: copies held back by a gate queue
    on ROCr's blit in order, none becomes a shader copy."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    n = 4096
    gate = Gate()
    held = gate.launch(d0)
    bufs = [d0.alloc(n) for _ in range(3)]
    ups = [aiogpu.copy(b, np.full(n, i + 1, np.uint8), after=[held]) for i, b in enumerate(bufs)]
    assert all(u.queue == "gpu0.rocr-h2d" for u in ups)
    downs = [b.to_numpy() for b in bufs]
    assert all(d.queue == "gpu0.rocr-d2h" for d in downs)
    gate.open()
    for i, down in enumerate(downs):
        arr = await asyncio.wait_for(down, 30)
        np.testing.assert_array_equal(arr, np.full(n, i + 1, np.uint8))
    assert rt.stats()["copies"] == {"gpu0.rocr-h2d": 3, "gpu0.rocr-d2h": 3, "shader": 0}


@pytest.mark.asyncio
async def test_on_rocr_5_2_3_graph_copies_replay_on_rocr_blits(make_runtime):
    rt = make_runtime()
    d0, d1 = rt.devices
    n = 4096
    host, out = np.arange(n, dtype=np.uint8), np.zeros(n, np.uint8)
    a, b = d0.alloc(n), d1.alloc(n)
    c = d1.alloc(n)
    with aiogpu.Graph() as g:
        up = aiogpu.copy(a, host)
        over = aiogpu.copy(b, a, after=[up])
        within = aiogpu.copy(c, b, after=[over])          # within one device: a shader copy
        aiogpu.copy(out, c, after=[within])
    exe = g.instantiate()
    for _ in range(3):
        await asyncio.wait_for(exe.launch(), 30)
        np.testing.assert_array_equal(out, host)
        out[:] = 0
    assert rt.stats()["copies"] == {"gpu0.rocr-h2d": 3, "gpu0.rocr-d2h": 3, "gpu1.rocr-d2h": 3, "shader": 3}


@pytest.mark.asyncio
async def test_on_rocm_5_7_aiogpu_chooses_the_engines(make_runtime):
    rt = make_runtime(rocr_version="5.7")
    assert not ENGINE_CALLS & set(rt.api.missing)
    h2d, peer, d2h = await three_directions(rt)
    # gfx90a: engine 0 serves host-to-device only, engine 1 the rest.
    assert (h2d.queue, peer.queue, d2h.queue) == ("gpu0.sdma0", "gpu0.sdma1", "gpu1.sdma1")
    assert rt.stats()["copies"] == {"gpu0.sdma0": 1, "gpu0.sdma1": 1, "gpu1.sdma1": 1, "shader": 0}
    assert "copies: hsa_amd_memory_async_copy_on_engine; SDMA engines free" in rt.describe()
    assert "emulated ROCr release: 5.7" in rt.describe()


@pytest.mark.asyncio
@pytest.mark.parametrize("version", ["5.2.3", "5.7"])
async def test_copies_within_one_device_are_shader_copies_on_both(make_runtime, version):
    rt = make_runtime(gpus=1, rocr_version=version)
    d0 = rt.devices[0]
    a, b = d0.alloc(1024), d0.alloc(1024)
    await aiogpu.copy(a, np.arange(1024, dtype=np.uint8))
    f = aiogpu.copy(b, a)
    await asyncio.wait_for(f, 30)
    assert f.queue.startswith("gpu0.q") and rt.stats()["copies"]["shader"] == 1
    np.testing.assert_array_equal(await b.to_numpy(), np.arange(1024, dtype=np.uint8))


@pytest.mark.asyncio
async def test_on_rocr_5_2_3_rocr_out_of_resources_means_a_shader_copy(make_runtime, monkeypatch):
    """hsa_amd_memory_async_copy's OUT_OF_RESOURCES: ROCr could create no blit at all
    (GpuAgent::InitDma throws "Blit creation failed."); aiogpu's copy kernel does it."""
    from aiogpu.hsa_bindings import types as T
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    monkeypatch.setattr(rt.api, "hsa_amd_memory_async_copy", lambda *a: T.HSA_STATUS_ERROR_OUT_OF_RESOURCES)
    buf = d0.alloc(4096)
    f = aiogpu.copy(buf, np.full(4096, 7, np.uint8))
    await asyncio.wait_for(f, 30)
    assert f.queue.startswith("gpu0.q")
    monkeypatch.undo()
    np.testing.assert_array_equal(await buf.to_numpy(), np.full(4096, 7, np.uint8))
    assert rt.stats()["copies"] == {"gpu0.rocr-d2h": 1, "shader": 1}


def test_rocr_version_is_checked_and_emulator_only():
    with pytest.raises(ValueError, match="rocr_version"):
        aiogpu.Runtime("emulator", gpus=1, rocr_version="6.0")
    with pytest.raises(TypeError, match="rocr_version"):
        aiogpu.Runtime("hsa", rocr_version="5.7")


@pytest.mark.asyncio
@pytest.mark.parametrize("version", ["5.7", "5.2.3"])
async def test_graph_copy_replays_between_ordinary_copies_never_raise(make_runtime, version):
    """Issue 23.6: one SDMA engine per GPU, graphs each holding one copy (device-to-host, peer,
    host-to-device) replayed between ordinary copies to and from the host. On 5.7 the
    single-engine gfx90a reports its device-to-host queue as engine 0, which the copy call then
    refuses (INVALID_ARGUMENT); a refused engine means a shader copy, on every replay."""
    rt = make_runtime(gpus=2, sdma_engines=1, eager=True, compute_units=1, rocr_version=version)
    d0, d1 = rt.devices
    n = 4096
    a, b = d0.alloc(n), d1.alloc(n)
    host_in, host_out = np.arange(n, dtype=np.uint8), np.zeros(n, np.uint8)
    await aiogpu.copy(a, host_in)
    graphs = []
    for dst, src in ((host_out, a), (b, a), (a, host_in)):
        with aiogpu.Graph() as g:
            aiogpu.copy(dst, src)
        graphs.append(g.instantiate())
    for i in range(4):
        for exe in graphs:
            up = aiogpu.copy(b, np.full(n, i, np.uint8))
            await asyncio.wait_for(exe.launch(), 30)
            down = b.to_numpy()
            await asyncio.wait_for(aiogpu.gather(up, down), 30)
        np.testing.assert_array_equal(host_out, host_in)
    np.testing.assert_array_equal(await b.to_numpy(), np.full(n, 3, np.uint8))


@pytest.mark.asyncio
@pytest.mark.parametrize("version", ["5.7", "5.2.3"])
async def test_graph_replay_whose_copy_call_fails_copies_with_a_shader(make_runtime, monkeypatch, version):
    """Any engine failure at replay time: by then the replay's futures exist and its other parts
    run, so raising would leave them hanging; the copy runs as a shader copy instead."""
    from aiogpu.hsa_bindings import types as T
    rt = make_runtime(rocr_version=version)
    d0, d1 = rt.devices
    n = 4096
    a, b = d0.alloc(n), d1.alloc(n)
    await aiogpu.copy(a, np.arange(n, dtype=np.uint8))
    with aiogpu.Graph() as g:
        aiogpu.copy(b, a)
    exe = g.instantiate()
    call = "hsa_amd_memory_async_copy_on_engine" if version == "5.7" else "hsa_amd_memory_async_copy"
    monkeypatch.setattr(rt.api, call, lambda *args: T.HSA_STATUS_ERROR_INVALID_SIGNAL)
    await asyncio.wait_for(exe.launch(), 30)
    monkeypatch.undo()
    np.testing.assert_array_equal(await b.to_numpy(), np.arange(n, dtype=np.uint8))
    assert rt.stats()["copies"]["shader"] == 1
