"""What runs before what: buffer hazards and ``after=`` edges become dependencies.

Every operation declares what it reads and writes. It depends on the last writer of what it reads
(read after write), and on the last writer and the readers since of what it writes (write after
write, write after read). Read-after-write and ``after=`` edges are *semantic*: if the earlier
operation fails, so does the later. The others only order: work that overwrites a buffer does not
fail because an earlier writer of it did.
"""
from __future__ import annotations

from typing import Any, Iterable

from .errors import GPUError
from .futures import GPUFuture


class HostRange:
    """Ordering state of a host array's memory (keyed by address and size)."""

    __slots__ = ("last_write", "reads", "key")

    def __init__(self, key: tuple[int, int]):
        self.key = key
        self.last_write: GPUFuture | None = None
        self.reads: list[GPUFuture] = []


class Hazards:
    """Ordering state of host ranges; buffers carry theirs (``last_write``/``reads``) themselves."""

    def __init__(self):
        self._host: dict[tuple[int, int], HostRange] = {}

    def host(self, address: int, nbytes: int) -> HostRange:
        key = (address, nbytes)
        state = self._host.get(key)
        if state is None:
            state = self._host[key] = HostRange(key)
        return state

    def prune_host(self, state: HostRange) -> None:
        _prune(state)
        if state.last_write is None and not state.reads:
            self._host.pop(state.key, None)

    @property
    def host_ranges(self) -> int:
        return len(self._host)


def _prune(state: Any) -> None:
    # A writer that failed stays the last writer even once retired: the memory's contents are
    # undefined, so later readers fail (read after a failed write) until something overwrites it.
    # Host memory is exempt: its addresses are reused by unrelated arrays.
    last = state.last_write
    if last is not None and last.retired and (last._exc is None or isinstance(state, HostRange)):
        state.last_write = None
    state.reads = [f for f in state.reads if not f.retired]


def dependencies(reads: Iterable[Any], writes: Iterable[Any], after: Iterable[GPUFuture]) -> dict[GPUFuture, bool]:
    """{earlier future: semantic} for an operation touching ``reads``/``writes`` states."""
    deps: dict[GPUFuture, bool] = {}

    def add(fut: GPUFuture | None, semantic: bool) -> None:
        for f in _live(fut):
            deps[f] = deps.get(f, False) or semantic

    def add_semantic(fut: GPUFuture | None) -> None:
        if fut is not None:
            deps[fut] = True  # retired ones too: failed_dependency checks them

    for fut in after:
        add_semantic(fut)
    writes = list(writes)
    for state in reads:
        _prune(state)
        add_semantic(state.last_write)
    for state in writes:
        _prune(state)
        add(state.last_write, False)
        for reader in state.reads:
            add(reader, False)
    return deps


def _live(fut: GPUFuture | None) -> list[GPUFuture]:
    """The unretired work that ordering after ``fut`` means waiting for: ``fut`` itself, or, if
    it failed and retired without running (its queue was aborted, or it was never submitted),
    what it was itself ordered after, which may still be running (followed iteratively: long
    chains of failures must not exhaust the stack)."""
    out: list[GPUFuture] = []
    stack, seen = [fut], set()
    while stack:
        f = stack.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        if not f.retired:
            out.append(f)
        elif f._exc is not None:
            f.preds = [p for p in f.preds if not p.retired or p._exc is not None]
            stack.extend(f.preds)
    return out


def failed_dependency(deps: dict[GPUFuture, bool]) -> GPUError | None:
    """A GPUError for the first semantic dependency that failed, else None."""
    for fut, semantic in deps.items():
        if semantic and fut._exc is not None:     # (failed: settled by the hub, never polled)
            err = GPUError(f"a dependency failed ({fut.label}: {fut._exc})",
                           status=getattr(fut._exc, "status", None))
            err.__cause__ = fut._exc
            return err
    return None


def failed_without_running(hub: Any, label: str, err: GPUError, writes: Iterable[Any]) -> GPUFuture:
    """A future for work not submitted because an input failed. It still becomes the last
    writer of what the work would have written: that memory now holds no defined result, so its
    readers fail too (until something overwrites it)."""
    from .futures import completed_future

    fut = completed_future(hub, label, err)
    writes = list(writes)
    for state in writes:
        _prune(state)
        fut.preds.extend(f for f in [state.last_write, *state.reads] if f is not None)
    record(fut, [], writes)
    return fut


def record(fut: GPUFuture, reads: Iterable[Any], writes: Iterable[Any], deps: Iterable[GPUFuture] = ()) -> None:
    """Make ``fut`` the last writer of ``writes`` and a reader of the other ``reads``; ``deps``
    (what it waits for) are remembered in case it fails without running."""
    fut.preds.extend(d for d in deps if not d.retired)
    writes = list(writes)
    for state in writes:
        state.last_write = fut
        state.reads = []
    for state in reads:
        if not any(state is w for w in writes):
            state.reads.append(fut)
