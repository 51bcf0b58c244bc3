"""User-mode AQL queues laid out as ROCr's ``amd_queue_t`` (amd_hsa_queue.h) in real memory.

``hsa_queue_create`` returns a pointer to the ``hsa_queue_t`` at offset 0 of an ``amd_queue_t``;
the write index is ``write_dispatch_id`` (offset 56) and the read index ``read_dispatch_id``
(offset 128), both 64-bit packet ids that only grow. The ring is ``size`` 64-byte slots (a power
of two) in its own page-aligned memory, every header initialised INVALID. The doorbell is a
signal of the queue's own, starting at -1 (nothing rung): the runtime stores into it the id of
the last packet it published.

Index operations are atomic under the queue's lock; the values are read and written in the
struct's memory with acquire/release atomics, so a runtime reading them directly agrees.
"""
from __future__ import annotations

import ctypes
import itertools
import mmap
import threading
from ctypes import c_uint32, c_uint64
from typing import Any

import numpy as np

from .. import atomics, packets
from .. import types as T
from ._abi import StatusError, address_of, require
from .agents import QUEUE_MAX_SIZE, QUEUES_MAX, Agent
from .signals import Signal

PAGE = 4096
AMD_QUEUE_PROPERTIES_IS_PTR64 = 1 << 1


class amd_queue_t(ctypes.Structure):
    """ROCr's queue descriptor (amd_hsa_queue.h), 256 bytes, 64-byte aligned."""

    _fields_ = [
        ("hsa_queue", T.hsa_queue_t),
        ("reserved1", c_uint32 * 4),
        ("write_dispatch_id", c_uint64),
        ("group_segment_aperture_base_hi", c_uint32),
        ("private_segment_aperture_base_hi", c_uint32),
        ("max_cu_id", c_uint32),
        ("max_wave_id", c_uint32),
        ("max_legacy_doorbell_dispatch_id_plus_1", c_uint64),
        ("legacy_doorbell_lock", c_uint32),
        ("reserved2", c_uint32 * 9),
        ("read_dispatch_id", c_uint64),
        ("read_dispatch_id_field_base_byte_offset", c_uint32),
        ("compute_tmpring_size", c_uint32),
        ("scratch_resource_descriptor", c_uint32 * 4),
        ("scratch_backing_memory_location", c_uint64),
        ("scratch_backing_memory_byte_size", c_uint64),
        ("scratch_wave64_lane_byte_size", c_uint32),
        ("queue_properties", c_uint32),
        ("reserved3", c_uint32 * 2),
        ("queue_inactive_signal", T.hsa_signal_t),
        ("reserved4", c_uint32 * 14),
    ]


WRITE_INDEX_OFFSET = amd_queue_t.write_dispatch_id.offset
READ_INDEX_OFFSET = amd_queue_t.read_dispatch_id.offset
assert (WRITE_INDEX_OFFSET, READ_INDEX_OFFSET, ctypes.sizeof(amd_queue_t)) == (56, 128, 256)


