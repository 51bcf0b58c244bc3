"""The AQL writer's rules from the KFD review, checked by the virtual KFD's command processor on
the real ROCr 5.2.3: the doorbell names the last published packet (never one not yet published,
never a smaller index than before), and a completion signal is not re-armed while a packet that
names it is pending. The engine counts each violation it sees (``doorbell_ahead``,
``doorbell_backwards``, ``signal_rearmed_early``); aiogpu and ROCr's own queues must leave them at
zero, and a deliberately wrong raw writer must make each one count."""
from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

import aiogpu
from aiogpu.hsa_bindings import packets as P
from aiogpu.hsa_bindings import types as T
from aiogpu.hsa_bindings.atomics import store_u32_release
from backends import _close_checked, on_hsa_virtual
from gpu_kernels import add_const_n
from test_hsa_virtual_conformance import Raw

pytestmark = on_hsa_virtual

RULES = ("doorbell_ahead", "doorbell_backwards", "signal_rearmed_early")


def rule_counts(counters_of, gpus: int) -> dict:
    return {name: sum(counters_of(g)[name] for g in range(gpus)) for name in RULES}


@pytest.fixture
def make_virtual():
    made = []

    def make(**options):
        rt = aiogpu.Runtime("hsa-virtual", gpus=2, **options)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        _close_checked(rt)


@pytest.mark.asyncio
@pytest.mark.parametrize("sdma_queues", [None, 0], ids=["sdma", "blit-kernels"])
async def test_aiogpu_and_rocr_keep_the_doorbell_and_signal_rules(make_virtual, sdma_queues):
    """A burst of launches, copies both ways, peer copies and graph replays on a 64-slot ring with
    the eager command processor; without SDMA queues ROCr's copies are its own blit kernels on its
    own AQL queues, whose doorbells ROCr rings itself."""
    options = {} if sdma_queues is None else {"sdma_queues": sdma_queues}
    rt = make_virtual(eager=True, ring_size=64, watchdog_s=60, **options)
    stats = lambda g: rt.stats()["vkfd"][f"gpu{g}"]   # noqa: E731
    assert rule_counts(stats, 2) == dict.fromkeys(RULES, 0)
    d0, d1 = rt.devices
    a, b, c = d0.alloc(8 * 16), d1.alloc(8 * 16), d0.alloc(8)
    await aiogpu.gather(aiogpu.copy(a, np.zeros(16, np.int64)), aiogpu.copy(c, np.zeros(1, np.int64)))
    work = [d0.launch(add_const_n, grid=(16,), block=(16,), args=(a, 1, 16)) for _ in range(300)]
    await aiogpu.gather(*work)
    host = np.empty(16, np.int64)
    for _ in range(20):
        await aiogpu.copy(b, a)
        await aiogpu.copy(host, b)
    np.testing.assert_array_equal(host, 300)
    with aiogpu.Graph() as g:
        n1 = d0.launch(add_const_n, grid=(1,), block=(1,), args=(c, 1, 1))
        d1.launch(add_const_n, grid=(16,), block=(16,), args=(b, 1, 16), after=[aiogpu.copy(b, a, after=[n1])])
    exe = g.instantiate()
    await aiogpu.gather(*[exe.launch() for _ in range(200)])
    assert (await c.to_numpy(np.int64))[0] == 200
    np.testing.assert_array_equal(await b.to_numpy(np.int64), 301)
    seen = [stats(g) for g in range(2)]
    assert sum(s["aql_dispatch"] for s in seen) >= 300 + 400
    if sdma_queues == 0:
        # ROCr copies with its blit kernels; copies past the room a device keeps in ROCr's
        # queues (CopyEngines) are aiogpu's shader copies.
        blits, shaders = sum(s["blit_copy"] for s in seen), rt.stats()["copies"]["shader"]
        assert blits >= 40 and blits + shaders >= 40 + 200, (blits, shaders)
        assert sum(s["sdma_copy_linear"] for s in seen) == 0
    assert rule_counts(stats, 2) == dict.fromkeys(RULES, 0)


# -- a deliberately wrong writer through the raw HSA API ---------------------------------------------
@pytest.fixture
def raw():
    r = Raw("hsa-virtual")
    yield r
    r.close()


def _counts(raw) -> dict:
    return rule_counts(raw.api.vkfd.counters, len(raw.gpus))


def _publish(raw, q, completion, deps=()) -> int:
    """A barrier-AND packet written body first, header last, at the next index; not rung."""
    pkt = P.hsa_barrier_and_packet_t()
    for i, d in enumerate(deps):
        pkt.dep_signal[i] = d
    pkt.completion_signal = completion
    index = raw.api.hsa_queue_add_write_index_scacq_screl(q, 1)
    slot = q.contents.base_address + (index % q.contents.size) * P.PACKET_SIZE
    ctypes.memmove(slot + 4, ctypes.addressof(pkt) + 4, P.PACKET_SIZE - 4)
    store_u32_release(slot, P.make_header(P.HSA_PACKET_TYPE_BARRIER_AND))
    return index


