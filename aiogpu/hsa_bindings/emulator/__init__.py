"""An in-process HSA runtime: the functions of ``prototypes.PROTOTYPES`` over real memory.

``EmulatedLibrary`` has one method per HSA function, named like it and taking its arguments as a
ctypes callback of that prototype receives them (ints for scalars, handle structs by value,
ctypes pointers, ints/None for ``void*``, bytes for ``char*``, CFUNCTYPE objects for callbacks).
The loader wraps each method into a C function pointer, so the runtime calls the emulator exactly
as it calls ``libhsa-runtime64``. Every method is guarded: an exception never reaches ctypes; an
emulator bug (an ``Exception``) is recorded in ``api_errors`` and reported as HSA_STATUS_ERROR
(0 / None for functions that return no status).

Ctrl-C behaves as with the real library, where a signal cannot interrupt a C call halfway: on the
main thread SIGINT is held back while an HSA call runs (the blocking waits excepted: they stop,
as if timed out, having changed nothing), the call completes, and the KeyboardInterrupt is raised
in the caller once the call has returned. Any other ``BaseException`` raised inside a call
(SystemExit from a signal handler, ...) is handed to the caller the same way, never swallowed.

Behaviour follows ROCr (see the module of each part): ``agents``, ``memory``, ``signals``,
``queues`` + ``packet_processor`` + ``dispatch`` + ``compute_units``, ``code_objects``, ``sdma``,
``events``, ``async_handlers``; ``faults`` injects failures and ``timeline`` records what ran.

Beyond the HSA functions, for tests and tools:
- ``faults``: FaultInjector (eager, queue_error_at, memory_fault_at, lose_completion_at,
  delay_completions, exhaust_sdma / restore_sdma, reset; ``fired`` lists what fired);
- ``timeline``: TimelineRecord(agent, queue, engine, kind, name, nbytes, start_ns, end_ns, packet)
  for every completed packet and copy; ``chrome_trace()`` for a trace file;
- ``resolve(agent, address, nbytes, write)``: what a GPU sees there, or MemoryFault;
- ``api_errors`` (emulator-internal exceptions), ``queue_errors`` (every queue error reported,
  with the reason), ``memory_faults`` (every GPU memory fault, with the reason, e.g. use after free),
  ``engine_history(gpu)`` (the newest copies each SDMA engine ran), ``blit_stats(gpu)`` (which
  of ROCr's blits exist, SDMA queue or blit kernel, and how many copies each ran), ``gpu_agent(i)``,
  ``locked_ranges()``, ``signal_stats()``, ``kernarg_mismatches`` (dispatches whose hidden
  geometry arguments, which the body sees, disagree with the packet).
- ``queue_error_cause(queue_id, packet=None)``: the exception that explains a queue error the
  emulator reported (what HSA's queue callback, a bare status, cannot carry): ``InjectedFault``,
  a kernel body's ``KernelError`` or ``MemoryFault``, else ``QueueFault`` with the reason.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ... import _interrupts
from ...errors import InjectedFault, KernelError, MemoryFault
from .. import types as T
from ..prototypes import PROTOTYPES
from ._abi import UINT32_MAX, StatusError, address_of, require, store_handle, store_out
from .agents import QUEUE_MAX_SIZE, QUEUE_MIN_SIZE, Agent, AgentTable, StatusStrings, agent_info, system_info
from .async_handlers import AsyncHandlers
from .code_objects import CodeObjects
from .compute_units import ComputeUnits
from .context import Context
from .dispatch import explanation
from .events import MemoryFaultRecord, SystemEvents
from .faults import FaultInjector, FaultRecord
from .memory import MemoryManager
from .packet_processor import PacketProcessor, QueueErrorRecord
from .queues import Queue, QueueTable
from .sdma import HISTORY_RECORDS, MAX_XGMI_ENGINES, CopyEngines, CopyRecord
from .signals import CONDITIONS, EVENT_LIMIT, Signal, SignalTable, timeout_seconds
from .timeline import DEFAULT_CAPACITY, Timeline, TimelineRecord

__all__ = ["EmulatedLibrary", "ApiError", "FaultInjector", "FaultRecord", "MemoryFault", "MemoryFaultRecord",
           "QueueErrorRecord", "Timeline", "TimelineRecord", "CopyRecord", "KernelError", "InjectedFault",
           "QueueFault"]

_serials = itertools.count()
_NO_INIT_CHECK = frozenset({"hsa_init", "hsa_shut_down", "hsa_status_string"})


class QueueFault(Exception):
    """Why the emulator failed a queue (``record``: its QueueErrorRecord), where nothing more
    specific explains it (e.g. a packet the command processor rejects)."""

    def __init__(self, record: QueueErrorRecord):
        self.record = record
        super().__init__(f"queue {record.queue} failed at packet {record.packet} "
                         f"({T.status_name(record.status)}): {record.detail}")


# Fault records that are injected failures (a torn packet is a writer's bug the eager packet
# processor caught, not something injected).
_INJECTED_FAILURES = ("queue_error", "memory_fault")


@dataclass(frozen=True)
class ApiError:
    """An exception inside the emulator (an HSA call or one of its threads), kept for tests."""

    function: str
    error: BaseException
    traceback: str


def hsa_function(method: Callable) -> Callable:
    """Never let an exception escape into ctypes: StatusError becomes the returned status, another
    Exception is an emulator bug (recorded, HSA_STATUS_ERROR), and an interrupt (a held-back
    SIGINT, or another BaseException) is raised in the caller after the call has returned."""
    name = method.__name__
    restype = PROTOTYPES[name][0]
    returns_status = restype is T.hsa_status_t
    default = T.HSA_STATUS_ERROR if returns_status else (None if restype is None else 0)
    interruptible = name in _BLOCKING

    @functools.wraps(method)
    def guarded(self: "EmulatedLibrary", *args: Any) -> Any:
        held = False if interruptible else _interrupts.hold()
        try:
            if name not in _NO_INIT_CHECK and self._state is None:
                raise StatusError(T.HSA_STATUS_ERROR_NOT_INITIALIZED, "hsa_init has not been called")
            return method(self, *args)
        except StatusError as exc:
            if returns_status:
                return exc.status
            self._record(name, exc)
            return default
        except Exception as exc:
            self._record(name, exc)
            return default
        except BaseException as exc:      # an interrupt, not a bug: the caller gets it
            _raise_in_caller(exc)
            return self._interrupted(name, args, default)
        finally:
            if held:
                _release()

    _GUARDS.add(guarded.__code__)
    return guarded


# Blocking waits stay interruptible: stopped early they have changed nothing (they read signals).
_BLOCKING = frozenset({"hsa_signal_wait_scacquire", "hsa_amd_signal_wait_any"})
_GUARDS: set = set()     # the code of the guard (one closure: one code object)


def _in_guard(frame: Any) -> bool:
    return frame.f_code in _GUARDS


def _raise_in_caller(exc: BaseException) -> None:
    def throw() -> None:
        raise exc

    _interrupts.run_in_caller(throw, _in_guard)


def _release() -> None:
    """End a hold: a SIGINT that came during the call is handled in the caller."""
    try:
        handler = _interrupts.release()
        if handler is not None:
            _interrupts.run_in_caller(lambda: handler(_interrupts.SIGINT, None), _in_guard)
    except BaseException as exc:          # a SIGINT just after the hold ended
        _raise_in_caller(exc)


class _State:
    """What hsa_init builds and hsa_shut_down tears down."""

    def __init__(self, ctx: Context, copies: CopyEngines, evicted: set[int]) -> None:
        self.ctx = ctx
        self.evicted = evicted      # the emulated process's evicted GPUs (the library's: outlives this)
        self.queues = QueueTable()
        self.copies = copies
        self.async_handlers = AsyncHandlers(ctx.name, ctx.report_bug)
        # ROCr's loader does not copy a code object read from memory: the reader keeps the
        # caller's pointer and every loaded code object's link-map entry (r_debug, a
        # memory://<pid>#offset=&size= URI that debuggers and profilers read) names it until
        # the executable is destroyed (CodeObjectReaderImpl::SetMemory, ExecutableImpl::LoadCodeObject).
        self.readers: dict[int, tuple[int, int]] = {}                        # reader -> (address, size)
        self.link_map: dict[int, list[tuple[int, int, bytes]]] = {}          # executable -> (address, size, bytes)
        self.exe_gpus: dict[int, set[int]] = {}                              # executable -> GPUs loaded for

    def evict(self, gpu: int) -> None:
        """KFD after a memory fault on GPU ``gpu``: evict the process's queues there, AQL and
        SDMA (ROCr's blits) alike (``kfd_dqm_evict_pasid``), and keep the process evicted there
        for its life: KFD restores a process's queues only after evictions it undoes itself
        (memory pressure, not a VM fault), and ``create_queue`` gives a queue of an evicted
        process an inactive hardware queue (``q->properties.is_evicted = !!qpd->evicted``),
        so queues created later never run. ROCr never recreates its blits' SDMA queues."""
        self.evicted.add(gpu)
        for q in self.queues.all():
            if q.agent.gpu == gpu:
                q.processor.evict()
        self.copies.evict(gpu)

    def close(self) -> None:
        """Stop and join every thread, then release signals, queue memory and allocations."""
        self.async_handlers.shutdown()
        queues = self.queues.all()
        for q in queues:
            q.processor.request_stop()
        for q in queues:
            q.processor.join()
        for pool in self.ctx.compute:
            pool.shutdown()
        self.copies.shutdown()
        for q in queues:
            q.release()
        self.ctx.signals.shutdown()
        self.ctx.memory.release_all()


ROCR_5_2_3, ROCR_5_7 = "5.2.3", "5.7"
ROCR_VERSIONS = (ROCR_5_2_3, ROCR_5_7)


class EmulatedLibrary:
    """The emulated HSA library with ``gpus`` GPU agents (plus the CPU agent).

    Options: ``rocr_version``, the ROCr release modelled: ``"5.2.3"`` (the default: the release
    Debian ships and aiogpu builds against) exports neither ``hsa_amd_memory_async_copy_on_engine``
    nor ``hsa_amd_memory_copy_engine_status``, so every copy goes through
    ``hsa_amd_memory_async_copy`` and ROCr picks the blit; ``"5.7"`` (ROCm 5.7 and later) has
    both. ``sdma_engines`` per GPU (ROCr's NumSdmaEngines: 0..2; 0 models SDMA disabled, as
    with HSA_ENABLE_SDMA=0), ``xgmi_engines`` per GPU (NumSdmaXgmiEngines, 0..14; with any, all
    GPUs form one xGMI hive), ``compute_units`` worker threads per GPU (how many dispatches
    overlap), ``eager`` packet processor from the start.

    Emulator-only (no ROCr equivalent; for tests): ``emulator_min_queue_size`` lowers
    HSA_AGENT_INFO_QUEUE_MIN_SIZE below ROCr's 64 packets (a power of two), so tests can exercise
    tiny rings; ``emulator_event_limit`` lowers KFD's limit of 4,096 signal events per process
    (``signal_stats()`` reports events in use and how often ROCr would have spun in a wait).
    Records kept for tests are bounded: ``timeline_records`` (the newest timeline
    records) and ``engine_history_records`` (the newest copies per SDMA engine).
    """

    def __init__(self, gpus: int = 2, *, rocr_version: str = ROCR_5_2_3, sdma_engines: int = 2,
                 xgmi_engines: int = 0, compute_units: int = 4, eager: bool = False,
                 emulator_event_limit: int = EVENT_LIMIT,
                 emulator_min_queue_size: int = QUEUE_MIN_SIZE, timeline_records: int = DEFAULT_CAPACITY,
                 engine_history_records: int = HISTORY_RECORDS) -> None:
        if gpus < 0 or not 0 <= sdma_engines <= 2 or not 0 <= xgmi_engines <= MAX_XGMI_ENGINES or compute_units < 1:
            raise ValueError("need gpus >= 0, 0 <= sdma_engines <= 2, 0 <= xgmi_engines <= 14 and compute_units >= 1")
        if rocr_version not in ROCR_VERSIONS:
            raise ValueError(f"rocr_version must be one of {ROCR_VERSIONS}, got {rocr_version!r}")
        self.rocr_version = rocr_version
        if rocr_version == ROCR_5_2_3:
            # Absent from ROCr 5.2.3 (hsa_ext_amd.cpp has hsa_amd_memory_async_copy only): the
            # loader, which binds what the library has, finds no such functions.
            self.hsa_amd_memory_async_copy_on_engine = None
            self.hsa_amd_memory_copy_engine_status = None
        size = emulator_min_queue_size
        if size < 1 or size & (size - 1) or size > QUEUE_MAX_SIZE:
            raise ValueError(f"emulator_min_queue_size must be a power of two <= {QUEUE_MAX_SIZE}")
        self.gpus, self.sdma_engines, self.compute_units = gpus, sdma_engines, compute_units
        self.xgmi_engines = xgmi_engines
        self.min_queue_size = size
        if emulator_event_limit < 8:
            raise ValueError("emulator_event_limit must leave room for ROCr's own events (>= 8)")
        self.event_limit = emulator_event_limit
        self.name = f"aiogpu-emu{next(_serials)}"
        self.api_errors: list[ApiError] = []
        self.queue_errors: list[QueueErrorRecord] = []
        self.memory_faults: list[MemoryFaultRecord] = []
        self.kernarg_mismatches: list[str] = []  # dispatches whose hidden geometry disagreed with the packet
        self.faults = FaultInjector(eager=eager)
        self.timeline = Timeline(timeline_records)
        self.engine_history_records = max(1, engine_history_records)
        self.faults.set_change_hook(self._wake_processors)
        self._state: _State | None = None
        self.evicted: set[int] = set()   # GPUs KFD keeps this process evicted on (a memory fault)
        self._init_count = 0
        self._lock = threading.RLock()
        self._strings = StatusStrings()

    # ---- helpers for tests and tools (not HSA functions) ------------------------------------
    def resolve(self, agent: Any, address: int, nbytes: int, write: bool = False) -> np.ndarray:
        """What a kernel or copy on ``agent`` (GPU index, hsa_agent_t, or None for the CPU) sees at
        [address, address + nbytes): a uint8 view of real memory, or MemoryFault."""
        ctx = self._ctx()
        if agent is not None and not isinstance(agent, int):
            agent = ctx.agents.get(agent.handle).gpu
        return ctx.memory.resolve(agent, address, nbytes, write)

    def locked_ranges(self) -> list[tuple[int, int, int, int]]:
        """(host address, size, agent address, lock count) of every hsa_amd_memory_lock registration."""
        return self._ctx().memory.locked()

    def gpu_agent(self, index: int) -> T.hsa_agent_t:
        return T.hsa_agent_t(self._ctx().agents.gpus[index].handle)

    def engine_history(self, gpu: int) -> list[list[CopyRecord]]:
        """Per engine of GPU ``gpu`` (ROCr's blits at engine offsets 1, 2, 3...: host-to-device,
        device-to-host, xGMI...), the newest copies it ran, in order."""
        return [list(e.history) for e in self._require_state().copies.engines[gpu]]

    def engine_outcomes(self, gpu: int) -> dict[str, int]:
        """How many copies the blits of GPU ``gpu`` (SDMA queues and blit kernels) ran, by
        outcome, since hsa_init."""
        total: dict[str, int] = {}
        for engine in self._require_state().copies.blits[gpu]:
            for outcome, count in engine.outcomes.items():
                total[outcome] = total.get(outcome, 0) + count
        return total

    def blit_stats(self, gpu: int) -> dict[str, dict]:
        """Per blit of GPU ``gpu`` created so far (ROCr creates each at its first copy), by its
        role (``"d2d"``, ``"h2d"``, ``"d2h"`` (also PCIe peer copies), ``"xgmi0"``, ...): whether
        it is an SDMA queue (``"sdma"``; False: ROCr's blit-kernel fallback) and how many copies
        it ran (``"copies"``, every outcome)."""
        out = {}
        for blit in self._require_state().copies.blits[gpu]:
            if blit.created:
                out[blit.role] = {"sdma": blit.is_sdma, "copies": sum(blit.outcomes.values())}
        return out

    def signal_stats(self) -> dict[str, int]:
        """KFD signal events (``events_in_use``, ``events_peak``, ``event_limit``) and what ROCr's
        waits would have done: ``wait_calls`` (each spins up to 200 us), ``busy_waits`` (waits
        that would spin throughout: ACTIVE hint or a signal without an event) and
        ``max_wait_signals`` (the most signals in one wait)."""
        table = self._ctx().signals
        return {**table.stats, "events_in_use": table.events.in_use, "events_peak": table.events.peak,
                "event_limit": table.events.limit}

    @property
    def initialized(self) -> bool:
        return self._state is not None

    def link_map(self) -> list[tuple[int, int, bool]]:
        """(address, size, intact) of every code object loaded into a live executable, as
        ROCr's loader link map names them: ``intact`` is False when the memory there no longer
        holds the bytes that were loaded (the caller freed or reused it)."""
        state = self._require_state()
        with self._lock:
            entries = [e for loaded in state.link_map.values() for e in loaded]
        return [(address, size, ctypes.string_at(address, size) == data) for address, size, data in entries]

    @property
    def init_count(self) -> int:
        """``hsa_init`` calls not yet balanced by ``hsa_shut_down`` (ROCr's reference count:
        Runtime::Acquire/Release; the last shut-down destroys the runtime, handlers included)."""
        return self._init_count

    def queue_error_cause(self, queue_id: int, packet: int | None = None) -> BaseException | None:
        """The exception that explains the queue error reported for ``packet`` of queue
        ``queue_id`` (None: its latest error): InjectedFault (fault injection), KernelError (a
        body raised; its ``__cause__`` is what it raised), MemoryFault (a body or a packet
        touched memory it may not), else QueueFault with the emulator's reason. None if no such
        error was reported."""
        record = next((r for r in reversed(self.queue_errors)
                       if r.queue == queue_id and (packet is None or r.packet == packet)), None)
        if record is None:
            return None
        packet = record.packet
        injected = next((f for f in reversed(self.faults.fired) if f.kind in _INJECTED_FAILURES
                         and f.queue == queue_id and f.packet == packet), None)
        if injected is not None:
            return InjectedFault(injected)
        ctx = self._state.ctx if self._state is not None else None
        source = f"queue {queue_id} packet {packet}"
        fault = next((m for m in reversed(self.memory_faults) if m.source == source), None)
        if fault is not None and record.status == T.HSA_STATUS_ERROR_MEMORY_FAULT:
            found = explanation(ctx, record.detail, fault) if ctx is not None else None
            return found or MemoryFault(fault.address, fault.reason, fault.mask)
        found = explanation(ctx, record.detail) if ctx is not None else None
        return found or QueueFault(record)

    def memory_fault_cause(self, address: int) -> BaseException | None:
        """The exception behind the newest GPU memory fault reported at ``address`` (what the
        system event, a bare address and mask, cannot carry): InjectedFault when fault
        injection asked for it, the body's MemoryFault, else one made from the fault record;
        None if no fault was reported there."""
        record = next((m for m in reversed(self.memory_faults) if m.address == address), None)
        if record is None:
            return None
        injected = next((f for f in reversed(self.faults.fired) if f.kind == "memory_fault"
                         and record.source == f"queue {f.queue} packet {f.packet}"), None)
        if injected is not None:
            return InjectedFault(injected)
        ctx = self._state.ctx if self._state is not None else None
        found = explanation(ctx, "", record) if ctx is not None else None
        return found or MemoryFault(record.address, record.reason, record.mask)

    # ---- runtime -----------------------------------------------------------------------------
    @hsa_function
    def hsa_init(self) -> int:
        """Reference-counted like ROCr: the first call builds the agents, the last shut-down ends them."""
        with self._lock:
            if self._init_count == 0:
                self._state = self._build()
            self._init_count += 1
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_shut_down(self) -> int:
        with self._lock:
            require(self._init_count > 0, T.HSA_STATUS_ERROR_NOT_INITIALIZED, "not initialised")
            self._init_count -= 1
            if self._init_count:
                return T.HSA_STATUS_SUCCESS
            state, self._state = self._state, None
        state.close()
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_status_string(self, status: int, out: Any) -> int:
        require(out, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL status_string")
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = self._strings.address(status)
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_system_get_info(self, attribute: int, value: int | None) -> int:
        system_info(attribute, value)
        return T.HSA_STATUS_SUCCESS

    # ---- agents and memory -------------------------------------------------------------------
    @hsa_function
    def hsa_iterate_agents(self, callback: Any, data: Any) -> int:
        return self._ctx().agents.iterate(callback, data)

    @hsa_function
    def hsa_agent_get_info(self, agent: T.hsa_agent_t, attribute: int, value: int | None) -> int:
        agent_info(self._agent(agent), attribute, value, self.min_queue_size)
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_amd_agent_iterate_memory_pools(self, agent: T.hsa_agent_t, callback: Any, data: Any) -> int:
        require(callback, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL callback")
        for pool in self._ctx().memory.pools_of(self._agent(agent).handle):
            status = callback(T.hsa_amd_memory_pool_t(pool.handle), data)
            if status != T.HSA_STATUS_SUCCESS:
                return status
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_amd_memory_pool_get_info(self, pool: T.hsa_amd_memory_pool_t, attribute: int, value: int | None) -> int:
        memory = self._ctx().memory
        memory.pool_info(memory.pool(pool.handle), attribute, value)
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_amd_memory_pool_allocate(self, pool: T.hsa_amd_memory_pool_t, size: int, flags: int, ptr: Any) -> int:
        require(ptr, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL ptr")
        memory = self._ctx().memory
        ptr[0] = memory.allocate(memory.pool(pool.handle), size)
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_amd_memory_pool_free(self, ptr: int | None) -> int:
        self._ctx().memory.free(address_of(ptr))
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_amd_agents_allow_access(self, num_agents: int, agents: Any, flags: Any, ptr: int | None) -> int:
        require(num_agents > 0 and agents and ptr, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "no agents or NULL ptr")
        gpus = [self._agent(agents[i]).gpu for i in range(num_agents)]
        self._ctx().memory.allow_access([g for g in gpus if g is not None], address_of(ptr))
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_amd_memory_lock(self, host_ptr: int | None, size: int, agents: Any, num_agent: int,
                            agent_ptr: Any) -> int:
        """Lock host memory for the given agents (all GPUs when agents is NULL and num_agent 0)."""
        require(agent_ptr and bool(agents) == (num_agent > 0), T.HSA_STATUS_ERROR_INVALID_ARGUMENT,
                "agent_ptr NULL, or agents and num_agent disagree")
        ctx = self._ctx()
        listed = [self._agent(agents[i]) for i in range(num_agent)] if agents else ctx.agents.gpus
        address = ctx.memory.lock(address_of(host_ptr), size, [a.gpu for a in listed if a.is_gpu])
        agent_ptr[0] = address
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_amd_memory_unlock(self, host_ptr: int | None) -> int:
        self._ctx().memory.unlock(address_of(host_ptr))
        return T.HSA_STATUS_SUCCESS

    # ---- signals -----------------------------------------------------------------------------
    @hsa_function
    def hsa_signal_create(self, initial_value: int, num_consumers: int, consumers: Any, signal: Any) -> int:
        """ROCr: hsa_amd_signal_create with no attributes (an interrupt signal, see signals)."""
        return self._create_signal(initial_value, num_consumers, consumers, 0, signal)

    @hsa_function
    def hsa_amd_signal_create(self, initial_value: int, num_consumers: int, consumers: Any, attributes: int,
                              signal: Any) -> int:
        """ROCr (hsa_ext_amd.cpp): AMD_GPU_ONLY or IPC, or consumers that do not include the CPU,
        make a busy-wait signal without an interrupt event; otherwise an interrupt signal (with a
        KFD event while any is left). Duplicate consumers are INVALID_ARGUMENT. Every emulated
        signal's value is host-visible memory."""
        return self._create_signal(initial_value, num_consumers, consumers, attributes, signal)

    @hsa_function
    def hsa_signal_destroy(self, signal: T.hsa_signal_t) -> int:
        self._ctx().signals.destroy(signal.handle)
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_signal_load_scacquire(self, signal: T.hsa_signal_t) -> int:
        return self._signal(signal).load()

    @hsa_function
    def hsa_signal_load_relaxed(self, signal: T.hsa_signal_t) -> int:
        return self._signal(signal).load()

    @hsa_function
    def hsa_signal_store_relaxed(self, signal: T.hsa_signal_t, value: int) -> None:
        self._signal(signal).store(value)

    @hsa_function
    def hsa_signal_store_screlease(self, signal: T.hsa_signal_t, value: int) -> None:
        self._signal(signal).store(value)

    @hsa_function
    def hsa_signal_add_scacq_screl(self, signal: T.hsa_signal_t, value: int) -> None:
        self._signal(signal).add(value)

    @hsa_function
    def hsa_signal_add_relaxed(self, signal: T.hsa_signal_t, value: int) -> None:
        self._signal(signal).add(value)

    @hsa_function
    def hsa_signal_subtract_scacq_screl(self, signal: T.hsa_signal_t, value: int) -> None:
        self._signal(signal).add(-value)

    @hsa_function
    def hsa_signal_subtract_relaxed(self, signal: T.hsa_signal_t, value: int) -> None:
        self._signal(signal).add(-value)

    @hsa_function
    def hsa_signal_wait_scacquire(self, signal: T.hsa_signal_t, condition: int, compare_value: int,
                                  timeout_hint: int, wait_state_hint: int) -> int:
        """Blocks until the condition holds or the timeout passes; returns the observed value."""
        s = self._signal(signal)
        table = self._ctx().signals
        table.account_wait([s], wait_state_hint == T.HSA_WAIT_STATE_ACTIVE)
        found = table.wait_any([s], [condition], [compare_value], timeout_seconds(timeout_hint))
        return found[1] if found is not None and found[0] == 0 else s.load()

    @hsa_function
    def hsa_amd_signal_wait_any(self, signal_count: int, signals: Any, conds: Any, values: Any,
                                timeout_hint: int, wait_hint: int, satisfying_value: Any) -> int:
        """Index of the first satisfied signal; UINT32_MAX on timeout, for a destroyed signal or
        an unknown condition (ROCr: Signal::WaitAny; its spinning is counted, see signals)."""
        require(signal_count > 0 and signals and conds and values, T.HSA_STATUS_ERROR_INVALID_ARGUMENT,
                "empty or NULL signal/condition/value arrays")
        table = self._ctx().signals
        found_signals = [table.lookup(signals[i].handle) for i in range(signal_count)]
        table.account_wait(found_signals, wait_hint == T.HSA_WAIT_STATE_ACTIVE)
        if any(s is None for s in found_signals):
            return UINT32_MAX  # destroyed before the call
        found = table.wait_any(found_signals, [conds[i] for i in range(signal_count)],
                               [values[i] for i in range(signal_count)], timeout_seconds(timeout_hint))
        if found is None or found[0] == UINT32_MAX:
            return UINT32_MAX
        if satisfying_value:
            satisfying_value[0] = found[1]
        return found[0]

    @hsa_function
    def hsa_amd_signal_async_handler(self, signal: T.hsa_signal_t, cond: int, value: int, handler: Any,
                                     arg: Any) -> int:
        """ROCr's checks (hsa_ext_amd.cpp): a handler, a live signal, and one with an interrupt
        event (INVALID_SIGNAL otherwise: ROCr's events thread sleeps on events); then the
        handler runs on the emulator's events thread (see async_handlers). ROCr does not check
        the condition; the emulator refuses an unknown one (INVALID_ARGUMENT), which ROCr would
        never call."""
        state = self._require_state()
        require(handler, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL handler")
        target = state.ctx.signals.get(signal.handle)
        require(target.interrupt, T.HSA_STATUS_ERROR_INVALID_SIGNAL, "not an interrupt signal")
        require(cond in CONDITIONS, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, f"condition {cond}")
        state.async_handlers.register(target, int(cond), int(value), handler, arg)
        return T.HSA_STATUS_SUCCESS

    # ---- queues ------------------------------------------------------------------------------
    @hsa_function
    def hsa_queue_create(self, agent: T.hsa_agent_t, size: int, queue_type: int, callback: Any, data: Any,
                         private_segment_size: int, group_segment_size: int, queue: Any) -> int:
        require(queue, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL queue pointer")
        state = self._require_state()
        owner = self._agent(agent)
        state.queues.validate(owner, size, queue_type, self.min_queue_size)
        doorbell = state.ctx.signals.create(-1)
        q = Queue(owner, state.queues.new_id(), size, queue_type, callback, data, doorbell)
        q.event = state.ctx.signals.events.take()  # ROCr: AqlQueue's queue_event (inactive/exception)
        q.processor = PacketProcessor(state.ctx, q)
        state.queues.add(q)
        q.processor.start()
        if owner.gpu in state.evicted:      # KFD: created evicted (see _State.evict)
            q.processor.evict()
        queue[0] = q.pointer
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_queue_destroy(self, queue: Any) -> int:
        state = self._require_state()
        q = state.queues.get(queue)
        state.queues.remove(q)
        q.processor.stop()
        state.ctx.signals.destroy(q.doorbell.address)
        state.ctx.signals.events.give(q.event)
        q.release()
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_amd_queue_set_priority(self, queue: Any, priority: int) -> int:
        """Records the priority (``Queue.priority``; the emulated packet processors all run
        alike); a suspended queue is INVALID_QUEUE, an unknown priority INVALID_ARGUMENT, as in
        ROCr (hsa_amd_queue_set_priority -> AqlQueue::SetPriority)."""
        q = self._queue(queue)
        require(not q.processor.suspended, T.HSA_STATUS_ERROR_INVALID_QUEUE, "queue suspended by an error")
        require(T.HSA_AMD_QUEUE_PRIORITY_LOW <= priority <= T.HSA_AMD_QUEUE_PRIORITY_HIGH,
                T.HSA_STATUS_ERROR_INVALID_ARGUMENT, f"priority {priority}")
        q.priority = int(priority)
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_queue_load_write_index_scacquire(self, queue: Any) -> int:
        return self._queue(queue).load_write_index()

    @hsa_function
    def hsa_queue_load_write_index_relaxed(self, queue: Any) -> int:
        return self._queue(queue).load_write_index()

    @hsa_function
    def hsa_queue_store_write_index_screlease(self, queue: Any, value: int) -> None:
        self._queue(queue).store_write_index(value)

    @hsa_function
    def hsa_queue_add_write_index_scacq_screl(self, queue: Any, value: int) -> int:
        return self._queue(queue).add_write_index(value)

    @hsa_function
    def hsa_queue_cas_write_index_scacq_screl(self, queue: Any, expected: int, value: int) -> int:
        return self._queue(queue).cas_write_index(expected, value)

    @hsa_function
    def hsa_queue_load_read_index_scacquire(self, queue: Any) -> int:
        return self._queue(queue).load_read_index()

    # ---- copies ------------------------------------------------------------------------------
    @hsa_function
    def hsa_amd_memory_async_copy(self, dst: int | None, dst_agent: T.hsa_agent_t, src: int | None,
                                  src_agent: T.hsa_agent_t, size: int, num_dep_signals: int, dep_signals: Any,
                                  completion_signal: T.hsa_signal_t) -> int:
        return self._copy(dst, dst_agent, src, src_agent, size, num_dep_signals, dep_signals,
                          completion_signal, None)

    @hsa_function
    def hsa_amd_memory_async_copy_on_engine(self, dst: int | None, dst_agent: T.hsa_agent_t, src: int | None,
                                            src_agent: T.hsa_agent_t, size: int, num_dep_signals: int,
                                            dep_signals: Any, completion_signal: T.hsa_signal_t,
                                            engine_id: int, force_copy_on_sdma: bool) -> int:
        return self._copy(dst, dst_agent, src, src_agent, size, num_dep_signals, dep_signals,
                          completion_signal, engine_id, bool(force_copy_on_sdma))

    @hsa_function
    def hsa_amd_memory_copy_engine_status(self, dst_agent: T.hsa_agent_t, src_agent: T.hsa_agent_t,
                                          engine_ids_mask: Any) -> int:
        """ROCr: Runtime::CopyMemoryStatus / GpuAgent::DmaCopyStatus (see sdma): the mask is
        written (0 when none is free) and an empty one is OUT_OF_RESOURCES."""
        state = self._require_state()
        dst, src = self._agent(dst_agent), self._agent(src_agent)
        require(engine_ids_mask, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL engine_ids_mask")
        try:
            mask = state.copies.status(dst, src)
        except StatusError as exc:
            if exc.status == T.HSA_STATUS_ERROR_OUT_OF_RESOURCES:
                store_out(engine_ids_mask, 0)
            raise
        store_out(engine_ids_mask, mask)
        return T.HSA_STATUS_SUCCESS

    # ---- code objects ------------------------------------------------------------------------
    @hsa_function
    def hsa_code_object_reader_create_from_memory(self, code_object: int | None, size: int, reader: Any) -> int:
        handle = self._ctx().code.create_reader(address_of(code_object), size)
        with self._lock:
            self._require_state().readers[handle] = (address_of(code_object), size)
        store_handle(reader, handle)
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_code_object_reader_destroy(self, reader: T.hsa_code_object_reader_t) -> int:
        self._ctx().code.destroy_reader(reader.handle)
        with self._lock:
            self._require_state().readers.pop(reader.handle, None)
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_executable_create_alt(self, profile: int, rounding_mode: int, options: bytes | None,
                                  executable: Any) -> int:
        require(executable, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL executable")
        store_handle(executable, self._ctx().code.create_executable())
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_executable_load_agent_code_object(self, executable: T.hsa_executable_t, agent: T.hsa_agent_t,
                                              reader: T.hsa_code_object_reader_t, options: bytes | None,
                                              loaded_code_object: Any) -> int:
        gpu = self._agent(agent)
        require(gpu.is_gpu, T.HSA_STATUS_ERROR_INVALID_AGENT, "code objects load on GPU agents")
        handle = self._ctx().code.load(executable.handle, gpu.gpu, reader.handle)
        state = self._require_state()
        with self._lock:
            address, size = state.readers[reader.handle]
            state.link_map.setdefault(executable.handle, []).append((address, size, ctypes.string_at(address, size)))
            state.exe_gpus.setdefault(executable.handle, set()).add(gpu.gpu)
        if loaded_code_object:
            loaded_code_object[0].handle = handle
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_executable_freeze(self, executable: T.hsa_executable_t, options: bytes | None) -> int:
        """ROCr copies the code segments to the agents here (RegionMemory::Freeze ->
        GpuAgent::DmaCopy on its blit): on a device KFD keeps evicted that never finishes. The
        emulator cannot usefully hang: it records the call as a bug of the caller instead."""
        state = self._require_state()
        with self._lock:
            stuck = state.exe_gpus.get(executable.handle, set()) & state.evicted
        if stuck:
            raise RuntimeError(f"hsa_executable_freeze for evicted GPU(s) {sorted(stuck)}: ROCr would wait "
                               f"forever for its evicted blit queue (a memory fault lost the device)")
        self._ctx().code.freeze(executable.handle)
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_executable_destroy(self, executable: T.hsa_executable_t) -> int:
        self._ctx().code.destroy_executable(executable.handle)
        with self._lock:
            self._require_state().link_map.pop(executable.handle, None)
            self._require_state().exe_gpus.pop(executable.handle, None)
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_executable_get_symbol_by_name(self, executable: T.hsa_executable_t, symbol_name: bytes | None,
                                          agent: Any, symbol: Any) -> int:
        require(symbol_name is not None and symbol, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL name or symbol")
        gpu = self._agent(agent[0]).gpu if agent else None
        store_handle(symbol, self._ctx().code.symbol(executable.handle, symbol_name.decode(), gpu))
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_executable_symbol_get_info(self, symbol: T.hsa_executable_symbol_t, attribute: int,
                                       value: int | None) -> int:
        self._ctx().code.symbol_info(symbol.handle, attribute, value)
        return T.HSA_STATUS_SUCCESS

    # ---- events and profiling ----------------------------------------------------------------
    @hsa_function
    def hsa_amd_register_system_event_handler(self, callback: Any, data: Any) -> int:
        require(callback, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL callback")
        self._ctx().events.register(callback, data)
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_amd_profiling_set_profiler_enabled(self, queue: Any, enable: int) -> int:
        """Accepted; timestamps are always recorded."""
        self._queue(queue)
        return T.HSA_STATUS_SUCCESS

    @hsa_function
    def hsa_amd_profiling_get_dispatch_time(self, agent: T.hsa_agent_t, signal: T.hsa_signal_t, time: Any) -> int:
        require(self._agent(agent).is_gpu and time, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "GPU agent and output")
        start, end = self._signal(signal).timestamps()
        time[0].start, time[0].end = start, end
        return T.HSA_STATUS_SUCCESS

    # ---- internals ---------------------------------------------------------------------------
    def _build(self) -> _State:
        agents = AgentTable(self.gpus, self.compute_units)
        compute = [ComputeUnits(f"{self.name}-gpu{a.gpu}", self.compute_units, self._record) for a in agents.gpus]
        ctx = Context(agents=agents, memory=MemoryManager(agents.cpu.handle, [a.handle for a in agents.gpus]),
                      signals=SignalTable(self.event_limit), code=CodeObjects(), events=SystemEvents(self.memory_faults),
                      faults=self.faults, timeline=self.timeline, compute=compute, report_bug=self._record,
                      min_queue_size=self.min_queue_size, name=self.name, queue_errors=self.queue_errors,
                      kernarg_mismatches=self.kernarg_mismatches)
        copies = CopyEngines(ctx, self.sdma_engines, self.xgmi_engines, self.engine_history_records)
        state = _State(ctx, copies, self.evicted)
        for gpu in self.evicted:    # a new init cycle in the same (emulated) process: still evicted
            copies.evict(gpu)
        ctx.events.evict = state.evict
        return state

    def _record(self, where: str, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.api_errors.append(ApiError(where, exc, tb))

    def _interrupted(self, name: str, args: tuple, default: Any) -> Any:
        """What a call stopped by an interrupt returns (the caller gets the interrupt as soon
        as it runs Python again): a blocking wait reports a timeout."""
        if name == "hsa_amd_signal_wait_any":
            return UINT32_MAX
        if name == "hsa_signal_wait_scacquire":
            try:
                return self._signal(args[0]).load()
            except Exception:
                return default
        return default

    def _require_state(self) -> _State:
        state = self._state
        if state is None:
            raise StatusError(T.HSA_STATUS_ERROR_NOT_INITIALIZED, "hsa_init has not been called")
        return state

    def _ctx(self) -> Context:
        return self._require_state().ctx

    def _agent(self, agent: Any) -> Agent:
        return self._ctx().agents.get(agent.handle)

    def _signal(self, signal: T.hsa_signal_t) -> Signal:
        return self._ctx().signals.get(signal.handle)

    def _queue(self, queue: Any) -> Queue:
        return self._require_state().queues.get(queue)

    def _create_signal(self, initial_value: int, num_consumers: int, consumers: Any, attributes: int,
                       signal: Any) -> int:
        require(signal, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL signal")
        interrupt = not attributes & (T.HSA_AMD_SIGNAL_AMD_GPU_ONLY | T.HSA_AMD_SIGNAL_IPC)
        if interrupt and num_consumers:
            require(consumers, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL consumers")
            agents = [self._agent(consumers[i]) for i in range(num_consumers)]
            require(len({a.handle for a in agents}) == num_consumers, T.HSA_STATUS_ERROR_INVALID_ARGUMENT,
                    "duplicate consumers")
            interrupt = any(not a.is_gpu for a in agents)  # only the CPU waits on interrupts
        store_handle(signal, self._ctx().signals.create(initial_value, interrupt).address)
        return T.HSA_STATUS_SUCCESS

    def _copy(self, dst: int | None, dst_agent: Any, src: int | None, src_agent: Any, size: int, num_deps: int,
              deps: Any, completion: T.hsa_signal_t, engine_bit: int | None, force_sdma: bool = False) -> int:
        """ROCr's argument checks, then an engine of the copy agent (see sdma)."""
        state = self._require_state()
        require(dst and src, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL dst or src")
        require(bool(deps) == (num_deps > 0), T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "dep_signals and count disagree")
        dst_owner, src_owner = self._agent(dst_agent), self._agent(src_agent)
        dep_signals = [self._signal(deps[i]) for i in range(num_deps)]
        done = self._signal(completion)
        if size == 0:
            return T.HSA_STATUS_SUCCESS  # ROCr: nothing to copy, nothing signalled
        state.copies.submit(address_of(dst), dst_owner, address_of(src), src_owner, size, dep_signals, done,
                            engine_bit, force_sdma)
        return T.HSA_STATUS_SUCCESS

    def _wake_processors(self) -> None:
        state = self._state
        if state is not None:
            for q in state.queues.all():
                q.processor.wake()
