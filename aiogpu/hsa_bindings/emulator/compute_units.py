"""The compute units of one emulated GPU: a pool of worker threads shared by its queues.

On hardware the command processor launches a dispatch's workgroups onto the GPU's compute units,
and dispatches without the barrier bit may run at the same time. Here each dispatch's NumPy body
is one job; ``count`` workers take jobs in launch order, so up to ``count`` dispatches (from any
queue of the GPU) overlap. Threads start on the first job and are joined by ``shutdown``.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

from ._abi import join_thread

Job = Callable[[], None]


class ComputeUnits:
    def __init__(self, name: str, count: int, on_error: Callable[[str, BaseException], None]) -> None:
        self.name = name
        self.count = max(1, count)
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._on_error = on_error

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: compute units shut down")
            if not self._threads:
                self._start()
        self._jobs.put(job)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        for t in threads:
            join_thread(t)

    def _start(self) -> None:
        for i in range(self.count):
            t = threading.Thread(target=self._work, name=f"{self.name}-cu{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException as exc:  # a job reports its own errors; this is a bug
                self._on_error(self.name, exc)