class Queue:
    """One AQL queue's memory and indices; its packet processor is attached by QueueTable."""

    def __init__(self, agent: Agent, queue_id: int, size: int, queue_type: int, callback: Any,
                 data: Any, doorbell: Signal) -> None:
        self.agent, self.id, self.size, self.type = agent, queue_id, size, queue_type
        self.callback = callback if callback else None
        self.data = data
        self.doorbell = doorbell
        self.lock = threading.Lock()
        self.alive = True
        self.event = 0  # the KFD event ROCr gives each AQL queue
        # ROCr's AqlQueue starts at HSA_AMD_QUEUE_PRIORITY_NORMAL; hsa_amd_queue_set_priority changes it.
        self.priority = T.HSA_AMD_QUEUE_PRIORITY_NORMAL
        self.processor: Any = None
        self._mm = mmap.mmap(-1, PAGE + size * packets.PACKET_SIZE)
        holder = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(holder)
        del holder
        self.ring = self.address + PAGE
        self._init_descriptor()
        self._init_ring()

    @property
    def pointer(self) -> Any:
        """The ``hsa_queue_t*`` handed to the runtime and to its error callback."""
        return ctypes.cast(self.address, ctypes.POINTER(T.hsa_queue_t))

    # ---- indices ---------------------------------------------------------------------------
    def load_write_index(self) -> int:
        with self.lock:
            self._check_alive()
            return atomics.load_u64_acquire(self.address + WRITE_INDEX_OFFSET)

    def store_write_index(self, value: int) -> None:
        with self.lock:
            self._check_alive()
            atomics.store_u64_release(self.address + WRITE_INDEX_OFFSET, value)

    def add_write_index(self, delta: int) -> int:
        with self.lock:
            self._check_alive()
            old = atomics.load_u64_acquire(self.address + WRITE_INDEX_OFFSET)
            atomics.store_u64_release(self.address + WRITE_INDEX_OFFSET, (old + delta) & ((1 << 64) - 1))
            return old

    def cas_write_index(self, expected: int, value: int) -> int:
        with self.lock:
            self._check_alive()
            observed = atomics.load_u64_acquire(self.address + WRITE_INDEX_OFFSET)
            if observed == expected:
                atomics.store_u64_release(self.address + WRITE_INDEX_OFFSET, value)
            return observed

    def load_read_index(self) -> int:
        with self.lock:
            self._check_alive()
            return atomics.load_u64_acquire(self.address + READ_INDEX_OFFSET)

    def retire_slots(self, first: int, end: int) -> None:
        """Packets [first, end) retired: headers back to INVALID, then the read index to ``end``."""
        with self.lock:
            if not self.alive:
                return
            for packet_id in range(first, end):
                atomics.store_u32_release(self.slot(packet_id), packets.INVALID_HEADER)
            atomics.store_u64_release(self.address + READ_INDEX_OFFSET, end)

    # ---- slots -----------------------------------------------------------------------------
    def slot(self, packet_id: int) -> int:
        return self.ring + (packet_id % self.size) * packets.PACKET_SIZE

    def header_valid(self, packet_id: int) -> bool:
        word = atomics.load_u32_acquire(self.slot(packet_id))
        return packets.header_type(word & 0xFFFF) != packets.HSA_PACKET_TYPE_INVALID

    def read_slot(self, packet_id: int) -> bytes:
        """The 64 bytes of a slot: the header word with an acquire load, then the body."""
        address = self.slot(packet_id)
        word = atomics.load_u32_acquire(address)
        return word.to_bytes(4, "little") + ctypes.string_at(address + 4, packets.PACKET_SIZE - 4)

    def slot_changed(self, packet_id: int, consumed: bytes) -> bool:
        """True if a live queue's slot no longer holds the bytes the processor consumed."""
        with self.lock:
            return self.alive and self.read_slot(packet_id) != consumed

    # ---- life ------------------------------------------------------------------------------
    def release(self) -> None:
        """Forget the memory (after the processor stopped): later index calls are INVALID_QUEUE."""
        with self.lock:
            self.alive = False
        self._mm.close()

    def _check_alive(self) -> None:
        if not self.alive:
            raise StatusError(T.HSA_STATUS_ERROR_INVALID_QUEUE, "queue destroyed")

    def _init_descriptor(self) -> None:
        d = amd_queue_t.from_address(self.address)
        d.hsa_queue.type = self.type
        d.hsa_queue.features = T.HSA_AGENT_FEATURE_KERNEL_DISPATCH
        d.hsa_queue.base_address = self.ring
        d.hsa_queue.doorbell_signal.handle = self.doorbell.address
        d.hsa_queue.size = self.size
        d.hsa_queue.id = self.id
        d.max_cu_id = max(self.agent.compute_units - 1, 0)
        d.read_dispatch_id_field_base_byte_offset = READ_INDEX_OFFSET
        d.queue_properties = AMD_QUEUE_PROPERTIES_IS_PTR64
        self.doorbell.set_queue_ptr(self.address)

    def _init_ring(self) -> None:
        words = np.ctypeslib.as_array((ctypes.c_uint32 * (self.size * 16)).from_address(self.ring))
        words[::16] = packets.INVALID_HEADER


class QueueTable:
    """The live queues of one emulator, found by the address of their hsa_queue_t."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[int, Queue] = {}
        self._ids = itertools.count()

    def validate(self, agent: Agent, size: int, queue_type: int, min_size: int) -> None:
        """ROCr's checks, in its order (ROCr: GpuAgent::QueueCreate): a GPU agent; a power-of-two
        size, else INVALID_ARGUMENT; at most QUEUE_MAX_SIZE (0x20000), else OUT_OF_RESOURCES; at
        least the agent's minimum (64 packets; ``emulator_min_queue_size``), else INVALID_ARGUMENT;
        a known type."""
        require(agent.is_gpu, T.HSA_STATUS_ERROR_INVALID_QUEUE_CREATION, "the CPU agent has no AQL queues")
        require(size and size & (size - 1) == 0, T.HSA_STATUS_ERROR_INVALID_ARGUMENT,
                f"queue size {size} is not a power of two")
        require(size <= QUEUE_MAX_SIZE, T.HSA_STATUS_ERROR_OUT_OF_RESOURCES,
                f"queue size {size} > QUEUE_MAX_SIZE {QUEUE_MAX_SIZE}")
        require(size >= min_size, T.HSA_STATUS_ERROR_INVALID_ARGUMENT,
                f"queue size {size} < QUEUE_MIN_SIZE {min_size}")
        require(queue_type in (T.HSA_QUEUE_TYPE_MULTI, T.HSA_QUEUE_TYPE_SINGLE),
                T.HSA_STATUS_ERROR_INVALID_ARGUMENT, f"queue type {queue_type}")
        with self._lock:
            count = sum(q.agent is agent for q in self._queues.values())
        require(count < QUEUES_MAX, T.HSA_STATUS_ERROR_OUT_OF_RESOURCES, "QUEUES_MAX reached")

    def new_id(self) -> int:
        return next(self._ids)

    def add(self, queue: Queue) -> None:
        with self._lock:
            self._queues[queue.address] = queue

    def get(self, pointer: Any) -> Queue:
        queue = self._queues.get(address_of(pointer))
        if queue is None:
            raise StatusError(T.HSA_STATUS_ERROR_INVALID_QUEUE, "unknown queue")
        return queue

    def remove(self, queue: Queue) -> None:
        with self._lock:
            self._queues.pop(queue.address, None)

    def all(self) -> list[Queue]:
        with self._lock:
            return list(self._queues.values())
