"""Helpers for driving the emulator through the raw HSA API, exactly as on the real library.

The AQL writer follows DESIGN.md's protocol: reserve with add_write_index, wait for space before
touching the ring, write the body (bytes 4..63), publish ``header | setup << 16`` with one release
store, ring the doorbell with the packet index.
"""
from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass

import numpy as np
from aiogpu.hsa_bindings import atomics, codeobject, emulated_code, packets, signature
from aiogpu.hsa_bindings import types as T
from aiogpu.hsa_bindings.loader import make_emulator

UINT64_MAX = (1 << 64) - 1
NS = 1_000_000_000


def ok(status: int) -> None:
    assert status == T.HSA_STATUS_SUCCESS, T.status_name(status)


class Hsa:
    """One emulator plus the handles every test needs (agents, pools) and small conveniences."""

    def __init__(self, **options) -> None:
        options.setdefault("gpus", 2)
        self.api = make_emulator("test", **options)
        self.emu = self.api.emulator
        self.agents = self._agents()
        self.cpu = self.agents[0]
        self.gpus = self.agents[1:]
        self.kernarg_pool, self.system_pool = self._pools(self.cpu)
        self.device_pools = [self._pools(g)[0] for g in self.gpus]
        self.queues: list = []
        self.kernarg_blocks: set[int] = set()
        self.errors: list[tuple[int, int]] = []  # (status, queue id) from queue callbacks
        self._callbacks = []
        self._keep = []

    def _agents(self) -> list:
        found = []

        @T.agent_iterate_callback_t
        def visit(agent, _data):
            found.append(T.hsa_agent_t(agent.handle))
            return T.HSA_STATUS_SUCCESS

        ok(self.api.hsa_iterate_agents(visit, None))
        return found

    def _pools(self, agent) -> list:
        found = []

        @T.pool_iterate_callback_t
        def visit(pool, _data):
            found.append(T.hsa_amd_memory_pool_t(pool.handle))
            return T.HSA_STATUS_SUCCESS

        ok(self.api.hsa_amd_agent_iterate_memory_pools(agent, visit, None))
        return found

    # ---- memory --------------------------------------------------------------------------
    def alloc(self, pool, size: int) -> int:
        ptr = ctypes.c_void_p()
        ok(self.api.hsa_amd_memory_pool_allocate(pool, size, 0, ctypes.byref(ptr)))
        return ptr.value

    def free(self, address: int) -> None:
        ok(self.api.hsa_amd_memory_pool_free(address))

    def device_alloc(self, gpu: int, size: int) -> int:
        return self.alloc(self.device_pools[gpu], size)

    def allow(self, address: int, *gpus: int) -> None:
        agents = (T.hsa_agent_t * len(gpus))(*[self.gpus[g] for g in gpus])
        ok(self.api.hsa_amd_agents_allow_access(len(gpus), agents, None, address))

    def lock(self, array: np.ndarray) -> int:
        out = ctypes.c_void_p()
        ok(self.api.hsa_amd_memory_lock(array.ctypes.data, array.nbytes, None, 0, ctypes.byref(out)))
        return out.value

    def host_view(self, address: int, nbytes: int, dtype=np.uint8) -> np.ndarray:
        """Host access to emulated memory (it is real memory)."""
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)).view(dtype)

    # ---- signals -------------------------------------------------------------------------
    def signal(self, value: int = 1):
        s = T.hsa_signal_t()
        ok(self.api.hsa_signal_create(value, 0, None, ctypes.byref(s)))
        return s

    def value(self, signal) -> int:
        return self.api.hsa_signal_load_scacquire(signal)

    def wait_zero(self, signal, timeout: float = 5.0) -> bool:
        got = self.api.hsa_signal_wait_scacquire(signal, T.HSA_SIGNAL_CONDITION_EQ, 0, int(timeout * NS),
                                                 T.HSA_WAIT_STATE_BLOCKED)
        return got == 0

    # ---- queues --------------------------------------------------------------------------
    def queue(self, gpu: int = 0, size: int = 64) -> "AqlWriter":
        @T.queue_error_callback_t
        def on_error(status, queue, _data):
            self.errors.append((status, queue.contents.id))

        self._callbacks.append(on_error)
        q = ctypes.POINTER(T.hsa_queue_t)()
        ok(self.api.hsa_queue_create(self.gpus[gpu], size, T.HSA_QUEUE_TYPE_MULTI, on_error, None,
                                     0xFFFFFFFF, 0xFFFFFFFF, ctypes.byref(q)))
        writer = AqlWriter(self.api, q)
        self.queues.append(writer)
        return writer

    def wait_errors(self, count: int = 1, timeout: float = 5.0) -> list[tuple[int, int]]:
        deadline = time.monotonic() + timeout
        while len(self.errors) < count and time.monotonic() < deadline:
            time.sleep(0.002)
        return list(self.errors)

    # ---- kernels -------------------------------------------------------------------------
    def load_kernel(self, gpu: int, name: str, sig: str, body) -> "Kernel":
        token = emulated_code.register(body)
        blob = emulated_code.code_object([(name, sig, token)])
        buf = ctypes.create_string_buffer(blob, len(blob))
        api = self.api
        reader, exe = T.hsa_code_object_reader_t(), T.hsa_executable_t()
        ok(api.hsa_code_object_reader_create_from_memory(ctypes.addressof(buf), len(blob), ctypes.byref(reader)))
        ok(api.hsa_executable_create_alt(T.HSA_PROFILE_FULL, T.HSA_DEFAULT_FLOAT_ROUNDING_MODE_DEFAULT, None,
                                         ctypes.byref(exe)))
        ok(api.hsa_executable_load_agent_code_object(exe, self.gpus[gpu], reader, None, None))
        ok(api.hsa_executable_freeze(exe, None))
        symbol = T.hsa_executable_symbol_t()
        ok(api.hsa_executable_get_symbol_by_name(exe, f"{name}.kd".encode(), ctypes.byref(self.gpus[gpu]),
                                                 ctypes.byref(symbol)))
        kobj, kasize = ctypes.c_uint64(), ctypes.c_uint32()
        ok(api.hsa_executable_symbol_get_info(symbol, T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_OBJECT,
                                              ctypes.byref(kobj)))
        ok(api.hsa_executable_symbol_get_info(symbol, T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_KERNARG_SEGMENT_SIZE,
                                              ctypes.byref(kasize)))
        args = signature.parse_signature(sig)
        return Kernel(self, name, kobj.value, kasize.value, args, exe)

    def close(self) -> None:
        if self.emu.initialized:
            ok(self.api.hsa_shut_down())


