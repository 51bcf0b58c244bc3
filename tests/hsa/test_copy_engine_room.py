"""Room in ROCr's copy queues: ``hsa_amd_memory_async_copy`` spins, under the runtime lock, while
its queue is full, and its copies may wait for work back-logged on an aiogpu queue that only the
waiter (which needs that lock) publishes. While a back-log exists, a device therefore keeps its
unretired ROCr copies within ``ROCR_COPY_ROOM`` packets and runs the rest as shader copies, and
gives ROCr no copy that may land on its utility queue, where loading a kernel copies the code
under that lock (see CopyEngines)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import aiogpu
from aiogpu.hsa import queues as Q
from backends import ROOT, on_hsa_virtual


def _h2d(rt):
    d0 = rt.devices[0]
    return d0.engines, d0.agent, rt._cpu       # (engines, dst agent, src agent)


def test_copies_past_the_room_are_refused_and_retirement_gives_the_room_back(make_runtime, monkeypatch):
    """A copy counts 2 packets plus one per five dependencies; one that would pass the room is
    answered None (a shader copy) without calling ROCr, and each copy's cleanup gives its room
    back."""
    rt = make_runtime(gpus=1)
    engines, dst, src = _h2d(rt)
    monkeypatch.setattr(engines, "_crowded", lambda: True)      # some queue has a back-log
    calls = []
    monkeypatch.setattr(rt.api, "hsa_amd_memory_async_copy", lambda *args: calls.append(args) or 0)
    cleanups: list = []
    for _ in range(Q.ROCR_COPY_ROOM // 2 - 1):
        assert engines.submit(Q.ROCR_CHOICE, 0, dst, 0, src, 8, [], 0, cleanups) is not None
    assert engines.room_in_use == Q.ROCR_COPY_ROOM - 2
    deps = list(range(1, 7))                       # six dependencies: 2 barrier packets more
    assert engines.submit(Q.ROCR_CHOICE, 0, dst, 0, src, 8, deps, 0, cleanups) is None
    assert len(calls) == Q.ROCR_COPY_ROOM // 2 - 1, "ROCr was called for a copy without room"
    assert engines.submit(Q.ROCR_CHOICE, 0, dst, 0, src, 8, [], 0, cleanups) is not None
    assert engines.room_in_use == Q.ROCR_COPY_ROOM
    assert engines.submit(Q.ROCR_CHOICE, 0, dst, 0, src, 8, [], 0, cleanups) is None
    for done in cleanups[:3]:
        done()
    assert engines.room_in_use == Q.ROCR_COPY_ROOM - 6
    assert engines.submit(Q.ROCR_CHOICE, 0, dst, 0, src, 8, deps, 0, []) is not None


def test_without_a_back_log_anywhere_copies_are_not_held_to_the_room(make_runtime, monkeypatch):
    """Every dependency is published then, so the device frees ROCr's queue by itself: the copy
    goes to ROCr (and still counts, for when a back-log comes)."""
    rt = make_runtime(gpus=1)
    engines, dst, src = _h2d(rt)
    monkeypatch.setattr(rt.api, "hsa_amd_memory_async_copy", lambda *args: 0)
    cleanups: list = []
    assert rt._crowded() is False
    for _ in range(Q.ROCR_COPY_ROOM):
        assert engines.submit(Q.ROCR_CHOICE, 0, dst, 0, src, 8, [], 0, cleanups) is not None
    assert engines.room_in_use == 2 * Q.ROCR_COPY_ROOM
    monkeypatch.setattr(engines, "_crowded", lambda: True)      # a back-log comes
    assert engines.submit(Q.ROCR_CHOICE, 0, dst, 0, src, 8, [], 0, cleanups) is None


def test_a_copy_that_fails_in_rocr_takes_no_room(make_runtime, monkeypatch):
    rt = make_runtime(gpus=1)
    engines, dst, src = _h2d(rt)
    monkeypatch.setattr(engines, "_crowded", lambda: True)
    monkeypatch.setattr(rt.api, "hsa_amd_memory_async_copy",
                        lambda *args: aiogpu.hsa_bindings.types.HSA_STATUS_ERROR_OUT_OF_RESOURCES)
    cleanups: list = []
    assert engines.submit(Q.ROCR_CHOICE, 0, dst, 0, src, 8, [], 0, cleanups) is None
    assert engines.room_in_use == 0 and cleanups == []


def test_while_crowded_rocr_takes_device_to_host_and_peer_copies_only_on_proven_sdma(make_runtime, monkeypatch):
    """ROCr 5.2.3 picks the blit: device-to-host and peer copies are refused while some queue
    has a back-log (without SDMA their blit kernels run on the utility queue, where a kernel's
    code is copied), host-to-device ones still go (within the room). With the engine calls, an
    engine goes only once proven an SDMA queue."""
    rt = make_runtime(gpus=2)
    d0, d1 = rt.devices
    engines = d0.engines
    calls = []
    monkeypatch.setattr(rt.api, "hsa_amd_memory_async_copy", lambda *args: calls.append(args) or 0)
    monkeypatch.setattr(engines, "_crowded", lambda: True)
    h2d, d2h, peer = (d0.agent, rt._cpu), (rt._cpu, d0.agent), (d1.agent, d0.agent)   # (dst, src)
    assert engines.submit(Q.ROCR_CHOICE, 0, h2d[0], 0, h2d[1], 8, [], 0, []) is not None
    assert engines.submit(Q.ROCR_CHOICE, 0, d2h[0], 0, d2h[1], 8, [], 0, []) is None
    assert engines.submit(Q.ROCR_CHOICE, 0, peer[0], 0, peer[1], 8, [], 0, []) is None
    assert len(calls) == 1
    monkeypatch.setattr(engines, "_crowded", lambda: False)     # no back-log: every copy goes
    assert engines.submit(Q.ROCR_CHOICE, 0, d2h[0], 0, d2h[1], 8, [], 0, []) is not None
    assert engines.submit(Q.ROCR_CHOICE, 0, peer[0], 0, peer[1], 8, [], 0, []) is not None
    assert len(calls) == 3


def test_while_crowded_an_engine_takes_copies_only_once_proven(make_runtime, monkeypatch):
    rt = make_runtime(gpus=1, rocr_version="5.7")
    d0 = rt.devices[0]
    engines = d0.engines
    monkeypatch.setattr(rt.api, "hsa_amd_memory_async_copy_on_engine", lambda *args: 0)
    monkeypatch.setattr(engines, "_crowded", lambda: True)
    engine = aiogpu.hsa_bindings.types.HSA_AMD_SDMA_ENGINE_0 << 1      # engine 1
    for dst, src in ((d0.agent, rt._cpu), (rt._cpu, d0.agent)):
        assert engines.submit(engine, 0, dst, 0, src, 8, [], 0, []) is None
    engines.proven.add(engine)           # reported free after use: a real SDMA queue
    for dst, src in ((d0.agent, rt._cpu), (rt._cpu, d0.agent)):
        assert engines.submit(engine, 0, dst, 0, src, 8, [], 0, []) is not None


@pytest.mark.asyncio
async def test_many_copies_give_their_room_back_once_retired(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    buf = d0.alloc(8 * 16)
    await aiogpu.copy(buf, np.arange(16, dtype=np.int64))
    outs = [np.empty(16, np.int64) for _ in range(100)]
    await aiogpu.gather(*[aiogpu.copy(o, buf) for o in outs])
    assert all((o == np.arange(16)).all() for o in outs)
    rt.hub.settle_completed(list(rt.hub._pending.values()))
    assert rt.stats()["copy_room_in_use"] == 0


# The failures these guard against are hangs (ROCr spinning or waiting under the runtime lock), so
# the scenarios run in a child process with a deadline, on one 64-slot queue without SDMA queues
# (ROCr's copies are then its blit kernels).
_PRELUDE = """
import asyncio, os, sys, threading
sys.path.insert(0, "tests")
import numpy as np, aiogpu
from gpu_kernels import Gate, add_const_n, wait_gate

