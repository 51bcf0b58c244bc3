"""The packet processor of one AQL queue: a thread doing what the GPU's command processor does.

- It consumes packet ``n`` once the doorbell has been rung with a value >= n (the highest value
  ever rung counts: producers may ring out of order) and the slot's header
  is valid (read with an acquire load; an INVALID header means "not yet published": it waits, and
  re-checks on every doorbell ring). It blocks on the doorbell signal, never spins.
- In eager mode (fault injection) it ignores the doorbell and polls the header, taking the slot the
  moment the header turns valid, then re-reads it shortly after, and again when the packet
  completes or fails: a slot that changed after its header was valid (a header-before-body writer)
  fails the queue at that packet with HSA_STATUS_ERROR_INVALID_PACKET_FORMAT.
- Kernel dispatches run on the GPU's compute-unit pool, so dispatches without the barrier bit
  overlap; a packet with the barrier bit starts only when every earlier packet of the queue has
  completed. Barrier-AND/OR and barrier-value packets wait here, holding back later packets.
- The read index advances when the packet processor is done with a slot, as the command
  processor's does: a dispatch's slot is released (header reset to INVALID, read index past it)
  when the dispatch *launches*, a barrier packet's when its condition is met. A dispatch may
  therefore still run, and complete out of order, after its slot was reused; the read index says
  nothing about completion. A packet that fails before it launches stays readable at the read index.
- On completion: profiling timestamps into the completion signal's ``amd_signal_t``, then the
  completion signal is decremented, and only then does the packet count as complete (for the
  barrier bit and for error reporting), as the CP writes the signal when the packet completes.
- A queue error calls the queue's callback (status, hsa_queue_t*, data) from this thread once
  every earlier packet has completed, then suspends the queue for good: nothing later is
  processed or completed (later dispatches already launched are killed with the queue).
- A GPU memory fault is not a queue error: as with KFD and ROCr, every queue of the device is
  evicted (``evict``: nothing on it is processed or completes any more, no callback) and the
  system event handlers are told (``events.memory_fault``), from the thread that faulted.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .. import packets
from .. import types as T
from ._abi import StatusError, join_thread, now_ns
from .context import Context
from .dispatch import DispatchJob, Rejection, execute, prepare
from .faults import FaultRecord
from .memory import MemoryFault
from .queues import Queue
from .signals import Signal, Waiter, condition_met, wait_for
from .timeline import TimelineRecord

_BARRIER_NAMES = {packets.HSA_PACKET_TYPE_BARRIER_AND: "barrier_and",
                  packets.HSA_PACKET_TYPE_BARRIER_OR: "barrier_or"}


@dataclass(frozen=True)
class Failure:
    packet: int
    status: int
    detail: str = ""
    fault: MemoryFault | None = None


@dataclass(frozen=True)
class QueueErrorRecord:
    """A queue error as reported to the runtime, with the emulator's explanation."""

    agent: int
    queue: int
    packet: int
    status: int
    detail: str
    time_ns: int = field(default_factory=now_ns)


