"""A FutureHub the test drives by hand, for tests of how completions reach awaiters and
done-callbacks without a runtime."""
from __future__ import annotations

import threading

from aiogpu.futures import FutureHub, GPUFuture


class ManualHub(FutureHub):
    """A hub without a waiter thread: the test settles futures from a thread, as the waiter
    does (one batch per event loop for everything settled together)."""

    def wake(self) -> None:
        pass

    def new(self, key: int) -> GPUFuture:
        fut = GPUFuture(self, f"op{key}", signal=key)
        with self.lock:
            self._pending[key] = fut
        return fut

    def complete(self, *futures: GPUFuture) -> None:
        t = threading.Thread(target=self._settle, args=([(f.signal, f) for f in futures],))
        t.start()
        t.join()
