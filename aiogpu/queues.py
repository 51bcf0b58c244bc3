"""The AQL queue writer, its back-log and kernarg ring, and the choice of copy engine.

The writer keeps DESIGN.md's protocol:
1. space is checked (write - read + n <= size) *before* slots are reserved by an atomic add to the
   write index, so a ring is never overrun;
2. every packet body (bytes 4..63) is written first, then each header word
   (``header | setup << 16``) is published by one aligned 32-bit release store, in order;
3. the doorbell gets the index of the last published packet (release store);
4. every reserved slot is published, even when writing fails (a no-op barrier packet);
5. more than five dependencies are chained over several barrier-AND packets.
A group that does not fit waits in a per-queue back-log, drained as packets retire; the event loop
never blocks on a full ring.
"""
from __future__ import annotations

import ctypes
import struct
from collections import deque
from typing import Any

from .errors import GPUError
from .hsa_bindings import atomics
from .hsa_bindings import packets as P
from .hsa_bindings import types as T
from .futures import GPUFuture
from .signals import CompletionHub

DEFAULT_RING = 1024
KERNARG_RING_BYTES = 256 << 10
BODY_OFFSET = 4  # bytes 0..3 are the header word, published last
KERNARG_ADDRESS_OFFSET = P.hsa_kernel_dispatch_packet_t.kernarg_address.offset


