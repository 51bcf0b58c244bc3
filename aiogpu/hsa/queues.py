"""The AQL queue writer, its back-log and kernarg ring, and the choice of copy engine.

The writer keeps DESIGN.md's protocol:
1. space is checked (write - read + n <= size) *before* slots are reserved by an atomic add to the
   write index, so a ring is never overrun;
2. every packet body (bytes 4..63) is written first, then each header word
   (``header | setup << 16``) is published by one aligned 32-bit release store, in order;
3. the doorbell gets the index of the last published packet (release store);
4. every reserved slot is published, even when writing fails (a no-op barrier packet);
5. more than five dependencies are chained over several barrier-AND packets.
A group that does not fit waits in a per-queue back-log, drained as packets retire and when the
queue's own room marks complete (see ``AqlQueue._mark_for_room``); the event loop never blocks on
a full ring. A group longer than the ring goes in parts (see ``AqlQueue.submit``);
a group that cannot be written fails its futures instead of raising, so that the waiter thread,
which drains back-logs, never dies of it.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import struct
import weakref
from collections import deque
from typing import Any, Callable

from ..errors import DeviceLost, GPUError
from ..hsa_bindings import atomics
from ..hsa_bindings import packets as P
from ..hsa_bindings import types as T
from ..futures import GPUFuture
from .signals import CompletionHub, has_interrupt_event

DEFAULT_RING = 1024
KERNARG_RING_BYTES = 256 << 10
BODY_OFFSET = 4  # bytes 0..3 are the header word, published last
KERNARG_ADDRESS_OFFSET = P.hsa_kernel_dispatch_packet_t.kernarg_address.offset
COMPLETION_SIGNAL_OFFSET = P.hsa_barrier_and_packet_t.completion_signal.offset
ROOM_SIGNALS = 2   # a queue's own signals for room marks (one pending, one whose event is on its way)
# Packets of ROCr's copy queues a device's unretired copies may take (see CopyEngines): ROCr's
# blit-kernel queue has 64 slots at least (GpuAgent::CreateInterceptibleQueue: minAqlSize_).
ROCR_COPY_ROOM = 48


class PacketGroup:
    """Packets that go into one queue back to back (barriers, then the work), as raw bytes.

    ``blob`` holds ``n`` 64-byte packets whose header words are ignored; ``headers`` are the
    words (``header | setup << 16``) published after every body. ``future`` completes with the
    last packet; ``marks`` are further futures completed by packet ``i`` of the group (graph
    nodes). ``kernargs`` maps a dispatch packet's index to argument bytes placed in the queue's
    kernarg ring at publication. A ``part`` (of a group longer than the ring) ends with a room
    mark and names the group's future without completing it.
    """

    __slots__ = ("blob", "headers", "future", "marks", "kernargs", "kernarg_align", "part")

    def __init__(self, packets: list, headers: list[int], future: GPUFuture, kernarg: bytes = b"", *,
                 blob: bytearray | None = None, marks: list | None = None, kernargs: dict | None = None,
                 kernarg_align: int = 16, part: bool = False):
        self.part = part
        self.blob = blob if blob is not None else bytearray(b"".join(bytes(p) for p in packets))
        self.headers = headers
        self.future = future
        self.marks = marks or []
        self.kernargs = kernargs if kernargs is not None else ({len(headers) - 1: kernarg} if kernarg else {})
        self.kernarg_align = kernarg_align   # the largest kernarg_segment_align of its kernels

    def __len__(self) -> int:
        return len(self.headers)


def barrier_and_packets(signals: list[int], completion: int = 0, *, barrier: bool = False) -> list[tuple]:
    """Barrier-AND packets waiting on every signal, chained five at a time."""
    out = []
    chunks = [signals[i:i + P.BARRIER_MAX_DEPS] for i in range(0, len(signals), P.BARRIER_MAX_DEPS)] or [[]]
    for i, chunk in enumerate(chunks):
        pkt = P.hsa_barrier_and_packet_t()
        for j, handle in enumerate(chunk):
            pkt.dep_signal[j].handle = handle
        if i == len(chunks) - 1:
            pkt.completion_signal.handle = completion
        header = P.make_header(P.HSA_PACKET_TYPE_BARRIER_AND, barrier=barrier and i == 0)
        out.append((pkt, header))
    return out


def noop_header() -> int:
    return P.make_header(P.HSA_PACKET_TYPE_BARRIER_AND, acquire=P.HSA_FENCE_SCOPE_NONE,
                         release=P.HSA_FENCE_SCOPE_NONE)


class KernargRing:
    """Kernel-argument memory for one queue, handed out in FIFO order and reused only after the
    packet that reads it has retired (``free`` may come out of order; the tail advances over the
    freed prefix)."""

    ALIGN = 64

    def __init__(self, base: int, size: int):
        self.base, self.size = base, size
        self._head = 0    # next free offset (monotonic, modulo size)
        self._tail = 0    # oldest offset still in use
        self._live: deque[list] = deque()  # [start, end, freed]

    def alloc(self, nbytes: int, align: int = ALIGN) -> tuple[int, list] | None:
        """(address, entry) of ``nbytes`` aligned to ``align`` (at least ALIGN; the kernel's
        kernarg_segment_align), or None while the ring is full."""
        align = max(align, self.ALIGN)
        n = (nbytes + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        if n > self.size:
            raise ValueError(f"kernel arguments of {nbytes} bytes exceed the kernarg ring ({self.size})")
        start = (self._head + align - 1) // align * align
        if start % self.size + n > self.size:   # do not wrap inside an allocation
            start += self.size - start % self.size
        if start + n - self._tail > self.size:
            return None
        entry = [start, start + n, False]
        self._live.append(entry)
        self._head = start + n
        return self.base + start % self.size, entry

    def free(self, entry: list) -> None:
        entry[2] = True
        while self._live and self._live[0][2]:
            self._live.popleft()
        self._tail = self._live[0][0] if self._live else self._head

    @property
    def in_use(self) -> int:
        return len(self._live)


class AqlQueue:
    """One user-mode AQL queue of a device, safe for any number of producers.

    Producers (tasks on any loop, plain threads) submit under the runtime lock, so packet groups
    never interleave. When the queue reports an error, every operation on it fails with a
    GPUError naming the queue, the packet and the HSA status; the HSA queue is destroyed and a new
    one takes its place, so the device stays usable.
    """

    def __init__(self, api: Any, hub: CompletionHub, agent: Any, name: str, *, size: int = DEFAULT_RING,
                 kernarg: KernargRing | None = None):
        self.api, self.hub, self.agent, self.name = api, hub, agent, name
        self.size = size
        self.kernarg = kernarg
        self.backlog: deque[PacketGroup] = deque()
        self.inflight: dict[GPUFuture, tuple[int, int]] = {}
        self.generation = 0
        self.errors: list[str] = []    # what failed it, newest last (text: no traceback cycles)
        self.published = 0
        self.lost: GPUError | None = None   # the device is lost: no HSA queue, nothing accepted
        self._draining = False         # drain() is running (a failed group may retire inside it)
        self._unsent: list[tuple] = []     # the failure report of groups that could not be published
        self._kernargs: dict[Any, list] = {}   # a group's (or part's) kernarg entries, until it retires
        # Room marks in flight, by token: (signal, generation, kernarg entries, group future or
        # None, packet span); the queue's free room signals; whether the back-log's head last
        # waited for kernarg space (then the next mark waits for completions: see _mark_for_room).
        self._marks: dict[int, tuple] = {}
        self._room_signals: list[int] = []
        self._short_of_kernargs = False
        self._callback = T.queue_error_callback_t(self._on_error_from_driver)
        self._create()
        try:
            for _ in range(ROOM_SIGNALS):
                self._room_signals.append(self._new_room_signal())
        except BaseException:
            self.destroy()
            raise

    # -- lifecycle -----------------------------------------------------------------------------
    def ring_size(self, requested: int) -> int:
        """``requested`` rounded up to a power of two and clamped to the agent's
        [QUEUE_MIN_SIZE, QUEUE_MAX_SIZE] (ROCr rejects anything else: 64 <= size <= 0x20000),
        and at least 2 (a packet and a room mark: see ``_mark_for_room``)."""
        low, high = ctypes.c_uint32(0), ctypes.c_uint32(0)
        self.api.hsa_agent_get_info(self.agent, T.HSA_AGENT_INFO_QUEUE_MIN_SIZE, ctypes.byref(low))
        self.api.hsa_agent_get_info(self.agent, T.HSA_AGENT_INFO_QUEUE_MAX_SIZE, ctypes.byref(high))
        size = 1 << max(int(requested) - 1, 0).bit_length()
        return min(max(size, low.value or 1, 2), high.value or size)

    def _create(self) -> None:
        self.size = self.ring_size(self.size)
        qp = ctypes.POINTER(T.hsa_queue_t)()
        self.api.check(self.api.hsa_queue_create(self.agent, self.size, T.HSA_QUEUE_TYPE_MULTI, self._callback,
                                                 None, 0xFFFFFFFF, 0xFFFFFFFF, ctypes.byref(qp)),
                       f"hsa_queue_create({self.name})")
        self.api.hsa_amd_queue_set_priority(qp, T.HSA_AMD_QUEUE_PRIORITY_NORMAL)
        self._q = qp
        self.id = qp.contents.id
        self.ring = qp.contents.base_address
        self.doorbell = T.hsa_signal_t(qp.contents.doorbell_signal.handle)
        self.size = qp.contents.size
        self.broken = False

    def _new_room_signal(self) -> int:
        """An interrupt signal for room marks: ROCr runs asynchronous handlers only on those."""
        sig = T.hsa_signal_t()
        self.api.check(self.api.hsa_signal_create(1, 0, None, ctypes.byref(sig)), f"hsa_signal_create({self.name})")
        if not has_interrupt_event(sig.handle):
            self.api.hsa_signal_destroy(sig)
            raise GPUError(f"queue {self.name}: KFD has no signal event left for its room marks", queue=self.name)
        return sig.handle

    def destroy(self) -> None:
        """Destroy the HSA queue and the queue's room signals (ROCr drops a destroyed signal's
        handler without calling it)."""
        self._destroy_queue()
        signals = [*self._room_signals, *(entry[0] for entry in self._marks.values())]
        for token in self._marks:
            _ROOM_QUEUES.pop(token, None)
        self._room_signals, self._marks = [], {}
        for handle in signals:
            self.api.hsa_signal_destroy(T.hsa_signal_t(handle))

    def _destroy_queue(self) -> None:
        if self._q:
            self.api.hsa_queue_destroy(self._q)
            self._q = None

    # -- submission ----------------------------------------------------------------------------
    def submit(self, group: PacketGroup, *, refuse: bool = False) -> None:
        """Publish ``group`` now if the ring has room and nothing waits before it, else park it
        in the back-log. Never blocks: a group longer than the ring goes in parts that each
        fit it, and a group that cannot be written has its futures reported failed (a failure
        report, settled by the waiter). With ``refuse`` (an operation being encoded), a group
        of one part that cannot be written raises that GPUError instead: nothing of it runs,
        and the core fails the operation. Call under the runtime lock."""
        group.future.queue = self.name
        parts = self._parts(group)
        refuse = refuse and len(parts) == 1
        for part in parts:
            if self.backlog or not self._publish(part, refuse):
                self.backlog.append(part)
        self._mark_for_room()

    def drain(self) -> None:
        """Publish back-logged groups while they fit (after packets retired, or a room mark
        completed; under lock)."""
        if self._draining:     # a group failed inside this drain retired: the loop goes on
            return
        self._draining = True
        try:
            while self.backlog and not self.broken and self._publish(self.backlog[0]):
                self.backlog.popleft()
        finally:
            self._draining = False
        self._mark_for_room()

    # -- room marks: how a back-log learns that the ring has room --------------------------------
    # A back-logged group waits for ring slots, or kernarg space, that in-flight work holds. The
    # queue learns when they come free without anyone waiting on that work's futures: it ends
    # what it has published with a *room mark*, a barrier-AND packet whose completion signal is
    # the queue's own, with a ROCr asynchronous handler on it (hsa_amd_signal_async_handler:
    # Runtime::SetAsyncSignalHandler; the handler runs on ROCr's events thread and only posts
    # an event to the waiter). Without the barrier bit the mark completes once the packet
    # processor has reached it, when every slot before it is free; with it (the back-log
    # waits for kernarg space, freed as work retires) once all work before it has completed, so
    # that the waiter's scan after the event retires that work. A part of a group longer than
    # the ring ends with a mark of its own, with the barrier bit: its completion frees the
    # part's kernel arguments. Normal groups leave one slot free, so a mark always fits.
    def _mark_for_room(self) -> None:
        """While groups wait in the back-log, make sure a room mark is on its way (under lock)."""
        if not self.backlog or self._marks or self.broken or not self._room_signals:
            return     # (a pending mark's event drains again: marks in use mean one is pending)
        if not self.has_room(1):   # (never: groups leave its slot; rule 1 holds even so)
            return
        packets = barrier_and_packets([], 0, barrier=self._short_of_kernargs)
        blob = bytearray(bytes(packets[0][0]))
        try:
            self._write_marked(blob, [packets[0][1]])
        except Exception as exc:  # noqa: BLE001 - nothing would drain the back-log: start afresh
            err = GPUError(f"queue {self.name}: could not publish a room mark: {exc}", queue=self.name)
            err.__cause__ = exc
            self._post_failed(self.abort(err))

    def _write_marked(self, blob: bytearray, headers: list[int], part: PacketGroup | None = None) -> None:
        """Publish ``blob`` (whose last packet is a barrier: a room mark, or the end of
        ``part``) with one of the queue's room signals as the last packet's completion signal
        and the handler on it (under lock; room checked by the caller, a room signal free). A
        part's kernel arguments (placed) are freed when its mark completes."""
        main, kernargs = (part.future, self._kernargs.pop(part, [])) if part is not None else (None, [])
        signal = self._room_signals.pop()
        try:
            self.api.hsa_signal_store_screlease(T.hsa_signal_t(signal), 1)
            token = next(_TOKENS)
            struct.pack_into("<Q", blob, len(blob) - P.PACKET_SIZE + COMPLETION_SIGNAL_OFFSET, signal)
            self.api.check(self.api.hsa_amd_signal_async_handler(
                T.hsa_signal_t(signal), T.HSA_SIGNAL_CONDITION_LT, 1, _ROOM_HANDLER, token),
                f"hsa_amd_signal_async_handler({self.name})")
        except BaseException:
            self._room_signals.append(signal)
            self._free_kernargs(kernargs)
            raise
        # Registered: from here the handler's event returns the signal (``_room_event``).
        _ROOM_QUEUES[token] = self
        self._marks[token] = (signal, self.generation, [], main, None)
        try:
            first = self._write(blob, headers)
        except BaseException:
            self._free_kernargs(kernargs)
            self.api.hsa_signal_store_screlease(T.hsa_signal_t(signal), 0)   # no-ops: fire it now
            raise
        self._marks[token] = (signal, self.generation, kernargs, main, (first, first + len(headers) - 1))
        if part is not None:
            self._record_marks(part, first)

    def _room_event(self, token: int) -> None:
        """The waiter's event for a completed room mark: its signal and kernel arguments are
        free again; publish what now fits."""
        with self.hub.lock:
            entry = self._marks.pop(token, None)
            if entry is None:
                return
            self._room_signals.append(entry[0])
            self._free_kernargs(entry[2])
            self.drain()

    def _publish(self, group: PacketGroup, refuse: bool = False) -> bool:
        """``_try_publish``, except that a group that cannot be written (an unexpected error;
        the waiter thread may be the caller) is reported failed, or with ``refuse`` raises
        the GPUError: True when it is done with."""
        if self.lost is not None:      # the device is lost: nothing of it runs any more
            err: GPUError = DeviceLost(f"{group.future.label}: {self.lost}", status=self.lost.status,
                                       queue=self.name)
            err.__cause__ = self.lost
        else:
            try:
                return self._try_publish(group)
            except Exception as exc:  # noqa: BLE001 - becomes the failure of the work concerned
                err = GPUError(f"{group.future.label}: could not be queued on {self.name}: {exc}",
                               queue=self.name)
                err.__cause__ = exc
        if refuse:
            raise err
        self._report(err, group, runs=group.part)
        return True

    def _report(self, err: GPUError, group: PacketGroup, *, runs: bool) -> None:
        """Report ``group``'s futures failed with ``err``: none of its packets runs (no-ops at
        most), except that a part's group future (``runs``) still completes with the group's
        last part. To the core through the waiter (the caller may be an encode, or the waiter
        retiring what made room)."""
        self._post_failed([(group.future, err, runs), *((f, err, False) for f, _ in group.marks)])

    def _post_failed(self, failed: list) -> None:
        """Hand ``failed`` (a failure report) to the core through the waiter (``_report_unsent``,
        posted once for what gathers before it runs)."""
        if not self._unsent:
            self.hub.post_event(self._report_unsent)
        self._unsent += failed

    def _report_unsent(self) -> list:
        """The failure report of the groups ``_publish`` could not publish (a waiter event)."""
        with self.hub.lock:
            failed, self._unsent = self._unsent, []
        return failed

    def _parts(self, group: PacketGroup) -> list[PacketGroup]:
        """``group`` as parts that each fit the ring, in order. Each part but the last ends with
        a room mark with the barrier bit (see above): when it completes, the whole part has, so
        the next part finds the ring empty and the part's kernel arguments are freed. Packet
        order, and so every barrier bit's meaning, is that of the whole group; each part names
        the group's future, which completes with the last one."""
        n, step = len(group), self.size - 1
        if n <= step:
            return [group]
        parts, size = [], P.PACKET_SIZE
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            blob, headers = bytearray(group.blob[lo * size:hi * size]), group.headers[lo:hi]
            if hi < n:
                pkt, header = barrier_and_packets([], 0, barrier=True)[0]
                blob += bytes(pkt)
                headers = [*headers, header]
            marks = [(f, i - lo) for f, i in group.marks if lo <= i < hi]
            kernargs = {i - lo: data for i, data in group.kernargs.items() if lo <= i < hi}
            parts.append(PacketGroup([], headers, group.future, blob=blob, marks=marks, kernargs=kernargs,
                                     kernarg_align=group.kernarg_align, part=hi < n))
        return parts

    def holds(self, fut: GPUFuture) -> bool:
        """Whether ``fut``'s packets are in this HSA queue, published and not retired, so that a
        later packet's barrier bit orders after them. False for work of an earlier HSA queue
        under the same name: ``abort`` destroyed that one and, while such work waits to retire
        after its predecessors (``FutureHub.retire_failed``), only its signal says when it has.
        (Back-logged work is waited for by its signal too: correct, if not the cheapest.)"""
        return fut in self.inflight

    def has_room(self, n: int) -> bool:
        write = self.api.hsa_queue_load_write_index_relaxed(self._q)
        read = self.api.hsa_queue_load_read_index_scacquire(self._q)
        return write - read + n <= self.size

    def _try_publish(self, group: PacketGroup) -> bool:
        n = len(group)
        if n > self.size:
            raise ValueError(f"{n} packets cannot fit a ring of {self.size}")
        if n == 0:
            return True
        # A part ends with a room mark of its own; any other group leaves a slot for one.
        if self.broken or not self.has_room(n if group.part else n + 1):
            return False
        if group.part and not self._room_signals:
            return False           # (all in use: their marks' events drain again)
        if group.kernargs and not self._place_kernargs(group):
            self._short_of_kernargs = True
            return False
        self._short_of_kernargs = False
        if group.part:
            self._write_marked(group.blob, group.headers, group)
            return True
        try:
            first = self._write(group.blob, group.headers)
        except BaseException:
            self._free_kernargs(self._kernargs.pop(group.future, ()))
            raise
        self.inflight[group.future] = (first, first + n - 1)
        group.future.packet = first + n - 1
        self._record_marks(group, first)
        return True

    def _record_marks(self, group: PacketGroup, first: int) -> None:
        for fut, i in group.marks:
            self.inflight[fut] = (first, first + i)
            fut.packet, fut.queue = first + i, self.name

    def _write(self, blob: bytearray, headers: list[int]) -> int:
        """Reserve, write and publish the packets (rules 1-4; room checked by the caller): the
        index of the first."""
        n = len(headers)
        first = self.api.hsa_queue_add_write_index_scacq_screl(self._q, n)
        try:
            self._write_bodies(first, blob, n)
            self._publish_headers(first, headers)
        except BaseException:
            self._publish_noops(first, n)  # rule 4: a reserved slot is never left unpublished
            raise
        finally:
            self.api.hsa_signal_store_screlease(self.doorbell, first + n - 1)
        self.published += n
        return first

    def _place_kernargs(self, group: PacketGroup) -> bool:
        """Copy kernel arguments into the ring (all or none); freed when the group retires
        (``retired``; a part's when its room mark completes), before the back-log drains."""
        placed = []
        try:
            for index, data in group.kernargs.items():
                got = self.kernarg.alloc(len(data), group.kernarg_align)
                if got is None:
                    break
                address, entry = got
                placed.append(entry)
                ctypes.memmove(address, data, len(data))
                struct.pack_into("<Q", group.blob, index * P.PACKET_SIZE + KERNARG_ADDRESS_OFFSET, address)
            else:
                self._kernargs[group if group.part else group.future], placed = placed, []
                return True
            return False
        finally:
            for entry in placed:       # not placed as a whole (no room, or an error)
                self.kernarg.free(entry)

    def _slot(self, index: int) -> int:
        return self.ring + (index % self.size) * P.PACKET_SIZE

    def _write_bodies(self, first: int, blob: bytearray, n: int) -> None:
        src = (ctypes.c_char * len(blob)).from_buffer(blob)
        base = ctypes.addressof(src)
        for i in range(n):
            ctypes.memmove(self._slot(first + i) + BODY_OFFSET, base + i * P.PACKET_SIZE + BODY_OFFSET,
                           P.PACKET_SIZE - BODY_OFFSET)

    def _publish_headers(self, first: int, headers: list[int]) -> None:
        for i, word in enumerate(headers):
            atomics.store_u32_release(self._slot(first + i), word)

    def _publish_noops(self, first: int, n: int) -> None:
        empty = P.hsa_barrier_and_packet_t()
        for i in range(n):
            ctypes.memmove(self._slot(first + i) + BODY_OFFSET, ctypes.addressof(empty) + BODY_OFFSET,
                           P.PACKET_SIZE - BODY_OFFSET)
            atomics.store_u32_release(self._slot(first + i), noop_header())

    def retired(self, fut: GPUFuture) -> None:
        """``fut``'s packets retired, or were never queued (under lock): forget them, free
        their kernel arguments, and publish what now fits (which may be waiting for exactly
        that room)."""
        self.inflight.pop(fut, None)
        self._free_kernargs(self._kernargs.pop(fut, ()))
        self.drain()

    def _free_kernargs(self, entries: Any) -> None:
        for entry in entries:
            self.kernarg.free(entry)

    # -- errors --------------------------------------------------------------------------------
    def _on_error_from_driver(self, status: int, _queue: Any, _data: Any) -> None:
        # Runs on a driver thread: record and hand over to the waiter thread, nothing more.
        generation = self.generation
        self.hub.post_event(lambda: self._on_error(status, generation))

    def _on_error(self, status: int, generation: int) -> list | None:
        """The waiter's event for a queue error: the abort's failure report."""
        with self.hub.lock:
            if generation != self.generation or self._q is None:
                return None
            err = GPUError(f"queue {self.name} failed: {T.status_name(status)}", status=status, queue=self.name)
            # HSA's callback carries a status only; the emulator can say what happened.
            emulator = self.api.emulator
            if emulator is not None:
                err.__cause__ = emulator.queue_error_cause(self.id)
            return self.abort(err, None)

    def abort(self, err: GPUError, failed_at: int | None = None, *, lost: GPUError | None = None) -> list:
        """Destroy the HSA queue and replace it (under lock); the failure report of every
        operation it held (``aiogpu/backend.py``), for the core to settle. With ``lost`` (the
        device is lost: a new queue would never run) it is not replaced, and every group
        submitted later fails with ``lost``.

        An operation whose completion signal already reads complete completed before the error
        and completes normally. Of the others, one is blamed with ``err``'s status: the one whose
        packets include ``failed_at`` when given (the watchdog names the silent packet), else the
        oldest one not complete. The read index is not used: it advances as packets launch, so
        several later packets may be past it when one fails. The rest fail with an error saying
        the queue failed before they completed (or before they were submitted). Once the queue is
        destroyed none of its packets can run, so everything they held is freed once the core
        has retired them. Work submitted to this queue while the abort runs (by a done-callback
        of work that completed before the error) runs on the new queue.
        """
        self.broken = True
        # A part in flight stands for its group's future (the group's later parts are parked).
        spans = dict(self.inflight)
        for _signal, generation, _kernargs, main, span in self._marks.values():
            if main is not None and span is not None and generation == self.generation:
                first, last = spans.get(main, span)
                spans[main] = (min(first, span[0]), max(last, span[1]))
        victims = sorted(spans.items(), key=lambda v: v[1][0])
        parked = list(self.backlog)
        self.backlog.clear()
        self.inflight.clear()
        self._destroy_queue()       # no packet of it can run any more
        # Nor will its room marks complete: fire their handlers (each event frees its signal).
        for signal, generation, *_ in self._marks.values():
            if generation == self.generation:
                self.api.hsa_signal_store_screlease(T.hsa_signal_t(signal), 0)
        self.generation += 1
        self.errors.append(str(err))
        self.hub.settle_completed([f for f, _ in victims])   # completed before the error: not failed
        pending = [(f, span) for f, span in victims if not f.retired]   # failed ones included
        blamed = self._blame(pending, failed_at)
        why = T.status_name(err.status) if err.status is not None else type(err).__name__
        kind = DeviceLost if lost is not None else GPUError
        failed = []
        for fut, (first, last) in pending:
            if blamed is not None and fut is blamed[0]:
                exc = err if failed_at is not None else _caused_by(err.__cause__ or err, GPUError(
                    f"{fut.label}: queue {self.name} failed at packet {last}: {why}", status=err.status,
                    queue=self.name, packet=last))
            elif blamed is not None:
                exc = _caused_by(err, GPUError(
                    f"{fut.label}: queue {self.name} failed at packet {blamed[1][1]} ({why}) before it "
                    f"completed", status=err.status, queue=self.name, packet=last))
            else:
                exc = _caused_by(err.__cause__ or err, kind(
                    f"{fut.label}: {err}", status=err.status, queue=self.name, packet=last))
            failed.append((fut, exc, False))
        # A parked group's marks (graph nodes whose completions other lanes, engines and
        # devices wait for) fail with it: none of its packets will be published.
        for fut in dict.fromkeys(f for g in parked for f in (g.future, *(m for m, _ in g.marks))
                                 if f not in spans):
            failed.append((fut, _caused_by(err, kind(
                f"{fut.label}: queue {self.name} failed ({why}) before it was submitted",
                status=err.status, queue=self.name)), False))
        if lost is not None:
            self.lost = lost
            return failed
        self._create()
        # Work submitted meanwhile (by a done-callback of work settled as completed above) was
        # parked while the queue was broken; no retirement on the new queue would drain it.
        self.drain()
        return failed

    @staticmethod
    def _blame(pending: list, failed_at: int | None) -> tuple | None:
        """The (future, span) to blame: the one whose packets include ``failed_at``, or without
        it the oldest not yet settled (one failed already, by a dependency, is not the cause)."""
        if failed_at is None:
            return next(((f, span) for f, span in pending if not f.done()), None)
        return next(((f, span) for f, span in pending if span[0] <= failed_at <= span[1]), None)

    def __repr__(self) -> str:
        return f"<AqlQueue {self.name} size={self.size} backlog={len(self.backlog)}>"


