"""The watchdog on ROCr 5.2.3's blits: a blit runs its copies in order, whatever aiogpu calls
them, so a copy queued behind one that waits for a lost completion is held up, not silent."""
from __future__ import annotations

import numpy as np

import aiogpu
from aiogpu.futures import cause_chain
from gpu_kernels import peek, slow_write


def test_peer_and_device_to_host_copies_of_a_gpu_name_its_one_pcie_blit(make_runtime):
    """ROCr (GpuAgent::GetBlitObject): without an xGMI hive a peer copy runs on the source's
    device-to-host blit, so its future names that blit (the watchdog orders work by that name)."""
    rt = make_runtime()
    d0, d1 = rt.devices
    a, b = d0.alloc(8), d1.alloc(8)
    assert aiogpu.copy(a, np.ones(1, np.int64)).wait(10)
    peer = aiogpu.copy(b, a)
    down = a.to_numpy(np.int64)
    assert peer.wait(10) and down.wait(10)
    assert peer.queue == down.queue == "gpu0.rocr-d2h"
    assert rt.api.emulator.blit_stats(0)["d2h"]["copies"] == 2


def test_a_copy_behind_a_peer_copy_waiting_for_a_lost_completion_is_not_timed_out(make_runtime):
    rt = make_runtime(watchdog_s=1.0)
    d0, d1 = rt.devices
    src, dst, other, x = d0.alloc(8), d1.alloc(8), d0.alloc(8), d1.alloc(8)
    assert aiogpu.gather(aiogpu.copy(src, np.full(1, 5, np.int64)),
                         aiogpu.copy(other, np.full(1, 9, np.int64))).wait(10)
    # The lost kernel on gpu1 can start only once a slow one there has run: its silence starts
    # counting well after the read-back below is queued.
    rt.api.emulator.faults.lose_completion_at(2, agent=1)
    slow = d1.launch(slow_write, grid=(1,), block=(1,), args=(x, 300))
    lost = d1.launch(peek, grid=(1,), block=(1,), args=(x,), after=[slow])
    # On gpu0's device-to-host blit: the peer copy waits there for the lost kernel, and the
    # read-back of an unrelated buffer queues behind it.
    peer = aiogpu.copy(dst, src, after=[lost])
    out = np.zeros(1, np.int64)
    down = aiogpu.copy(out, other)
    assert down.wait(10) and down.exception() is None, down.exception()
    assert out[0] == 9
    assert slow.exception() is None and isinstance(lost.exception(), aiogpu.WatchdogTimeout)
    assert peer.wait(10) and lost.exception() in cause_chain(peer.exception())
    assert not any(isinstance(e, aiogpu.WatchdogTimeout) for e in cause_chain(peer.exception())[:-1])
