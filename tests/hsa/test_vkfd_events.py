"""KFD events as the virtual KFD gives them to ROCr: the semantics of amdkfd's kfd_events.c."""
from __future__ import annotations

import ctypes
import threading
import time

import pytest

from backends import on_hsa_virtual

pytestmark = on_hsa_virtual
HSA_EVENTTYPE_SIGNAL = 0
SUCCESS, WAIT_TIMEOUT = 0, 31


class EventDescriptor(ctypes.Structure):
    _fields_ = [("EventType", ctypes.c_int), ("NodeId", ctypes.c_uint32),
                ("UserData", ctypes.c_uint64), ("SyncVarSize", ctypes.c_uint64)]


@pytest.fixture
def kfd():
    from aiogpu import vkfd
    k = vkfd.load().kfd
    k.hsaKmtCreateEvent.argtypes = [ctypes.POINTER(EventDescriptor), ctypes.c_bool, ctypes.c_bool,
                                    ctypes.POINTER(ctypes.c_void_p)]
    for name in ("hsaKmtSetEvent", "hsaKmtDestroyEvent", "vkfd_event_waiters"):
        getattr(k, name).argtypes = [ctypes.c_void_p]
    k.hsaKmtWaitOnEvent.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    return k


def _event(kfd, manual=False):
    ev = ctypes.c_void_p()
    assert kfd.hsaKmtCreateEvent(ctypes.byref(EventDescriptor(HSA_EVENTTYPE_SIGNAL)), manual, False,
                                 ctypes.byref(ev)) == SUCCESS
    return ev


def test_one_set_wakes_every_thread_waiting_on_an_auto_reset_event(kfd):
    """ROCr's async-event thread and a thread in hsa_signal_wait can wait on one signal's event;
    a wake-up the first consumed would leave the second waiting for good."""
    ev = _event(kfd)
    results = []
    threads = [threading.Thread(target=lambda: results.append(kfd.hsaKmtWaitOnEvent(ev, 10_000))) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while kfd.vkfd_event_waiters(ev) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert kfd.vkfd_event_waiters(ev) == 2
    kfd.hsaKmtSetEvent(ev)
    for t in threads:
        t.join(20)
    assert results == [SUCCESS, SUCCESS]
    assert kfd.hsaKmtWaitOnEvent(ev, 0) == WAIT_TIMEOUT      # and the event is not left signaled
    kfd.hsaKmtDestroyEvent(ev)


def test_a_set_without_waiters_is_consumed_by_the_next_wait(kfd):
    ev = _event(kfd)
    kfd.hsaKmtSetEvent(ev)
    assert [kfd.hsaKmtWaitOnEvent(ev, 0), kfd.hsaKmtWaitOnEvent(ev, 0)] == [SUCCESS, WAIT_TIMEOUT]
    manual = _event(kfd, manual=True)
    kfd.hsaKmtSetEvent(manual)
    assert [kfd.hsaKmtWaitOnEvent(manual, 0), kfd.hsaKmtWaitOnEvent(manual, 0)] == [SUCCESS, SUCCESS]
    kfd.hsaKmtDestroyEvent(ev)
    kfd.hsaKmtDestroyEvent(manual)