def _ring(raw, q, value: int) -> None:
    raw.api.hsa_signal_store_screlease(T.hsa_signal_t(q.contents.doorbell_signal.handle), value)


def _wait_count(raw, name: str, want: int, before: dict) -> dict:
    """The counts once `name` reached before + want (the engine reads the doorbell on its own
    schedule), or after 20 s."""
    end = time.monotonic() + 20
    while _counts(raw)[name] < before[name] + want and time.monotonic() < end:
        time.sleep(0.001)
    return _counts(raw)


def test_a_doorbell_one_past_the_last_published_packet_counts_as_ahead(raw):
    q = raw.queue(0)
    before = _counts(raw)
    first, second = raw.signal(1), raw.signal(1)
    index = _publish(raw, q, first)
    _ring(raw, q, index + 1)              # names a packet whose header is still INVALID
    assert raw.wait_below(first) == 0      # the engine read that doorbell before running the packet
    after = _counts(raw)
    assert after["doorbell_ahead"] == before["doorbell_ahead"] + 1
    # the writer catches up: the packet the doorbell named is published now, nothing more counts
    assert _publish(raw, q, second) == index + 1
    _ring(raw, q, index + 1)
    assert raw.wait_below(second) == 0
    assert _counts(raw) == after


def test_a_doorbell_that_decreases_counts_as_backwards(raw):
    q = raw.queue(0)
    before = _counts(raw)
    signals = [raw.signal(1) for _ in range(3)]
    for s in signals[:2]:
        _ring(raw, q, _publish(raw, q, s))
    assert raw.wait_below(signals[1]) == 0
    _ring(raw, q, 0)                      # below the index it named before
    after = _wait_count(raw, "doorbell_backwards", 1, before)
    assert after["doorbell_backwards"] == before["doorbell_backwards"] + 1
    assert after["doorbell_ahead"] == before["doorbell_ahead"]
    _ring(raw, q, _publish(raw, q, signals[2]))   # forward again: the queue goes on
    assert raw.wait_below(signals[2]) == 0


def test_a_completion_signal_rearmed_while_its_packet_is_pending_counts(raw):
    """A barrier waits on `gate`; once the engine has fetched it (two round trips through a queue
    created after it prove the engine stepped it since its doorbell), the host stores a new value
    into its completion signal; the barrier then retires and its decrement lands on the new use."""
    pending, other = raw.queue(0), raw.queue(0)
    before = _counts(raw)
    gate, completion = raw.signal(1), raw.signal(1)
    _ring(raw, pending, _publish(raw, pending, completion, deps=[gate]))
    for _ in range(2):
        probe = raw.signal(1)
        _ring(raw, other, _publish(raw, other, probe))
        assert raw.wait_below(probe) == 0
    assert raw.value(completion) == 1
    raw.api.hsa_signal_store_screlease(completion, 5)   # re-armed before the packet retired
    raw.api.hsa_signal_store_screlease(gate, 0)
    assert raw.api.hsa_signal_wait_scacquire(completion, T.HSA_SIGNAL_CONDITION_LT, 5, 20 * 10**9,
                                             T.HSA_WAIT_STATE_BLOCKED) == 4
    after = _counts(raw)
    assert after["signal_rearmed_early"] == before["signal_rearmed_early"] + 1
    assert after["doorbell_ahead"] == before["doorbell_ahead"]


def test_a_completion_signal_rearmed_after_retirement_does_not_count(raw):
    q = raw.queue(0)
    before = _counts(raw)
    s = raw.signal(1)
    for _ in range(5):
        _ring(raw, q, _publish(raw, q, s))
        assert raw.wait_below(s) == 0
        raw.api.hsa_signal_store_screlease(s, 1)   # reused only after it retired
    assert _counts(raw) == before


def test_a_stress_run_on_the_real_rocr_keeps_the_rules():
    """Random kernels, copies, peer copies, gathers and graph replays from 32 tasks: the counters
    are the process's virtual KFD's, read once the run closed its Runtime."""
    from aiogpu import vkfd
    from aiogpu.cli import stress

    stats, leaks = stress.run_stress(ops=1000, gpus=2, seed=11, tasks=32, backend="hsa-virtual")
    assert (stats.ops, stats.mismatches, stats.unexpected, stats.hangs, leaks) == (1000, 0, 0, 0, {})
    kfd = vkfd.load()
    assert sum(kfd.counters(g)["aql_dispatch"] for g in range(2)) > 0
    assert rule_counts(kfd.counters, 2) == dict.fromkeys(RULES, 0)