async def one_queue():
    rt = aiogpu.Runtime("hsa-virtual", gpus=1, ring_size=64, sdma_queues=0, queues_per_device=1)
    d0 = rt.devices[0]
    buf = d0.alloc(8 * 16)
    await aiogpu.copy(buf, np.zeros(16, np.int64))
    return rt, d0, buf, Gate()
"""


def _run_child(scenario: str, hang: str) -> str:
    """``scenario`` (after the prelude) in a child process; its output. Fails the test with
    ``hang`` if it runs past its deadline or with its output if it fails."""
    try:
        done = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(scenario)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{hang}: {exc.stdout}{exc.stderr}")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@on_hsa_virtual
def test_copies_after_back_logged_launches_never_spin_rocr_under_the_lock():
    """On the real ROCr without SDMA queues (its blit kernels on one small queue): copies, each
    after a launch that waits in the back-log, all complete; ROCr copied some, shaders the rest."""
    out = _run_child("""
        async def main():
            rt, d0, buf, gate = await one_queue()
            held = gate.launch(d0)
            threading.Timer(0.5, gate.open).start()
            outs, futs = [], []
            for i in range(200):     # 200 launches on a 64-slot ring: most wait in its back-log
                f = d0.launch(add_const_n, grid=(16,), block=(16,), args=(buf, 1, 16), after=[held] if i == 0 else [])
                outs.append(np.empty(16, np.int64))
                futs.append(aiogpu.copy(outs[-1], buf, after=[f]))     # ROCr's blit kernels copy
            await aiogpu.gather(*futs)
            assert [o[0] for o in outs] == list(range(1, 201)), [o[0] for o in outs]
            print("copies", rt.stats()["copies"])
            rt.close()
        asyncio.run(main())
    """, "the copies hung (ROCr spinning for room under the runtime lock)")
    assert "rocr-d2h" in out and "'shader'" in out, out


# ROCr's code copy (``hsa_executable_freeze`` -> RegionMemory::Freeze -> GpuAgent::DmaCopy, a blit
# kernel on the device's utility queue, then InvalidateCodeCaches on the same queue) runs behind
# whatever ROCr's device-to-host blit queued there when it has no SDMA queue. A copy there that
# waits for back-logged work would hold the load until the waiter publishes that work, and the
# waiter needs the runtime lock the load holds. The gate stays closed until the load is done, so
# a load that waits behind the copy times out instead of finishing.
@on_hsa_virtual
def test_a_kernel_load_never_waits_behind_a_rocr_copy_of_back_logged_work():
    """While a queue has a back-log, a device-to-host or peer copy that could land on ROCr's
    utility queue (ROCr 5.2.3 picks its blit; without SDMA a blit kernel there) is a shader copy,
    so that loading a kernel meanwhile, whose code ROCr copies through that queue under the
    runtime lock, finishes without the back-logged work."""
    out = _run_child("""
        @aiogpu.kernel("u64*")
        def fresh(launch, x):
            x[0] = 5

        async def main():
            rt, d0, buf, gate = await one_queue()
            await aiogpu.gather(d0.load(add_const_n), d0.load(wait_gate))
            held = gate.launch(d0)
            last = [d0.launch(add_const_n, grid=(16,), block=(16,), args=(buf, 1, 16), after=[held] if i == 0 else [])
                    for i in range(100)][-1]
            assert rt._crowded()
            out = np.empty(16, np.int64)
            copied = aiogpu.copy(out, buf, after=[last])          # waits for the back-logged launch
            try:
                await asyncio.wait_for(asyncio.shield(d0.load(fresh)), 20)
            except asyncio.TimeoutError:
                print("the load waited for the back-logged work", flush=True)
                os._exit(3)
            gate.open()
            await copied
            assert (out == 100).all(), out
            await d0.launch(fresh, grid=(1,), block=(1,), args=(buf,))
            assert (await buf.to_numpy(np.int64))[0] == 5
            print("copies", rt.stats()["copies"])
            rt.close()
        asyncio.run(main())
    """, "the load hung")
    assert "'shader'" in out, out
