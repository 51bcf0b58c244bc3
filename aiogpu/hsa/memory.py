"""Host memory on HSA: arrays locked for the agents while GPU work uses them.

Host memory that the GPU reads is pageable memory locked with ``hsa_amd_memory_lock`` (full
system memory), not GTT.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

from ..hsa_bindings import types as T


class HostLocks:
    """Host arrays locked for the agents while GPU work uses them (pageable memory, not GTT).

    Locks are counted per (address, size), so overlapping operations on one array share a lock;
    the range is unlocked when the last of them retires.
    """

    def __init__(self, api: Any, agents: Callable[[], list]):
        self._api, self._agents = api, agents
        self._locks: dict[tuple[int, int], list[int]] = {}  # (addr, size) -> [count, agent_ptr]

    def lock(self, addr: int, size: int) -> int:
        key = (addr, size)
        entry = self._locks.get(key)
        if entry is None:
            agents = self._agents()
            arr = (T.hsa_agent_t * len(agents))(*agents)
            out = ctypes.c_void_p()
            self._api.check(self._api.hsa_amd_memory_lock(addr, size, arr, len(agents), ctypes.byref(out)),
                            "hsa_amd_memory_lock")
            entry = self._locks[key] = [0, out.value]
        entry[0] += 1
        return entry[1]

    def unlock(self, addr: int, size: int) -> None:
        key = (addr, size)
        entry = self._locks[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._locks[key]
            self._api.hsa_amd_memory_unlock(addr)

    @property
    def count(self) -> int:
        return len(self._locks)