# The room marks' handler: one C callback for every queue, alive as long as the process, since
# ROCr's events thread may still be calling it for a mark whose queue is being destroyed; it
# finds the queue by the mark's token (a weak reference: a queue gone has nothing to drain).
_TOKENS = itertools.count(1)
_ROOM_QUEUES: "weakref.WeakValueDictionary[int, AqlQueue]" = weakref.WeakValueDictionary()


def _on_room_from_driver(_value: int, token: int | None) -> bool:
    # ROCr's events thread: hand over to the waiter, nothing more; one-shot (False).
    queue = _ROOM_QUEUES.pop(token, None)
    if queue is not None:
        try:
            queue.hub.post_event(functools.partial(queue._room_event, token))
        except Exception:  # noqa: BLE001 - the runtime is closing: nothing left to drain
            pass
    return False


_ROOM_HANDLER = T.signal_handler_t(_on_room_from_driver)


def _caused_by(cause: BaseException, err: GPUError) -> GPUError:
    """``err`` with ``cause`` as its ``__cause__`` (a queue-mate's failure names the queue's)."""
    err.__cause__ = cause
    return err


ROCR_CHOICE = 0   # "engine" of a copy whose blit ROCr picks: hsa_amd_memory_async_copy


class CopyEngines:
    """The copy engines of one device: how a copy this device runs reaches ROCr's SDMA queues.

    The core's direction rule already made this device the one ROCr copies with: the source GPU,
    the destination for host-to-device (ROCr: ``Runtime::CopyMemory``, ``copy_agent = src_gpu ?
    src_agent : dst_agent``). Two libraries:

    **ROCr 5.2.3** (no ``hsa_amd_memory_async_copy_on_engine`` nor
    ``hsa_amd_memory_copy_engine_status``): ``pick`` answers ``ROCR_CHOICE`` for any copy between
    two agents and ``submit`` calls ``hsa_amd_memory_async_copy`` with the copy's real agents.
    ROCr then runs it on the copy agent's blit for that direction (``GpuAgent::DmaCopy`` ->
    ``GetBlitObject``: host-to-device, device-to-host (also PCIe peer copies), or an xGMI peer
    blit), an SDMA queue created at first use, or, when it could not create one (none left in
    KFD, SDMA disabled), a blit kernel on its own queue of that agent (``GpuAgent::InitDma``'s
    blit_lambda falls back to ``CreateBlitKernel``); a busy blit takes the copy behind its work.
    Only a copy within one device (ROCr's device-to-device blit is a blit kernel too, so aiogpu's
    own copy kernel on its compute lane does the same work with no cross-queue wait) and the
    copy call's OUT_OF_RESOURCES (ROCr could create no blit at all) leave a shader copy.

    **ROCm 5.7 and later**: ``hsa_amd_memory_copy_engine_status`` answers per direction (ROCr:
    GpuAgent::DmaCopyStatus): which engines may serve it (xGMI peers only xGMI engines; on
    gfx90a engine 0 host-to-device only) and which of those are free; INVALID_AGENT for a copy
    within one agent, OUT_OF_RESOURCES when none is free. An engine never used is reported free
    even if ROCr cannot create its SDMA queue; ROCr then runs that engine's copies as blit
    kernels and succeeds, and, once used, such an engine is never reported free again. So:

    - an engine reported free for a direction is used for it (round-robin over the free ones);
    - with none free, the copy queues behind a busy engine that was reported free for this
      direction *after* it had been used (so it is a real SDMA queue), if there is one;
    - otherwise (never reported free after use: busy or a blit kernel; a copy within one
      device) ``pick`` returns None and the caller runs a shader copy. The copy call's own
      OUT_OF_RESOURCES (ROCr cannot even create its blit kernel) also makes ``submit`` return
      None, and so does INVALID_ARGUMENT for an engine the status reported: ROCr's status and
      copy checks disagree in one corner (a single-engine gfx90a reports its device-to-host
      queue as engine 0, which the copy then refuses), so the engine is dropped for that
      direction, and every later copy given it (a graph chose it at instantiation) is a shader
      copy without asking again.

    **Room in ROCr's queues.** ``hsa_amd_memory_async_copy`` never fails for a full queue: it
    spins until its queue has room (``BlitKernel::AcquireWriteIndex``; the blit-kernel queue
    ROCr falls back to is one small utility AQL queue per agent, ``GpuAgent::InitDma``). It is
    called under the runtime lock. While no aiogpu queue has a back-log, every dependency of a
    copy is published, so the device frees ROCr's queue on its own and a spin ends. Once some
    queue has one, a copy may wait on the device for back-logged work that only the waiter,
    taking that lock, publishes: a full ROCr queue would spin for good. So, while any queue of
    the runtime has a back-log (``crowded``, asked only past the room or for a copy without a
    ring of its own, below), a device takes no more than ``ROCR_COPY_ROOM``
    packets of ROCr's queues with its unretired copies (a copy counts 2 packets plus a barrier
    packet per five dependencies, as ROCr writes it); past that ``submit`` answers None and the
    copy is a shader copy on an aiogpu queue, whose back-log never blocks.

    **ROCr's utility queue.** Loading a kernel (``hsa_executable_freeze``, under the runtime
    lock) copies its code with a blit kernel on the device's utility queue and waits for it.
    Without SDMA queues, ROCr's device-to-host and peer blits are blit kernels on that very
    queue, so a load would wait behind a copy there that waits for back-logged work, and never
    finish. While crowded, then, only copies on a ring of their own go to ROCr (``_own_ring``:
    a proven SDMA engine, or ROCr's host-to-device blit); the others are shader copies.
    """

    def __init__(self, api: Any, agent: Any, name: str, crowded: Callable[[], bool]):
        self.api, self.agent, self.name = api, agent, name
        self._crowded = crowded                            # any queue of the runtime back-logged
        self._next = 0
        self.seen: dict[tuple[int, int], set[int]] = {}   # direction -> engines reported free for it
        self.used: set[int] = set()                        # engines this device submitted to
        self.proven: set[int] = set()                      # reported free after use: SDMA queues
        self.refused: set[tuple[int, int, int]] = set()    # (direction, engine) the copy call refused
        self.lost = False                                  # evicted after a memory fault: never again
        self.counts: dict[str, int] = {}                   # copies submitted, by engine name
        self.room_in_use = 0                               # ROCr queue packets of unretired copies

    @property
    def rocr_picks(self) -> bool:
        """True on a library without the engine calls (ROCr 5.2.3): ROCr picks each copy's blit."""
        return not self.api.has_engine_copy

    def runs(self, queue: str | None) -> bool:
        """Whether ``queue`` (a future's ``queue``) names one of these engines."""
        return queue is not None and queue.startswith((f"{self.name}.sdma", f"{self.name}.rocr-"))

    def lose(self) -> None:
        """The device faulted and KFD evicted its SDMA queues; ROCr never recreates them (it
        may still report them free), so every later copy of this device is a shader copy."""
        self.lost = True

    def free_engines(self, dst_agent: Any, src_agent: Any) -> list[int]:
        """Engine-id bits ROCr reports free for this direction ([] for none, an error, or a
        library without the call)."""
        if not self.api.has_engine_copy:
            return []
        mask = ctypes.c_uint32(0)
        status = self.api.hsa_amd_memory_copy_engine_status(dst_agent, src_agent, ctypes.byref(mask))
        return T.sdma_engine_bits(mask.value) if status == T.HSA_STATUS_SUCCESS else []

    def may_take(self, dst_agent: Any, src_agent: Any) -> bool:
        """Whether ``pick`` would answer an engine now (no side effects: nothing is chosen)."""
        if self.lost:
            return False
        if self.rocr_picks:
            return dst_agent.handle != src_agent.handle
        direction = (dst_agent.handle, src_agent.handle)
        if any((*direction, e) not in self.refused for e in self.free_engines(dst_agent, src_agent)):
            return True
        return any(e in self.proven for e in self.seen.get(direction, ()))

    def pick(self, dst_agent: Any, src_agent: Any) -> int | None:
        """An engine id bit for a copy from ``src_agent`` to ``dst_agent``, ``ROCR_CHOICE``
        (ROCr picks), or None: run a shader copy (see the class docstring)."""
        if self.lost:
            return None
        if self.rocr_picks:
            return None if dst_agent.handle == src_agent.handle else ROCR_CHOICE
        direction = (dst_agent.handle, src_agent.handle)
        free = [e for e in self.free_engines(dst_agent, src_agent) if (*direction, e) not in self.refused]
        if free:
            self.proven.update(e for e in free if e in self.used)
            self.seen.setdefault(direction, set()).update(free)
            # ROCr's own choice first (host-to-device on engine 0, the rest on engine 1: on gfx90a
            # engine 0 serves host-to-device only), so the engines each direction can use stay free.
            preferred = T.HSA_AMD_SDMA_ENGINE_0 << (src_agent.handle == self.agent.handle)
            if preferred in free:
                self.used.add(preferred)
                return preferred
            engines = free
        else:
            engines = sorted(e for e in self.seen.get(direction, ()) if e in self.proven)
            if not engines:
                return None
        self._next += 1
        engine = engines[self._next % len(engines)]
        self.used.add(engine)
        return engine

    def submit(self, engine: int, dst: int, dst_agent: Any, src: int, src_agent: Any, nbytes: int,
               deps: list[int], completion: int, cleanup: list) -> str | None:
        """Start the copy on ``engine`` (``ROCR_CHOICE``: on the blit ROCr picks); its name, or
        None (run a shader copy instead) if the engines were lost to a memory fault (a graph
        chose ``engine`` before), the runtime is crowded and ROCr's queues have no room this
        device may take or the copy could land on ROCr's utility queue (see the class
        docstring), ROCr reports OUT_OF_RESOURCES, or it
        refused ``engine`` for this direction. What gives its room back once it has retired
        goes to ``cleanup``. Raises HsaError for any other failure."""
        if self.lost:
            return None
        direction = (dst_agent.handle, src_agent.handle)
        if (*direction, engine) in self.refused:
            return None
        room = 2 + (len(deps) + 4) // 5
        if (self.room_in_use + room > ROCR_COPY_ROOM or not self._own_ring(engine, src_agent)) \
                and self._crowded():
            return None
        name = self._submit(engine, dst, dst_agent, src, src_agent, nbytes, deps, completion, direction)
        if name is not None:
            self.room_in_use += room
            cleanup.append(functools.partial(self._give_room, room))
        return name

    def _own_ring(self, engine: int, src_agent: Any) -> bool:
        """Whether ``engine`` runs its copies on a ring that ROCr's own synchronous work never
        waits behind: an SDMA queue (an engine proven one), or, where ROCr picks, its
        host-to-device blit (an SDMA queue, or a blit kernel on its own ``QueueBlitOnly``). ROCr's
        device-to-host and peer blits without SDMA are blit kernels on the device's utility
        queue (``GpuAgent::InitDma``), where ``hsa_executable_freeze`` copies a kernel's code
        (``RegionMemory::Freeze`` -> ``GpuAgent::DmaCopy``, then ``InvalidateCodeCaches``)."""
        if engine == ROCR_CHOICE:
            return src_agent.handle != self.agent.handle
        return engine in self.proven

    def _give_room(self, room: int) -> None:
        self.room_in_use -= room

    def _submit(self, engine: int, dst: int, dst_agent: Any, src: int, src_agent: Any, nbytes: int,
                deps: list[int], completion: int, direction: tuple) -> str | None:
        arr = (T.hsa_signal_t * len(deps))(*[T.hsa_signal_t(h) for h in deps]) if deps else None
        if engine == ROCR_CHOICE:
            status = self.api.hsa_amd_memory_async_copy(dst, dst_agent, src, src_agent, nbytes, len(deps), arr,
                                                        T.hsa_signal_t(completion))
            if status == T.HSA_STATUS_ERROR_OUT_OF_RESOURCES:
                return None
            self.api.check(status, "hsa_amd_memory_async_copy")
            return self._count(f"{self.name}.rocr-{self._role(dst_agent, src_agent)}")
        status = self.api.hsa_amd_memory_async_copy_on_engine(
            dst, dst_agent, src, src_agent, nbytes, len(deps), arr, T.hsa_signal_t(completion), engine, True)
        if status == T.HSA_STATUS_ERROR_OUT_OF_RESOURCES:
            return None
        if status == T.HSA_STATUS_ERROR_INVALID_ARGUMENT and engine in self.seen.get(direction, ()):
            self.refused.add((*direction, engine))
            self.seen[direction].discard(engine)
            return None
        self.api.check(status, "hsa_amd_memory_async_copy_on_engine")
        return self._count(f"{self.name}.sdma{engine.bit_length() - 1}")

    def _role(self, dst_agent: Any, src_agent: Any) -> str:
        """The blit ROCr picks (GpuAgent::GetBlitObject), named by its role: a PCIe peer copy
        runs on the source's device-to-host blit, behind that blit's device-to-host copies and
        they behind it, so it carries that blit's name (the watchdog orders an engine's work by
        name: a copy queued behind a stalled one is held up, not silent). In an xGMI hive ROCr
        runs peer copies on its xGMI blits instead; aiogpu does not tell the two apart, and
        sharing the name then only makes the watchdog start a peer copy's clock once the older
        device-to-host copies have completed, never too early."""
        return "h2d" if src_agent.handle != self.agent.handle else "d2h"

    def _count(self, label: str) -> str:
        self.counts[label] = self.counts.get(label, 0) + 1
        return label
