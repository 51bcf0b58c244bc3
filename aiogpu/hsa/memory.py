"""Host memory on HSA: arrays locked for the agents while GPU work uses them.

Host memory that the GPU reads is pageable memory locked with ``hsa_amd_memory_lock`` (full
system memory), not GTT.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

from ..hsa_bindings import types as T


class HostLocks:
    """Host arrays locked for the agents while GPU work uses them (pageable memory, not GTT).

    ``hsa_amd_memory_lock`` registers a range and returns the address agents must use for it,
    which may differ from the host address (libhsakmt's alternate VA). ``hsa_amd_memory_unlock``
    takes only the start address and, when two registrations start there, unlocks neither
    (ROCr: MemoryRegion::Unlock; libhsakmt finds the registration by its start only). So no two
    registrations here share a start: a range inside an existing registration uses it, else the
    array's root buffer (the whole memory its NumPy views share) is registered, so overlapping
    views of one array share one registration. Registrations are counted per use and unlocked
    when the last use retires. Call under the runtime lock.
    """

    def __init__(self, api: Any, agents: Callable[[], list]):
        self._api, self._agents = api, agents
        self._regs: dict[int, list[int]] = {}          # start -> [size, uses, agent address]
        self._uses: dict[tuple[int, int], list[int]] = {}   # (addr, size) -> [uses, registration start]

    def lock(self, addr: int, size: int, owner: Any = None) -> int:
        """Lock [addr, addr + size) (``owner``: the NumPy array holding it, whose root buffer is
        registered); returns the agent address of ``addr``. Raises ValueError if the memory
        can only be registered at a start another registration has (never for NumPy views of
        one buffer), HsaError if ROCr refuses."""
        use = self._uses.get((addr, size))
        if use is None:
            start = self._containing(addr, size)
            if start is None:
                start, length = root_range(owner, addr, size)
                if start in self._regs:
                    raise ValueError(f"host memory at 0x{start:x} is already locked as a range of "
                                     f"{self._regs[start][0]} bytes; ROCr cannot unlock two ranges with "
                                     f"one start address")
                self._regs[start] = [length, 0, self.register(start, length)]
            use = self._uses[(addr, size)] = [0, start]
        use[0] += 1
        reg = self._regs[use[1]]
        reg[1] += 1
        return reg[2] + (addr - use[1])

    def unlock(self, addr: int, size: int) -> None:
        """One use of [addr, addr + size) retired; the registration goes with its last use."""
        use = self._uses[(addr, size)]
        use[0] -= 1
        if use[0] == 0:
            del self._uses[(addr, size)]
        reg = self._regs[use[1]]
        reg[1] -= 1
        if reg[1] == 0:
            del self._regs[use[1]]
            self._api.hsa_amd_memory_unlock(use[1])

    def to_host(self, agent_address: int) -> int | None:
        """The host address behind an agent address of a registration (fault attribution)."""
        for start, (length, _uses, agent) in self._regs.items():
            if agent <= agent_address < agent + length:
                return start + agent_address - agent
        return None

    @property
    def count(self) -> int:
        return len(self._regs)

    def _containing(self, addr: int, size: int) -> int | None:
        return next((start for start, (length, _u, _a) in self._regs.items()
                     if start <= addr and addr + size <= start + length), None)

    def register(self, start: int, length: int) -> int:
        """Lock [start, start + length) for every agent (no use count); the agents' address."""
        agents = self._agents()
        arr = (T.hsa_agent_t * len(agents))(*agents)
        out = ctypes.c_void_p()
        self._api.check(self._api.hsa_amd_memory_lock(start, length, arr, len(agents), ctypes.byref(out)),
                        "hsa_amd_memory_lock")
        return out.value


def root_range(owner: Any, addr: int, size: int) -> tuple[int, int]:
    """(start, size) of the buffer that ``owner`` (a NumPy array) views, when it contains
    [addr, addr + size); else that range itself."""
    if isinstance(owner, np.ndarray):
        root = owner
        while isinstance(root.base, np.ndarray):
            root = root.base
        start, length = root.__array_interface__["data"][0], root.nbytes
        if root.base is not None:   # a view of another buffer (bytes, mmap, ctypes...): all of it
            try:
                whole = np.frombuffer(root.base, dtype=np.uint8)
                start, length = whole.__array_interface__["data"][0], whole.nbytes
            except (TypeError, ValueError, BufferError):
                pass
        if start <= addr and addr + size <= start + length:
            return start, length
    return addr, size
