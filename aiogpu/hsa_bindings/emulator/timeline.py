"""A record of every packet and copy the emulated GPUs ran, with start and end times.

ROCr exposes per-dispatch timestamps through ``hsa_amd_profiling_get_dispatch_time``; the
timeline is the emulator's superset of that: one record per completed packet (dispatch or
barrier) and per SDMA copy, so tests can prove overlap (or its absence) and a trace can be
written in Chrome's trace-event format.

Bounded (issue 13.20): only the newest ``capacity`` records are kept (a ring buffer; a record
costs about 400 bytes), and ``counts`` keeps the number of every kind ever recorded, so a
long-running process does not grow without bound.
"""
from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import Iterator

DEFAULT_CAPACITY = 10_000


@dataclass(frozen=True)
class TimelineRecord:
    """One unit of work. ``queue`` is the hsa_queue_t id (packets), ``engine`` the SDMA engine
    index (copies); the other one is None. ``packet`` is the packet id in its queue, or the copy's
    sequence number on its agent. Times are HSA timestamps (ns, monotonic clock)."""

    agent: int
    queue: int | None
    engine: int | None
    kind: str  # "dispatch" | "barrier" | "copy"
    name: str  # kernel name, packet kind, or copy direction
    nbytes: int
    start_ns: int
    end_ns: int
    packet: int

    def overlaps(self, other: "TimelineRecord") -> bool:
        return self.start_ns < other.end_ns and other.start_ns < self.end_ns


class Timeline:
    """Thread-safe ring buffer of the newest ``capacity`` TimelineRecords, with per-kind totals.

    ``len()`` and iteration cover the records kept; ``counts`` (kind -> number) and ``total``
    cover every record ever added since the last ``clear()``; ``dropped`` is how many fell out.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("a timeline keeps at least one record")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._records: deque[TimelineRecord] = deque(maxlen=capacity)
        self.counts: Counter[str] = Counter()

    def add(self, record: TimelineRecord) -> None:
        with self._lock:
            self._records.append(record)
            self.counts[record.kind] += 1

    @property
    def total(self) -> int:
        """Records added since the last clear(), kept or not."""
        with self._lock:
            return sum(self.counts.values())

    @property
    def dropped(self) -> int:
        """Records that fell out of the ring buffer."""
        with self._lock:
            return sum(self.counts.values()) - len(self._records)

    def records(self, kind: str | None = None, agent: int | None = None,
                queue: int | None = None) -> list[TimelineRecord]:
        """A snapshot, optionally filtered, ordered by start time."""
        with self._lock:
            out = list(self._records)
        out = [r for r in out if (kind is None or r.kind == kind) and (agent is None or r.agent == agent)
               and (queue is None or r.queue == queue)]
        return sorted(out, key=lambda r: (r.start_ns, r.packet))

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
            self.counts.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def __iter__(self) -> Iterator[TimelineRecord]:
        return iter(self.records())

    def __getitem__(self, index: int) -> TimelineRecord:
        return self.records()[index]

    def chrome_trace(self) -> list[dict]:
        """Complete ("X") events of the Trace Event Format; one track per queue or engine."""
        events = []
        for r in self.records():
            track = f"queue {r.queue}" if r.queue is not None else f"sdma {r.engine}"
            events.append({"name": r.name, "cat": r.kind, "ph": "X", "pid": f"gpu {r.agent}",
                           "tid": track, "ts": r.start_ns / 1000.0,
                           "dur": max(r.end_ns - r.start_ns, 0) / 1000.0, "args": asdict(r)})
        return events
