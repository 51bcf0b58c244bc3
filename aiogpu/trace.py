"""Timeline traces: every operation as a Chrome/Perfetto trace event, one track per queue/engine.

    with aiogpu.trace("out.json"):
        ...                       # GPU work of any runtime
    # or: AIOGPU_TRACE=out.json python app.py

Each operation is recorded when it completes: its device, queue or engine, kind, name (the
kernel), bytes, the host time it was submitted, and its start/end on the device where the backend
reports them (the emulator's dispatch timestamps, in the same monotonic clock as the host);
otherwise the end is when the waiter observed the completion. Open the file in Perfetto
(ui.perfetto.dev) or chrome://tracing.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from typing import Any, Iterator

active: "Tracer | None" = None


class Tracer:
    """Collects trace records (cheap appends from the waiter thread) and writes them out."""

    def __init__(self, path: str):
        self.path = path
        self.records: list[dict] = []
        self._lock = threading.Lock()

    def record(self, fut: Any, device_times: tuple[int, int] | None) -> None:
        end_host = time.monotonic_ns()
        start, end = device_times if device_times else (None, None)
        submitted = int(fut.submitted_at * 1e9)
        rec = {
            "name": fut.label or "?", "kind": fut.kind or "op",
            "device": getattr(fut.device, "name", "host"), "track": fut.queue or "unknown",
            "nbytes": fut.nbytes, "submit_ns": submitted,
            "start_ns": start if start else submitted, "end_ns": end if end else end_host,
            "device_times": bool(device_times), "failed": fut._exc is not None,
        }
        with self._lock:
            self.records.append(rec)

    def events(self) -> list[dict]:
        """Trace Event Format: metadata naming each process (device) and thread (queue)."""
        with self._lock:
            records = list(self.records)
        pids: dict[str, int] = {}
        tids: dict[tuple[str, str], int] = {}
        events: list[dict] = []
        for r in records:
            pid = pids.setdefault(r["device"], len(pids) + 1)
            key = (r["device"], r["track"])
            if key not in tids:
                tids[key] = len(tids) + 1
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[key],
                               "args": {"name": r["track"]}})
            events.append({"ph": "X", "name": r["name"], "cat": r["kind"], "pid": pid, "tid": tids[key],
                           "ts": r["start_ns"] / 1000.0, "dur": max(r["end_ns"] - r["start_ns"], 0) / 1000.0,
                           "args": {"bytes": r["nbytes"], "submitted_us": r["submit_ns"] / 1000.0,
                                    "device_timestamps": r["device_times"], "failed": r["failed"]}})
        for name, pid in pids.items():
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        return events

    def write(self) -> None:
        with open(self.path, "w") as fh:
            json.dump({"traceEvents": self.events(), "displayTimeUnit": "ns"}, fh)


@contextlib.contextmanager
def trace(path: str) -> Iterator[Tracer]:
    """Record every GPU operation completed inside the block; write ``path`` at exit."""
    global active
    previous, tracer = active, Tracer(path)
    active = tracer
    try:
        yield tracer
    finally:
        active = previous
        tracer.write()


def _from_environment() -> None:
    global active
    path = os.environ.get("AIOGPU_TRACE")
    if path and active is None:
        active = Tracer(path)
        atexit.register(active.write)


_from_environment()
