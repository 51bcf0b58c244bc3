"""Copies of one direction are spread over the engines ROCr reports free for it."""
from __future__ import annotations

import numpy as np

import aiogpu


def test_peer_copies_take_turns_on_the_free_xgmi_engines(make_runtime):
    """xGMI peer copies may use only xGMI engines (none is the runtime's preferred engine), so
    while several are free the runtime goes round them: one copy after another, with every
    engine free each time, alternates over both."""
    rt = make_runtime(gpus=2, xgmi_engines=2, rocr_version="5.7")   # (5.2.3 has no engine choice)
    d0, d1 = rt.devices
    src, dst = d0.alloc(1024), d1.alloc(1024)
    assert aiogpu.copy(src, np.arange(1024, dtype=np.uint8)).wait(20)
    names = []
    for _ in range(4):
        fut = aiogpu.copy(dst, src)
        assert fut.wait(20) and fut.exception() is None
        names.append(fut.queue)
    assert sorted(names) == ["gpu0.sdma2", "gpu0.sdma2", "gpu0.sdma3", "gpu0.sdma3"], names
    xgmi = rt.api.emulator.engine_history(0)[2:]           # engine offsets 3 and 4: the xGMI blits
    assert [len([r for r in h if r.name == "P2P"]) for h in xgmi] == [2, 2]