class PacketGroup:
    """Packets that go into one queue back to back (barriers, then the work), as raw bytes.

    ``blob`` holds ``n`` 64-byte packets whose header words are ignored; ``headers`` are the
    words (``header | setup << 16``) published after every body. ``future`` completes with the
    last packet; ``marks`` are further futures completed by packet ``i`` of the group (graph
    nodes). ``kernargs`` maps a dispatch packet's index to argument bytes placed in the queue's
    kernarg ring at publication.
    """

    __slots__ = ("blob", "headers", "future", "marks", "kernargs")

    def __init__(self, packets: list, headers: list[int], future: GPUFuture, kernarg: bytes = b"", *,
                 blob: bytearray | None = None, marks: list | None = None, kernargs: dict | None = None):
        self.blob = blob if blob is not None else bytearray(b"".join(bytes(p) for p in packets))
        self.headers = headers
        self.future = future
        self.marks = marks or []
        self.kernargs = kernargs if kernargs is not None else ({len(headers) - 1: kernarg} if kernarg else {})

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

    def alloc(self, nbytes: int) -> tuple[int, list] | None:
        n = (nbytes + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        if n > self.size:
            raise ValueError(f"kernel arguments of {nbytes} bytes exceed the kernarg ring ({self.size})")
        start = self._head
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
        self._callback = T.queue_error_callback_t(self._on_error_from_driver)
        self._create()

    # -- lifecycle -----------------------------------------------------------------------------
    def _create(self) -> None:
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

    def destroy(self) -> None:
        if self._q:
            self.api.hsa_queue_destroy(self._q)
            self._q = None

    # -- submission ----------------------------------------------------------------------------
    def submit(self, group: PacketGroup) -> None:
        """Publish ``group`` now if the ring has room and nothing waits before it, else park it
        in the back-log. Never blocks. Call under the runtime lock."""
        group.future.queue = self.name
        if self.backlog or not self._try_publish(group):
            self.backlog.append(group)

    def drain(self) -> None:
        """Publish back-logged groups while they fit (after packets retired; under lock)."""
        while self.backlog and not self.broken and self._try_publish(self.backlog[0]):
            self.backlog.popleft()

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
        if self.broken or not self.has_room(n):
            return False
        if group.kernargs and not self._place_kernargs(group):
            return False
        first = self.api.hsa_queue_add_write_index_scacq_screl(self._q, n)
        try:
            self._write_bodies(first, group.blob, n)
            self._publish_headers(first, group.headers)
        except BaseException:
            self._publish_noops(first, n)  # rule 4: a reserved slot is never left unpublished
            raise
        finally:
            self.api.hsa_signal_store_screlease(self.doorbell, first + n - 1)
        self.published += n
        self.inflight[group.future] = (first, first + n - 1)
        group.future.packet = first + n - 1
        for fut, i in group.marks:
            self.inflight[fut] = (first, first + i)
            fut.packet, fut.queue = first + i, self.name
        return True

    def _place_kernargs(self, group: PacketGroup) -> bool:
        """Copy kernel arguments into the ring (all or none); freed when the group retires."""
        placed = []
        for index, data in group.kernargs.items():
            got = self.kernarg.alloc(len(data))
            if got is None:
                for entry in placed:
                    self.kernarg.free(entry)
                return False
            address, entry = got
            placed.append(entry)
            ctypes.memmove(address, data, len(data))
            struct.pack_into("<Q", group.blob, index * P.PACKET_SIZE + KERNARG_ADDRESS_OFFSET, address)
        group.future._cleanup.append(lambda: [self.kernarg.free(e) for e in placed])
        return True

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
        """``fut``'s packets retired (under lock): forget them and publish what now fits."""
        self.inflight.pop(fut, None)
        self.drain()

    # -- errors --------------------------------------------------------------------------------
    def _on_error_from_driver(self, status: int, _queue: Any, _data: Any) -> None:
        # Runs on a driver thread: record and hand over to the waiter thread, nothing more.
        generation = self.generation
        self.hub.post_event(lambda: self._on_error(status, generation))

    def _on_error(self, status: int, generation: int) -> None:
        with self.hub.lock:
            if generation != self.generation or self._q is None:
                return
            failed_at = self.api.hsa_queue_load_read_index_scacquire(self._q)
            err = GPUError(f"queue {self.name} failed at packet {failed_at}: {T.status_name(status)}",
                           status=status, queue=self.name, packet=failed_at)
            # HSA's callback carries a status only; the emulator can say what happened.
            emulator = self.api.emulator
            if emulator is not None:
                err.__cause__ = emulator.queue_error_cause(self.id, failed_at)
            self.abort(err, failed_at)

    def abort(self, err: GPUError, failed_at: int) -> None:
        """Destroy the HSA queue, fail every operation on it and replace it (under lock).

        The operation whose packets include ``failed_at`` fails with ``err``; the others with an
        error that says the queue failed before they ran (or before they were submitted). Once
        the queue is destroyed none of its packets can run, so everything they held is freed.
        """
        self.broken = True
        victims = sorted(self.inflight.items(), key=lambda v: v[1][0])
        parked = list(self.backlog)
        self.backlog.clear()
        self.inflight.clear()
        self.destroy()              # no packet of it can run any more
        self.generation += 1
        self.errors.append(str(err))
        why = T.status_name(err.status) if err.status is not None else type(err).__name__
        for fut, (first, last) in victims:
            if first <= failed_at <= last:
                self.hub.fail(fut, err)
            else:
                self.hub.fail(fut, _caused_by(err, GPUError(
                    f"{fut.label}: queue {self.name} failed at packet {failed_at} ({why}) before it ran",
                    status=err.status, queue=self.name, packet=last)))
        for group in parked:
            self.hub.fail(group.future, _caused_by(err, GPUError(
                f"{group.future.label}: queue {self.name} failed ({why}) before it was submitted",
                status=err.status, queue=self.name)))
        for fut in [f for f, _ in victims] + [g.future for g in parked]:
            self.hub.retire_failed(fut)
        self._create()

    def __repr__(self) -> str:
        return f"<AqlQueue {self.name} size={self.size} backlog={len(self.backlog)}>"


def _caused_by(cause: BaseException, err: GPUError) -> GPUError:
    """``err`` with ``cause`` as its ``__cause__`` (a queue-mate's failure names the queue's)."""
    err.__cause__ = cause
    return err


class CopyEngines:
    """The SDMA engines of one device, chosen from what ``copy_engine_status`` reports free.

    ``submit`` returns the engine's name, or None when no engine is available (none free, the
    queues are exhausted, or the library lacks the engine calls): the caller then runs the copy
    as a shader copy on a compute queue.
    """

    def __init__(self, api: Any, agent: Any, name: str):
        self.api, self.agent, self.name = api, agent, name
        self._next = 0
        self.seen: set[int] = set()   # engines reported free at some point: they exist
        self.counts: dict[str, int] = {}

    def free_engines(self, dst_agent: Any, src_agent: Any) -> list[int]:
        if not self.api.has_engine_copy:
            return []
        mask = ctypes.c_uint32(0)
        status = self.api.hsa_amd_memory_copy_engine_status(dst_agent, src_agent, ctypes.byref(mask))
        return T.sdma_engine_bits(mask.value) if status == T.HSA_STATUS_SUCCESS else []

    def pick(self, dst_agent: Any, src_agent: Any) -> int | None:
        """An engine id bit for a copy between the two agents: round-robin over the free ones;
        when every engine is busy, over the engines seen before (the copy queues behind the
        others on its engine, as ROCr's SDMA queues do). None when no engine was ever reported:
        then, and when the chosen engine turns out exhausted, the copy runs as a shader copy."""
        engines = self.free_engines(dst_agent, src_agent)
        if engines:
            self.seen.update(engines)
        else:
            engines = sorted(self.seen)
            if not engines:
                return None
        self._next += 1
        return engines[self._next % len(engines)]

    def submit(self, engine: int, dst: int, dst_agent: Any, src: int, src_agent: Any, nbytes: int,
               deps: list[int], completion: int) -> str | None:
        """Start the copy on ``engine``; its name, or None if the engine ran out meanwhile."""
        arr = (T.hsa_signal_t * len(deps))(*[T.hsa_signal_t(h) for h in deps]) if deps else None
        status = self.api.hsa_amd_memory_async_copy_on_engine(
            dst, dst_agent, src, src_agent, nbytes, len(deps), arr, T.hsa_signal_t(completion), engine, True)
        if status == T.HSA_STATUS_ERROR_OUT_OF_RESOURCES:
            return None
        self.api.check(status, "hsa_amd_memory_async_copy_on_engine")
        label = f"{self.name}.sdma{engine.bit_length() - 1}"
        self.counts[label] = self.counts.get(label, 0) + 1
        return label