@dataclass
class Kernel:
    hsa: Hsa
    name: str
    object: int
    kernarg_size: int
    args: tuple
    executable: object

    @property
    def layout(self):
        return signature.KernargLayout.of(self.args, hidden_lengths=True, implicit=True)

    def kernargs(self, values, lengths=()) -> int:
        """Kernarg memory in the KERNARG_INIT pool, filled with ``signature.pack``; ``packet``
        writes the hidden geometry arguments when the dispatch is made."""
        data = signature.pack(self.args, self.layout, values, lengths)
        assert len(data) == self.kernarg_size
        address = self.hsa.alloc(self.hsa.kernarg_pool, len(data))
        ctypes.memmove(address, data, len(data))
        self.hsa.kernarg_blocks.add(address)
        return address

    def packet(self, grid, block, kernarg: int, signal=None, *, barrier: bool = False) -> tuple[int, bytes]:
        """(header | setup << 16, the 64 packet bytes) of a dispatch (and, in kernarg memory from
        ``kernargs``, its hidden geometry arguments, as a runtime fills them)."""
        if kernarg in self.hsa.kernarg_blocks:
            hidden = tuple(codeobject.HiddenArg(kind, off, size) for kind, off, size in self.layout.implicit)
            data = codeobject.fill_hidden(hidden, ctypes.string_at(kernarg, self.kernarg_size), grid, block)
            ctypes.memmove(kernarg, data, len(data))
        p = packets.hsa_kernel_dispatch_packet_t()
        dims = len(grid)
        grid, block = tuple(grid) + (1,) * (3 - dims), tuple(block) + (1,) * (3 - dims)
        p.workgroup_size_x, p.workgroup_size_y, p.workgroup_size_z = block
        p.grid_size_x, p.grid_size_y, p.grid_size_z = grid
        p.kernel_object = self.object
        p.kernarg_address = kernarg
        p.completion_signal = signal if signal is not None else T.hsa_signal_t(0)
        header = packets.make_header(packets.HSA_PACKET_TYPE_KERNEL_DISPATCH, barrier=barrier)
        return header | dims << 16, bytes(p)


def barrier_packet(deps=(), signal=None, *, kind=packets.HSA_PACKET_TYPE_BARRIER_AND,
                   barrier: bool = False) -> tuple[int, bytes]:
    p = packets.hsa_barrier_and_packet_t()
    for i, d in enumerate(deps):
        p.dep_signal[i] = d
    p.completion_signal = signal if signal is not None else T.hsa_signal_t(0)
    return packets.make_header(kind, barrier=barrier), bytes(p)


class AqlWriter:
    """The AQL protocol of DESIGN.md: reserve, wait for space, body, release-store header, doorbell."""

    def __init__(self, api, queue_ptr) -> None:
        self.api, self.ptr = api, queue_ptr
        q = queue_ptr.contents
        self.id, self.size, self.base = q.id, q.size, q.base_address
        self.doorbell = T.hsa_signal_t(q.doorbell_signal.handle)
        self.overruns = 0
        self._lock = threading.Lock()

    def slot(self, index: int) -> int:
        return self.base + (index % self.size) * packets.PACKET_SIZE

    def reserve(self, count: int = 1, timeout: float = 10.0) -> int:
        index = self.api.hsa_queue_add_write_index_scacq_screl(self.ptr, count)
        deadline = time.monotonic() + timeout
        while index + count - self.read_index() > self.size:
            assert time.monotonic() < deadline, "queue never drained"
            time.sleep(0.0002)
        return index

    def publish(self, index: int, packet: tuple[int, bytes]) -> None:
        word, body = packet
        address = self.slot(index)
        if atomics.load_u32_acquire(address) & 0xFF != packets.HSA_PACKET_TYPE_INVALID:
            self.overruns += 1  # the slot still holds an unretired packet
        ctypes.memmove(address + 4, body[4:], packets.PACKET_SIZE - 4)
        atomics.store_u32_release(address, word)

    def ring(self, index: int) -> None:
        self.api.hsa_signal_store_screlease(self.doorbell, index)

    def submit(self, packet: tuple[int, bytes]) -> int:
        index = self.reserve()
        self.publish(index, packet)
        self.ring(index)
        return index

    def read_index(self) -> int:
        return self.api.hsa_queue_load_read_index_scacquire(self.ptr)

    def write_index(self) -> int:
        return self.api.hsa_queue_load_write_index_scacquire(self.ptr)

    def destroy(self) -> None:
        ok(self.api.hsa_queue_destroy(self.ptr))


def saxpy_body(launch, y, x, a, n):
    y[:n] += a * x[:n]
