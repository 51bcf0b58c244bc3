"""Timeline traces: every operation as a Chrome/Perfetto trace event, one track per queue/engine.

    with aiogpu.trace("out.json"):
        ...                       # GPU work of any runtime
    # or: AIOGPU_TRACE=out.json python app.py

Every operation appears once. One that ran is a span, recorded when it completes: its device,
queue or engine, kind, name (the kernel), bytes, the host time it was submitted, and its start/end
on the device where the backend reports them (the emulator's dispatch timestamps, in the same
monotonic clock as the host); otherwise the end is when the waiter observed the completion. One
that never ran (an input had failed, a gather with nothing left to wait for) is an instant on the
"not run" track. Operations that overlap on one queue (dispatches without the barrier bit run
concurrently) are drawn on further rows of that queue's track ("gpu0.q0 [2]", ...): a viewer draws
a span inside another of the same row as its child, which would read as one calling the other.
Open the file in Perfetto (ui.perfetto.dev) or chrome://tracing.
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

    def record(self, fut: Any, device_times: tuple[int, int] | None, *, ran: bool = True) -> None:
        """Record ``fut`` (once: when it settles, or at creation if it never ran)."""
        end_host = time.monotonic_ns()
        start, end = device_times if device_times else (None, None)
        submitted = int(fut.submitted_at * 1e9)
        rec = {
            "name": fut.label or "?", "kind": fut.kind or "op",
            "device": getattr(fut.device, "name", "host"), "track": (fut.queue or "unknown") if ran else NOT_RUN,
            "nbytes": fut.nbytes, "submit_ns": submitted,
            "start_ns": start if start else submitted, "end_ns": end if end else end_host,
            "device_times": bool(device_times), "failed": fut._exc is not None, "ran": ran,
        }
        with self._lock:
            self.records.append(rec)

    def events(self) -> list[dict]:
        """Trace Event Format: a process per device, a thread per queue/engine row; spans for
        operations that ran, instants for those that did not."""
        with self._lock:
            records = sorted(self.records, key=lambda r: (r["start_ns"], r["end_ns"]))
        pids: dict[str, int] = {}
        rows: dict[tuple[str, str], list[int]] = {}      # (device, track) -> end of each row's last span
        tids: dict[tuple[str, str, int], int] = {}
        events: list[dict] = []
        for r in records:
            pid = pids.setdefault(r["device"], len(pids) + 1)
            row = _free_row(rows.setdefault((r["device"], r["track"]), []), r) if r["ran"] else 0
            key = (r["device"], r["track"], row)
            if key not in tids:
                tids[key] = tid = len(tids) + 1
                name = r["track"] if row == 0 else f"{r['track']} [{row + 1}]"
                order = sorted({(d, t) for d, t, _ in tids}).index((r["device"], r["track"]))
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                               "args": {"sort_index": order * 1000 + row}})
            args = {"bytes": r["nbytes"], "submitted_us": r["submit_ns"] / 1000.0,
                    "device_timestamps": r["device_times"], "failed": r["failed"]}
            event = {"name": r["name"], "cat": r["kind"], "pid": pid, "tid": tids[key], "ts": r["start_ns"] / 1000.0,
                     "args": args}
            if r["ran"]:
                event.update(ph="X", dur=max(r["end_ns"] - r["start_ns"], 0) / 1000.0)
            else:
                event.update(ph="i", s="t")
            events.append(event)
        for name, pid in pids.items():
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        return events

    def write(self) -> None:
        with open(self.path, "w") as fh:
            json.dump({"traceEvents": self.events(), "displayTimeUnit": "ns"}, fh)


NOT_RUN = "not run"


def _free_row(rows: list[int], record: dict) -> int:
    """The first row of a track whose last span ended by ``record``'s start (a new row if none):
    spans of one row never overlap, so none is drawn inside another."""
    for i, end in enumerate(rows):
        if end <= record["start_ns"]:
            rows[i] = record["end_ns"]
            return i
    rows.append(record["end_ns"])
    return len(rows) - 1


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
