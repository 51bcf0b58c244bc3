"""The runtime lock's reentrant lock (``RawLock``, ``InterruptSafeLock.raw``) behaves as
``threading.RLock``: reentrant for its holder, exclusive between threads, ``acquire``'s blocking
and timeout arguments, RuntimeError when a thread releases what it does not hold."""
from __future__ import annotations

import threading

import pytest

from aiogpu._interrupts import InterruptSafeLock, RawLock


def in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    assert not t.is_alive()
    return out[0]


def test_it_is_reentrant_and_exclusive():
    lock = RawLock()
    assert not lock._is_owned()
    assert lock.acquire() and lock.acquire(False) and lock.acquire(True, 1.0)
    assert lock._is_owned() and in_thread(lock._is_owned) is False
    assert in_thread(lambda: lock.acquire(False)) is False
    assert in_thread(lambda: lock.acquire(timeout=0.01)) is False
    lock.release()
    lock.release()
    assert in_thread(lambda: lock.acquire(False)) is False      # held once more
    lock.release()
    assert not lock._is_owned()
    assert in_thread(lambda: (lock.acquire(False), lock.release())[0]) is True


def test_a_blocking_acquire_waits_for_the_holder():
    lock, order = RawLock(), []
    held, go = threading.Event(), threading.Event()

    def holder():
        with lock:
            held.set()
            go.wait(10)
            order.append("holder done")

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(10)
    go.set()
    with lock:                       # waits (GIL released) until the holder lets go
        order.append("main in")
    t.join(10)
    assert order == ["holder done", "main in"]


def test_misuse_raises_as_for_an_rlock():
    lock = RawLock()
    with pytest.raises(RuntimeError):
        lock.release()
    lock.acquire()
    assert in_thread(lambda: _raises(lock.release)) == "RuntimeError"
    lock.release()
    with pytest.raises(ValueError):
        lock.acquire(False, 1.0)
    with pytest.raises(ValueError):
        lock.acquire(True, -2)
    assert not lock._is_owned()


def _raises(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__
    return None


def test_the_interrupt_safe_lock_is_its_raw_lock():
    lock = InterruptSafeLock()
    with lock:
        assert lock.raw._is_owned()
        assert in_thread(lambda: lock.try_run(lambda: None)) is False
        assert in_thread(lambda: lock.raw.acquire(False)) is False
        with lock.raw:
            assert lock.try_run(lambda: None) is True
    assert not lock.raw._is_owned()
    assert in_thread(lambda: lock.try_run(lambda: None)) is True
