"""Faults on demand: the failures a real GPU produces rarely, made to happen when a test asks.

Everything is off by default. Counted faults (``queue_error_at``, ``memory_fault_at``,
``lose_completion_at``) fire on the k-th AQL packet processed from the moment they are armed
(k = 1: the next one), counted over every queue, or over the queues of one GPU (``agent`` is a
GPU index). Copies are not packets and are not counted; ``delay_completions`` applies to both.
Every fault that fires is appended to ``fired``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from .. import types as T
from ._abi import now_ns


@dataclass(frozen=True)
class FaultRecord:
    """A fault that fired: what, where (GPU index, queue id, packet id), and a description."""

    kind: str  # queue_error | memory_fault | lost_completion | delayed_completion | sdma_exhausted | torn_packet
    agent: int | None
    queue: int | None
    packet: int | None
    detail: str
    status: int | None = None
    time_ns: int = field(default_factory=now_ns)


@dataclass
class _Armed:
    kind: str
    remaining: int
    agent: int | None
    status: int | None = None


class FaultInjector:
    """The fault switches of one emulator. Thread-safe; usable while work is in flight."""

    def __init__(self, *, eager: bool = False) -> None:
        self._lock = threading.Lock()
        self._eager = bool(eager)
        self.eager_poll_s = 0.00005  # header poll period of the eager packet processor
        self.eager_recheck_s = 0.0001  # delay before the eager processor re-reads a packet
        self._armed: list[_Armed] = []
        self._delay_s = 0.0
        self._delay_count: int | None = 0
        self._exhaust_all = False
        self._exhausted: set[int] = set()
        self._spared: set[int] = set()
        self.fired: list[FaultRecord] = []
        self._on_change: Callable[[], None] | None = None

    # ---- switches --------------------------------------------------------------------------
    @property
    def eager(self) -> bool:
        """Eager packet processor: reads a slot as soon as its header is valid, before the
        doorbell, and fails the queue (INVALID_PACKET_FORMAT) if the body changes afterwards."""
        return self._eager

    @eager.setter
    def eager(self, value: bool) -> None:
        self._eager = bool(value)
        self._changed()

    def queue_error_at(self, k: int, status: int = T.HSA_STATUS_ERROR_EXCEPTION,
                       agent: int | None = None) -> None:
        """The k-th packet processed from now fails its queue with ``status``."""
        self._arm(_Armed("queue_error", self._check_k(k), agent, status))

    def memory_fault_at(self, k: int, agent: int | None = None) -> None:
        """The k-th packet processed from now raises a GPU memory fault: the device's queues are
        evicted, for the life of the emulated process (queues created there later never run),
        and the system event handlers are told (no queue error)."""
        self._arm(_Armed("memory_fault", self._check_k(k), agent, T.HSA_STATUS_ERROR_MEMORY_FAULT))

    def lose_completion_at(self, k: int, agent: int | None = None) -> None:
        """The k-th packet processed from now runs and retires, but its completion signal is
        never decremented."""
        self._arm(_Armed("lost_completion", self._check_k(k), agent))

    def delay_completions(self, seconds: float, count: int | None = None) -> None:
        """Delay the next ``count`` completions (packets and copies; None: all) by ``seconds``."""
        if seconds < 0 or (count is not None and count < 0):
            raise ValueError("delay_completions needs seconds >= 0 and count >= 0 or None")
        with self._lock:
            self._delay_s, self._delay_count = float(seconds), count

    def exhaust_sdma(self, agent: int | None = None) -> None:
        """KFD has no SDMA queue left for GPU ``agent`` (None: every GPU). As in ROCr
        (GpuAgent::InitDma), this matters when a copy engine is first used: its SDMA queue cannot
        be created, so it becomes a blit kernel for good, the copy still succeeds, and engine
        status never reports that engine free again. Engines created earlier are unaffected."""
        with self._lock:
            if agent is None:
                self._exhaust_all, self._spared = True, set()
            else:
                self._exhausted.add(agent)
                self._spared.discard(agent)

    def restore_sdma(self, agent: int | None = None) -> None:
        with self._lock:
            if agent is None:
                self._exhaust_all, self._exhausted, self._spared = False, set(), set()
            else:
                self._exhausted.discard(agent)
                self._spared.add(agent)

    def reset(self) -> None:
        """Every switch off (eager included); ``fired`` is kept."""
        with self._lock:
            self._armed.clear()
            self._delay_s, self._delay_count = 0.0, 0
            self._exhaust_all, self._exhausted, self._spared = False, set(), set()
            self._eager = False
        self._changed()

    # ---- hooks for the emulator ------------------------------------------------------------
    def on_packet(self, agent: int, queue: int, packet: int) -> list[FaultRecord]:
        """Count one processed packet; returns the faults that fire on it (already recorded)."""
        fired = []
        with self._lock:
            for armed in list(self._armed):
                if armed.agent is not None and armed.agent != agent:
                    continue
                armed.remaining -= 1
                if armed.remaining == 0:
                    self._armed.remove(armed)
                    fired.append(FaultRecord(armed.kind, agent, queue, packet,
                                             f"injected {armed.kind}", armed.status))
            self.fired.extend(fired)
        return fired

    def completion_delay(self, agent: int, queue: int | None, packet: int) -> float:
        """Seconds to hold the next completion back (0.0 when not delaying)."""
        with self._lock:
            if self._delay_s <= 0 or self._delay_count == 0:
                return 0.0
            if self._delay_count is not None:
                self._delay_count -= 1
            self.fired.append(FaultRecord("delayed_completion", agent, queue, packet,
                                          f"completion delayed {self._delay_s} s"))
            return self._delay_s

    def sdma_exhausted(self, agent: int) -> bool:
        with self._lock:
            return (self._exhaust_all and agent not in self._spared) or agent in self._exhausted

    def record(self, record: FaultRecord) -> None:
        with self._lock:
            self.fired.append(record)

    def set_change_hook(self, hook: Callable[[], None] | None) -> None:
        """Called when a switch changes, so blocked packet processors re-read it (eager)."""
        self._on_change = hook

    # ---- internals -------------------------------------------------------------------------
    def _arm(self, armed: _Armed) -> None:
        with self._lock:
            self._armed.append(armed)

    @staticmethod
    def _check_k(k: int) -> int:
        if int(k) < 1:
            raise ValueError("k counts packets from 1 (the next packet processed)")
        return int(k)

    def _changed(self) -> None:
        hook = self._on_change
        if hook is not None:
            hook()
