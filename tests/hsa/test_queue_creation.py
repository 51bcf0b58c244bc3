"""How an AQL queue is created: its size within the agent's bounds, ROCr's default segment sizes,
and an error that names the call when ROCr refuses."""
from __future__ import annotations

import ctypes

import pytest

from aiogpu.errors import HsaError
from aiogpu.hsa_bindings import types as T

UINT32_MAX = 0xFFFFFFFF


def _agent_bound(rt, queue, attribute):
    value = ctypes.c_uint32(0)
    assert rt.api.hsa_agent_get_info(queue.agent, attribute, ctypes.byref(value)) == T.HSA_STATUS_SUCCESS
    return value.value


@pytest.mark.parametrize("min_size", [64, 4])
def test_a_ring_size_is_a_power_of_two_within_the_agents_bounds(make_runtime, min_size):
    """ROCr refuses a size outside [QUEUE_MIN_SIZE, QUEUE_MAX_SIZE] or not a power of two."""
    rt = make_runtime(gpus=1, emulator_min_queue_size=min_size)
    queue = rt.devices[0].queues[0]
    low = _agent_bound(rt, queue, T.HSA_AGENT_INFO_QUEUE_MIN_SIZE)
    high = _agent_bound(rt, queue, T.HSA_AGENT_INFO_QUEUE_MAX_SIZE)
    assert low == min_size
    assert queue.ring_size(1) == low
    assert queue.ring_size(low - 1) == low
    assert queue.ring_size(low + 1) == 2 * low
    assert queue.ring_size(1 << 40) == high


def test_queues_ask_rocr_for_its_default_segment_sizes(make_runtime, monkeypatch):
    """UINT32_MAX private and group segment sizes: the agent's maxima, which ROCr takes as 'the
    kernels decide' (hsa_queue_create: AqlQueue's constructor)."""
    rt = make_runtime(gpus=1)
    queue = rt.devices[0].queues[0]
    calls, real = [], rt.api.hsa_queue_create

    def recording(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(rt.api, "hsa_queue_create", recording)
    queue.destroy()
    queue._create()                 # what replacing a failed queue does
    assert len(calls) == 1
    agent, size, kind, _callback, data, private, group, _out = calls[0]
    assert (size, kind, data) == (queue.size, T.HSA_QUEUE_TYPE_MULTI, None)
    assert (private, group) == (UINT32_MAX, UINT32_MAX)


def test_a_refused_queue_raises_an_error_naming_the_call_and_the_queue(make_runtime, monkeypatch):
    rt = make_runtime(gpus=1)
    queue = rt.devices[0].queues[0]
    monkeypatch.setattr(rt.api, "hsa_queue_create", lambda *args: T.HSA_STATUS_ERROR_OUT_OF_RESOURCES)
    with pytest.raises(HsaError, match=rf"hsa_queue_create\({queue.name}\)") as got:
        queue._create()
    assert got.value.status == T.HSA_STATUS_ERROR_OUT_OF_RESOURCES
