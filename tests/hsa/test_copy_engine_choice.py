"""CopyEngines (ROCm 5.7's engine calls): ``may_take`` answers what ``pick`` would, an engine ROCr
refused for a direction is never picked for it again, and a failed copy call names itself."""
from __future__ import annotations

import pytest

from aiogpu.errors import HsaError
from aiogpu.hsa_bindings import types as T


def _h2d(rt):
    d0 = rt.devices[0]
    return d0.engines, d0.agent, rt._cpu       # (engines, dst agent, src agent)


def test_with_no_engine_free_nor_proven_may_take_and_pick_agree_on_a_shader_copy(make_runtime, monkeypatch):
    rt = make_runtime(gpus=1, rocr_version="5.7")
    engines, dst, src = _h2d(rt)
    monkeypatch.setattr(engines, "free_engines", lambda dst_agent, src_agent: [])   # all busy
    assert engines.may_take(dst, src) is False
    assert engines.pick(dst, src) is None


def test_an_engine_refused_for_a_direction_is_never_picked_for_it_again(make_runtime, monkeypatch):
    """ROCr's status and copy checks disagree in one corner (see CopyEngines): an engine it
    reported free, used, then refused with INVALID_ARGUMENT is dropped for that direction, also
    as the busy engine a copy would queue behind."""
    rt = make_runtime(gpus=1, rocr_version="5.7")
    engines, dst, src = _h2d(rt)
    engine = engines.pick(dst, src)
    assert engine                                # an engine is free: it is used
    assert engines.pick(dst, src) == engine      # reported free after use: a real SDMA queue
    assert engine in engines.proven
    monkeypatch.setattr(rt.api, "hsa_amd_memory_async_copy_on_engine",
                        lambda *args: T.HSA_STATUS_ERROR_INVALID_ARGUMENT)
    assert engines.submit(engine, 0, dst, 0, src, 8, [], 0, []) is None     # refused: a shader copy
    monkeypatch.setattr(engines, "free_engines", lambda dst_agent, src_agent: [])   # all busy now
    assert engines.may_take(dst, src) is False
    assert engines.pick(dst, src) is None


def test_a_failed_copy_call_raises_an_error_naming_it(make_runtime, monkeypatch):
    rt = make_runtime(gpus=1, rocr_version="5.7")
    engines, dst, src = _h2d(rt)
    engine = engines.pick(dst, src)
    monkeypatch.setattr(rt.api, "hsa_amd_memory_async_copy_on_engine", lambda *args: T.HSA_STATUS_ERROR)
    with pytest.raises(HsaError, match="hsa_amd_memory_async_copy_on_engine") as got:
        engines.submit(engine, 0, dst, 0, src, 8, [], 0, [])
    assert got.value.status == T.HSA_STATUS_ERROR


def test_runs_names_only_this_devices_engines(make_runtime):
    rt = make_runtime(gpus=2, rocr_version="5.7")
    engines = rt.devices[0].engines
    assert engines.runs(None) is False
    assert engines.runs(rt.devices[0].queues[0].name) is False
    assert engines.runs("gpu1.sdma0") is False
    assert engines.runs("gpu0.sdma0") and engines.runs("gpu0.rocr-h2d")