class PacketProcessor:
    def __init__(self, ctx: Context, queue: Queue) -> None:
        self.ctx, self.queue = ctx, queue
        self.gpu: int = queue.agent.gpu
        self.waiter = Waiter()
        self.suspended = False
        self.evicted = False
        self._lock = threading.Lock()
        self._failure: Failure | None = None
        self._stopping = False
        self._done: set[int] = set()  # completed packets at or above ``_completed``
        self._completed = 0  # every packet below it has completed
        self._snapshots: dict[int, bytes] = {}  # eager mode: the bytes consumed, per packet
        self._read = 0  # read index: slots below it were released (dispatches launched)
        self._running = 0  # dispatches of this queue on compute units right now
        self._idle = threading.Condition(self._lock)
        self._next = 0  # next packet id to consume
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"{ctx.name}-gpu{self.gpu}-q{queue.id}")

    # ---- control (any thread) --------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def request_stop(self) -> None:
        self._stopping = True
        self.waiter.wake()

    def join(self) -> None:
        join_thread(self.thread)

    def stop(self) -> None:
        """Stop processing and wait until no dispatch of this queue runs any more: after
        ``hsa_queue_destroy`` nothing of the queue touches memory or signals (on hardware its
        waves are killed; here they are waited for)."""
        self.request_stop()
        self.join()
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0, timeout=60)

    def wake(self) -> None:
        self.waiter.wake()

    def evict(self) -> None:
        """KFD evicted the queue (a memory fault on its device): it stops for good; nothing
        running or queued on it completes, and no queue error is reported."""
        with self._lock:
            self.evicted = True
        self.waiter.wake()

    def fail(self, packet: int, status: int, detail: str = "", fault: MemoryFault | None = None, *,
             replace: bool = False) -> None:
        """Packet ``packet`` failed: the queue errors out (the lowest failing packet wins;
        ``replace``: this cause supersedes an earlier one for the same packet). A memory fault
        (``fault``) instead evicts the device's queues and goes to the system event handlers
        (ROCr: Runtime::VMFaultHandler; the queue's callback is not called)."""
        if fault is not None:
            if not self.evicted:
                source = f"queue {self.queue.id} packet {packet}"
                self.ctx.events.memory_fault(self.queue.agent.handle, self.gpu, fault, source)
            return
        with self._lock:
            current = self._failure
            if not self.suspended and (current is None or packet < current.packet
                                       or (replace and packet == current.packet)):
                self._failure = Failure(packet, status, detail, fault)
        self.waiter.wake()

    # ---- main loop -------------------------------------------------------------------------
    def _run(self) -> None:
        self.queue.doorbell.add_waiter(self.waiter)
        try:
            while not self._stopping:
                if self.evicted:
                    wait_for(self.waiter, (), lambda: self._stopping)
                    return
                if self._failure is not None:
                    self._suspend()
                    return
                raw = self._take_next()
                if raw is not None:
                    self._process(self._next - 1, raw)
        except BaseException as exc:  # an emulator bug: fail the queue rather than hang the runtime
            self.ctx.report_bug(self.thread.name, exc)
            self.fail(self._read, T.HSA_STATUS_ERROR, f"emulator error: {exc!r}")
            if not self._stopping:
                self._suspend()
        finally:
            self.queue.doorbell.remove_waiter(self.waiter)

    def _interrupted(self) -> bool:
        return self._stopping or self.evicted or self._failure is not None

    def _take_next(self) -> bytes | None:
        """The next packet's 64 bytes once it may be consumed; None if interrupted or mode changed."""
        packet_id = self._next
        eager = self.ctx.faults.eager
        ready = self._wait_eager(packet_id) if eager else self._wait_doorbell(packet_id)
        if not ready:
            return None
        raw = self.queue.read_slot(packet_id)
        if eager:
            time.sleep(self.ctx.faults.eager_recheck_s)
            if self._torn(packet_id, raw):
                return None
            with self._lock:
                self._snapshots[packet_id] = raw
        self._next += 1
        return raw

    def _slot_published(self, packet_id: int) -> bool:
        # A slot a full ring ahead of the read index still holds an older packet.
        return packet_id < self._read + self.queue.size and self.queue.header_valid(packet_id)

    def _wait_doorbell(self, packet_id: int) -> bool:
        def ready() -> str | None:
            if self._interrupted():
                return "stop"
            if self.ctx.faults.eager:
                return "mode"
            # The doorbell's high-water mark: with several producers a lower id may be stored
            # after a higher one; like ROCr's monotonic legacy doorbell, the highest ring counts.
            rung = self.queue.doorbell.peak
            return "ready" if packet_id <= rung and self._slot_published(packet_id) else None

        return wait_for(self.waiter, (), ready) == "ready"

    def _wait_eager(self, packet_id: int) -> bool:
        faults = self.ctx.faults
        while not self._interrupted() and faults.eager:
            if self._slot_published(packet_id):
                return True
            time.sleep(faults.eager_poll_s)
        return False

    def _torn(self, packet_id: int, consumed: bytes | None = None) -> bool:
        """Eager mode: the slot must keep the bytes seen when its header was valid until the packet
        completes; if it changed, the writer wrote (part of) the body after the header."""
        if consumed is None:
            with self._lock:
                consumed = self._snapshots.pop(packet_id, None)
        if consumed is None or not self.queue.slot_changed(packet_id, consumed):
            return False
        detail = "torn packet: the slot changed after its header was valid (header written before body)"
        self.ctx.faults.record(FaultRecord("torn_packet", self.gpu, self.queue.id, packet_id, detail,
                                           T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT))
        self.fail(packet_id, T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT, detail, replace=True)
        return True

    # ---- packets ---------------------------------------------------------------------------
    def _process(self, packet_id: int, raw: bytes) -> None:
        header = int.from_bytes(raw[:2], "little")
        lost = False
        for record in self.ctx.faults.on_packet(self.gpu, self.queue.id, packet_id):
            if record.kind == "queue_error":
                self.fail(packet_id, record.status, record.detail)
                return
            if record.kind == "memory_fault":
                fault = MemoryFault(_fault_address(raw), "injected memory fault")
                self.fail(packet_id, T.HSA_STATUS_ERROR_MEMORY_FAULT, record.detail, fault)
                return
            lost = lost or record.kind == "lost_completion"
        if packets.header_barrier(header) and not self._wait_retired(packet_id):
            return
        kind = packets.header_type(header)
        if kind == packets.HSA_PACKET_TYPE_KERNEL_DISPATCH:
            self._dispatch(packet_id, raw, lost)
        elif kind in _BARRIER_NAMES:
            self._barrier(packet_id, raw, lost, kind)
        elif kind == packets.HSA_PACKET_TYPE_VENDOR_SPECIFIC:
            self._barrier_value(packet_id, raw, lost)
        else:
            self.fail(packet_id, T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT, f"packet type {kind} on a GPU queue")

    def _wait_retired(self, packet_id: int) -> bool:
        """Barrier bit: block until every earlier packet of the queue has completed."""
        wait_for(self.waiter, (), lambda: self._interrupted() or self._completed >= packet_id)
        return not self._interrupted()

    def _launch(self, packet_id: int) -> bool:
        """The CP is done with the slot: (eager) check it was not torn, reset its header to
        INVALID and advance the read index past it. False if the slot was torn."""
        if self._torn(packet_id):
            return False
        with self._lock:
            self._read = packet_id + 1
            self.queue.retire_slots(packet_id, packet_id + 1)
        self.waiter.wake()
        return True

    def _dispatch(self, packet_id: int, raw: bytes, lost: bool) -> None:
        pkt = packets.hsa_kernel_dispatch_packet_t.from_buffer_copy(raw)
        job = prepare(self.ctx, self.gpu, pkt)
        if isinstance(job, Rejection):
            self.fail(packet_id, job.status, job.detail, job.fault)
            return
        signal = pkt.completion_signal.handle
        if not self._launch(packet_id):
            return
        with self._lock:
            self._running += 1
        self.ctx.compute[self.gpu].submit(lambda: self._run_kernel(packet_id, job, signal, lost))

    def _run_kernel(self, packet_id: int, job: DispatchJob, signal: int, lost: bool) -> None:
        """On a compute-unit thread: the body, then completion (or the queue error)."""
        try:
            self._execute_kernel(packet_id, job, signal, lost)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def _execute_kernel(self, packet_id: int, job: DispatchJob, signal: int, lost: bool) -> None:
        start = now_ns()
        try:
            execute(self.ctx, job)
        except MemoryFault as fault:
            self.fail(packet_id, T.HSA_STATUS_ERROR_MEMORY_FAULT, f"kernel {job.kernel.name}", fault)
            return
        except Exception as exc:
            self.fail(packet_id, T.HSA_STATUS_ERROR_EXCEPTION, f"kernel {job.kernel.name} raised {exc!r}")
            return
        self._complete(packet_id, signal, start, lost, "dispatch", job.kernel.name, job.nbytes)

    def _barrier(self, packet_id: int, raw: bytes, lost: bool, kind: int) -> None:
        pkt = packets.hsa_barrier_and_packet_t.from_buffer_copy(raw)
        if pkt.reserved0 or pkt.reserved1 or pkt.reserved2:
            self.fail(packet_id, T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT, "reserved barrier field not zero")
            return
        deps = self._signals(packet_id, [d.handle for d in pkt.dep_signal if d.handle], "dependency")
        if deps is None:
            return
        need_all = kind == packets.HSA_PACKET_TYPE_BARRIER_AND
        start = now_ns()

        def satisfied() -> bool:
            zeros = [s.load() == 0 for s in deps]
            return all(zeros) if need_all else (any(zeros) or not deps)

        if self._block_on(packet_id, deps, satisfied) and self._launch(packet_id):
            self._complete(packet_id, pkt.completion_signal.handle, start, lost, "barrier", _BARRIER_NAMES[kind])

    def _barrier_value(self, packet_id: int, raw: bytes, lost: bool) -> None:
        pkt = packets.hsa_amd_barrier_value_packet_t.from_buffer_copy(raw)
        if pkt.header.AmdFormat != packets.HSA_AMD_PACKET_TYPE_BARRIER_VALUE:
            self.fail(packet_id, T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT, f"AMD vendor format {pkt.header.AmdFormat}")
            return
        reserved = (pkt.header.reserved, pkt.reserved0, pkt.reserved1, pkt.reserved2, pkt.reserved3)
        if any(reserved) or pkt.cond > T.HSA_SIGNAL_CONDITION_GTE:
            self.fail(packet_id, T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT, "bad barrier-value packet")
            return
        found = self._signals(packet_id, [pkt.signal.handle], "barrier-value")
        if found is None:
            return
        signal, cond, value, mask = found[0], pkt.cond, pkt.value, pkt.mask
        start = now_ns()
        if self._block_on(packet_id, found, lambda: condition_met(cond, signal.load() & mask, value)) \
                and self._launch(packet_id):
            self._complete(packet_id, pkt.completion_signal.handle, start, lost, "barrier", "barrier_value")

    def _signals(self, packet_id: int, handles: list[int], what: str) -> list[Signal] | None:
        """Signals a packet names; a handle that is no live signal is a memory fault."""
        found = []
        for handle in handles:
            signal = self.ctx.signals.lookup(handle)
            if signal is None:
                fault = MemoryFault(handle + 8, f"{what} signal 0x{handle:x} is not a live signal")
                self.fail(packet_id, T.HSA_STATUS_ERROR_MEMORY_FAULT, fault.reason, fault)
                return None
            found.append(signal)
        return found

    def _block_on(self, packet_id: int, signals: list[Signal], satisfied) -> bool:
        """Block (holding back later packets) until ``satisfied()``; False if interrupted."""
        def check() -> str | None:
            if self._interrupted():
                return "stop"
            if any(not s.alive for s in signals):
                return "dead"
            return "ok" if satisfied() else None

        result = wait_for(self.waiter, signals, check)
        if result == "dead":
            dead = next(s for s in signals if not s.alive)
            fault = MemoryFault(dead.address + 8, f"signal 0x{dead.address:x} destroyed while a packet waited on it")
            self.fail(packet_id, T.HSA_STATUS_ERROR_MEMORY_FAULT, fault.reason, fault)
        return result == "ok"

    # ---- completion and retirement (any thread) --------------------------------------------
    def _complete(self, packet_id: int, handle: int, start: int, lost: bool, kind: str, name: str,
                  nbytes: int = 0) -> None:
        delay = self.ctx.faults.completion_delay(self.gpu, self.queue.id, packet_id)
        if delay:
            time.sleep(delay)
        end = now_ns()
        failure = self._failure
        if self.evicted or (failure is not None and packet_id > failure.packet):
            return  # killed with its queue
        signal = self.ctx.signals.lookup(handle) if handle else None
        if handle and signal is None:
            fault = MemoryFault(handle + 8, f"completion signal 0x{handle:x} is not a live signal")
            self.fail(packet_id, T.HSA_STATUS_ERROR_MEMORY_FAULT, fault.reason, fault)
            return
        # The record, then the signal, then "complete": whoever sees the signal complete finds
        # the record, and whoever sees the packet complete sees its signal.
        self.ctx.timeline.add(TimelineRecord(self.gpu, self.queue.id, None, kind, name, nbytes, start, end,
                                             packet_id))
        if signal is not None:
            signal.set_timestamps(start, end)
            if not lost:
                _decrement(signal)
        self._mark_complete(packet_id)

    def _mark_complete(self, packet_id: int) -> None:
        with self._lock:
            self._done.add(packet_id)
            while self._completed in self._done:
                self._done.discard(self._completed)
                self._completed += 1
        self.waiter.wake()

    # ---- errors ----------------------------------------------------------------------------
    def _suspend(self) -> None:
        """Report the failure once earlier packets have completed, then stay suspended until stopped."""
        wait_for(self.waiter, (), lambda: self._stopping or self.evicted or self._completed >= self._failure.packet)
        if self._stopping or self.evicted:
            wait_for(self.waiter, (), lambda: self._stopping)
            return
        self._torn(self._failure.packet)  # a garbled packet fails as torn, not for its garbage
        with self._lock:
            self.suspended = True
            failure = self._failure
        self.ctx.queue_errors.append(QueueErrorRecord(self.gpu, self.queue.id, failure.packet,
                                                      failure.status, failure.detail))
        if self.queue.callback is not None:
            self.queue.callback(failure.status, self.queue.pointer, self.queue.data)
        wait_for(self.waiter, (), lambda: self._stopping)


def _decrement(signal: Signal) -> None:
    """Completion: subtract 1 (a signal destroyed meanwhile is the runtime's bug; nothing to do)."""
    try:
        signal.add(-1)
    except StatusError:
        pass


def _fault_address(raw: bytes) -> int:
    """Where an injected memory fault "happened": a dispatch's kernarg segment, else the slot."""
    if packets.header_type(int.from_bytes(raw[:2], "little")) == packets.HSA_PACKET_TYPE_KERNEL_DISPATCH:
        return packets.hsa_kernel_dispatch_packet_t.from_buffer_copy(raw).kernarg_address or 0
    return 0
