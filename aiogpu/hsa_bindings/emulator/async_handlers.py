"""Asynchronous signal handlers (``hsa_amd_signal_async_handler``), as ROCr runs them.

ROCr (``Runtime::SetAsyncSignalHandler``, ``Runtime::AsyncEventsLoop``) keeps one list of
(signal, condition, value, handler, arg) and one thread, started with the first registration,
that waits on all of them at once. When a condition holds it calls the handler with the value it
read, on that thread; a handler that returns false is removed, one that returns true stays
registered and is called again whenever its condition holds. A signal destroyed while its handler
is registered has the handler dropped without a call (``Signal::DestroySignal`` makes the handle
invalid and wakes the loop, which drops dead signals). ``hsa_amd_signal_async_handler`` refuses
a signal without an interrupt event (INVALID_SIGNAL): ROCr's loop sleeps on events. At
hsa_shut_down the thread stops; handlers still registered are never called.

The emulator calls each handler outside its own lock, one at a time, in the order the loop finds
them satisfied, as ROCr does.
"""
from __future__ import annotations

import threading
from typing import Any

from .signals import Signal, Waiter, condition_met, wait_for


class _Entry:
    __slots__ = ("signal", "cond", "value", "handler", "arg")

    def __init__(self, signal: Signal, cond: int, value: int, handler: Any, arg: Any) -> None:
        self.signal, self.cond, self.value, self.handler, self.arg = signal, cond, value, handler, arg

    def due(self) -> bool:
        return not self.signal.alive or condition_met(self.cond, self.signal.load(), self.value)


class AsyncHandlers:
    """The registered handlers of one initialised emulator and the thread that calls them."""

    def __init__(self, name: str, report_bug: Any) -> None:
        self._name = name
        self._report_bug = report_bug
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self._changed = False
        self._stop = False
        self._waiter = Waiter()
        self._thread: threading.Thread | None = None
        self.calls = 0                 # handler calls made (tests read it)

    def register(self, signal: Signal, cond: int, value: int, handler: Any, arg: Any) -> None:
        with self._lock:
            self._entries.append(_Entry(signal, cond, value, handler, arg))
            self._changed = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self._name}-async-events",
                                                daemon=True)
                self._thread.start()
        self._waiter.wake()

    @property
    def registered(self) -> int:
        with self._lock:
            return len(self._entries)

    def shutdown(self) -> None:
        """Stop the thread (before the signals go): handlers still registered are dropped."""
        with self._lock:
            self._stop = True
            thread, self._entries = self._thread, []
        self._waiter.wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stop:
                        return
                    entries, self._changed = list(self._entries), False

                def ready() -> Any:
                    if self._stop or self._changed:
                        return "again"
                    return [e for e in entries if e.due()] or None

                got = wait_for(self._waiter, [e.signal for e in entries], ready)
                if got == "again":
                    continue
                for entry in got:
                    self._call(entry)
        except BaseException as exc:  # an emulator bug: report it rather than die silently
            self._report_bug(threading.current_thread().name, exc)

    def _call(self, entry: _Entry) -> None:
        signal = entry.signal
        keep = False
        if signal.alive:
            with self._lock:
                if self._stop:
                    return
            value = signal.load()
            if condition_met(entry.cond, value, entry.value):
                self.calls += 1
                keep = bool(entry.handler(value, entry.arg))
            else:
                keep = True            # (changed back since the loop saw it: wait again)
        if not keep:
            with self._lock:
                if entry in self._entries:
                    self._entries.remove(entry)
