"""What runs before what: buffer hazards and ``after=`` edges become dependencies.

Every operation declares what it reads and writes. It depends on the last writer of what it reads
(read after write), and on the last writer and the readers since of what it writes (write after
write, write after read). Read-after-write and ``after=`` edges are *semantic*: if the earlier
operation fails, so does the later. The others only order: work that overwrites a buffer does not
fail because an earlier writer of it did.

One rule, on byte ranges: two operations conflict where the bytes they touch overlap. A Buffer
used only whole keeps its state in two fields (``last_write``, ``reads``: the fast path); once a
view of part of it is used, its state moves to a ``Hazards`` of byte ranges (``Buffer.ranges``),
and back to the fields once nothing unretired is left there. Host memory and other libraries'
device memory are ranges of the runtime's own ``Hazards``, by address.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING, Any, Iterable

from ..errors import DeviceLost, GPUError
from .futures import GPUFuture, add_preds, completed_future, preds_list


class HostRange:
    """One operation's view of bytes ``[start, end)`` of a ``Hazards``: host memory and other
    libraries' device arrays (by address), or part of a Buffer (by offset; ``buffer`` is then
    the allocation). Its ordering state is that of every overlapping range its ``Hazards``
    records, whatever arrays or views those came from: a slice, a view or another array over
    the same bytes conflicts with it exactly where their bytes overlap."""

    __slots__ = ("hazards", "start", "end", "buffer")

    def __init__(self, hazards: "Hazards", start: int, end: int, buffer: Any = None):
        self.hazards, self.start, self.end, self.buffer = hazards, start, end, buffer

    def writers(self) -> list[GPUFuture]:
        """The unretired last writers of the overlapping bytes."""
        return self.hazards._collect(self.start, self.end, True)

    def readers(self) -> list[GPUFuture]:
        """The unretired readers of the overlapping bytes since their last write."""
        return self.hazards._collect(self.start, self.end, False)

    @property
    def last_write(self) -> GPUFuture | None:
        """The newest unretired writer of any overlapping byte, else None."""
        return self.hazards._newest_writer(self.start, self.end)

    def written_by(self, fut: GPUFuture) -> bool:
        """Whether ``fut`` is the last writer of every byte of this range."""
        return self.hazards._written_by(self.start, self.end, fut)


class _Segment:
    """Bytes ``[start, end)`` with one ordering state: their last writer and the readers since."""

    __slots__ = ("start", "end", "last_write", "reads", "seq")

    def __init__(self, start: int, end: int, last_write: GPUFuture | None, reads: list, seq: int):
        self.start, self.end, self.last_write, self.reads, self.seq = start, end, last_write, reads, seq


def _range(hazards: "Hazards", start: int, end: int, buffer: Any) -> HostRange:
    """``HostRange(hazards, start, end, buffer)``, made without a call to ``__init__`` (per
    operation on host memory)."""
    r = HostRange.__new__(HostRange)
    r.hazards, r.start, r.end, r.buffer = hazards, start, end, buffer
    return r


def _segment(start: int, end: int, last_write: Any, reads: list, seq: int) -> _Segment:
    """``_Segment(start, end, last_write, reads, seq)``, made without a call to ``__init__``."""
    seg = _Segment.__new__(_Segment)
    seg.start, seg.end, seg.last_write, seg.reads, seg.seq = start, end, last_write, reads, seq
    return seg


class Hazards:
    """Ordering state of memory by byte range: the runtime's host memory (and other libraries'
    device arrays) by address, and a Buffer's bytes by offset once views of it are used.

    Memory is kept as disjoint segments sorted by address (``_starts`` parallels
    ``_segs``): a lookup bisects to the overlapping run, so its cost grows with the number of
    overlapping segments, not with the number of ranges in use. A write replaces the segments it
    covers; a read joins them (splitting at its ends). A segment goes once nothing unretired
    uses it. Host memory does not keep failed writers (its addresses are reused by unrelated
    arrays); a Buffer's ranges do (``keep_failed``): what a failed write left undefined reads as
    failed until something overwrites it, as for a whole buffer.
    """

    def __init__(self, keep_failed: bool = False):
        self._starts: list[int] = []
        self._segs: list[_Segment] = []
        self._seq = 0
        self.keep_failed = keep_failed

    def host(self, address: int, nbytes: int) -> HostRange:
        """The ordering state of ``nbytes`` of host memory at ``address``."""
        return _range(self, address, address + nbytes, None)

    def prune_host(self, state: HostRange) -> None:
        """Forget what has retired in ``state``'s bytes (an operation on them retired)."""
        self.prune(state.start, state.end)

    @property
    def host_ranges(self) -> int:
        return len(self._segs)

    # -- segments ----------------------------------------------------------------------------------
    def _span(self, start: int, end: int) -> tuple[int, int]:
        """Indices [i, j) of the segments overlapping [start, end)."""
        i = bisect_right(self._starts, start) - 1
        if i < 0 or self._segs[i].end <= start:
            i += 1
        return i, bisect_left(self._starts, end, i)

    def prune(self, start: int, end: int) -> None:
        if not self._segs:              # (nothing recorded: the common case of host memory)
            return
        i, j = self._span(start, end)
        if i == j:
            return
        segs = self._segs
        k = j
        while k > i:                    # (backwards: a segment that goes is deleted in place)
            k -= 1
            seg = segs[k]
            last = seg.last_write
            if last is not None and last.retired and not (self.keep_failed and last._exc is not None):
                seg.last_write = None
            reads = seg.reads
            for f in reads:             # (a new list only when something retired)
                if f.retired:
                    seg.reads = reads = [f for f in reads if not f.retired]
                    break
            if seg.last_write is None and not reads:
                del segs[k]
                del self._starts[k]

    def _split(self, at: int) -> None:
        """Make ``at`` a segment boundary."""
        i = bisect_right(self._starts, at) - 1
        if i >= 0 and self._segs[i].start < at < self._segs[i].end:
            seg = self._segs[i]
            right = _segment(at, seg.end, seg.last_write, list(seg.reads), seg.seq)
            seg.end = at
            self._segs.insert(i + 1, right)
            self._starts.insert(i + 1, at)

    def _collect(self, start: int, end: int, writers: bool) -> list[GPUFuture]:
        if not self._segs:
            return []
        i, j = self._span(start, end)
        if i == j:          # nothing overlaps (the common case of a host array): nothing to prune
            return []
        self.prune(start, end)
        i, j = self._span(start, end)
        out: dict[int, GPUFuture] = {}
        for seg in self._segs[i:j]:
            for f in ([seg.last_write] if writers else seg.reads):
                if f is not None:
                    out[id(f)] = f
        return list(out.values())

    def _newest_writer(self, start: int, end: int) -> GPUFuture | None:
        if not self._segs:
            return None
        i, j = self._span(start, end)
        if i == j:          # nothing overlaps (the common case of a host array): nothing to prune
            return None
        self.prune(start, end)
        i, j = self._span(start, end)
        newest = None                   # the first of the highest seq (no closure: it compiles to a C call)
        for seg in self._segs[i:j]:
            if seg.last_write is not None and (newest is None or seg.seq > newest.seq):
                newest = seg
        return newest.last_write if newest is not None else None

    def _written_by(self, start: int, end: int, fut: GPUFuture) -> bool:
        i, j = self._span(start, end)
        at = start
        for seg in self._segs[i:j]:
            if seg.start > at or seg.last_write is not fut:
                return False
            at = seg.end
        return at >= end

    def _record(self, start: int, end: int, fut: GPUFuture, write: bool) -> None:
        if start >= end:
            return
        i, j = self._span(start, end)
        if i == j:                      # nothing recorded there (the common case of host
            if write:                   # memory): one new segment, nothing to split
                self._seq += 1
                seg = _segment(start, end, fut, [], self._seq)
            else:
                seg = _segment(start, end, None, [fut], 0)
            self._segs.insert(i, seg)
            self._starts.insert(i, start)
            return
        self._split(start)
        self._split(end)
        i, j = self._span(start, end)
        if write:               # one segment replaces those it covers
            self._seq += 1
            self._segs[i:j] = [_segment(start, end, fut, [], self._seq)]
            self._starts[i:j] = [start]
            return
        new, at = [], start             # a read joins them, and covers the gaps between
        for seg in self._segs[i:j]:
            if seg.start > at:          # bytes nobody used yet
                new.append(_segment(at, seg.start, None, [fut], 0))
            seg.reads.append(fut)
            new.append(seg)
            at = seg.end
        if at < end:
            new.append(_segment(at, end, None, [fut], 0))
        self._segs[i:j] = new
        self._starts[i:j] = [seg.start for seg in new]


class BufferState:
    """What the core keeps of a Buffer (``aiogpu.memory.Buffer`` derives from it): of an
    allocation, its ordering state while it is used whole (``last_write``, the readers since in
    ``reads``; ``ranges``, a Hazards by offset, once views of it are used), how many pending
    operations use it (``users``) and whether it was freed; of a view, the allocation it views
    (``_base``; None for an allocation). Typed fields, so that the per-operation code reads
    them as C fields, compiled; and what submissions read of any Buffer, set by ``Buffer``:
    its ``device``, ``address``, ``nbytes``, ``offset`` in the allocation, ``typed_dtype``
    (None: raw bytes) and ``_shape``."""

    __slots__ = ("_base", "ranges", "last_write", "reads", "users", "freed",
                 "device", "address", "nbytes", "offset", "typed_dtype", "_shape")

    if TYPE_CHECKING:
        _base: Any
        ranges: Hazards | None
        last_write: GPUFuture | None
        reads: list[GPUFuture]
        users: int
        freed: bool
        device: Any
        address: int
        nbytes: int
        offset: int
        typed_dtype: Any
        _shape: tuple

    def _last_user_retired(self) -> None:
        """The last operation using this freed allocation retired (under the runtime lock):
        its memory goes back (``memory.Buffer`` does it)."""
        raise NotImplementedError


def state_of(obj: Any) -> Any:
    """The ordering state of what an operation touches (under the runtime lock): a range as
    given; a Buffer used whole while its allocation has no range state: the allocation itself
    (its two fields); any other Buffer or view: its bytes in the allocation's ranges (created
    now, holding the whole-buffer state so far). Other objects (a capture's states) as given.

    (``dependencies`` and ``record`` test the commonest case, an allocation used whole with no
    range state, themselves: it is its own state, and they skip this call per buffer.)"""
    if not isinstance(obj, BufferState):
        return obj
    base = obj._base
    root: Any = obj if base is None else base     # (Buffers: their sizes and offsets too)
    view: Any = obj
    ranges = root.ranges
    if ranges is None:
        if view.nbytes == root.nbytes:
            return root
        ranges = root.ranges = Hazards(keep_failed=True)
        if root.last_write is not None or root.reads:
            ranges._segs.append(_Segment(0, root.nbytes, root.last_write, root.reads, 0))
            ranges._starts.append(0)
        root.last_write, root.reads = None, []
    return _range(ranges, view.offset, view.offset + view.nbytes, root)


def prune(state: Any) -> None:
    """Forget the retired work in ``state`` (its readers, and its last writer unless that
    failed), so that finished futures, and the results they hold, are not kept alive by the
    memory they touched. A Buffer (or view) prunes its whole allocation; an allocation whose
    ranges are left empty goes back to the fast path."""
    if isinstance(state, BufferState):
        root: Any = state if state._base is None else state._base
        if root.ranges is not None:
            root.ranges.prune(0, root.nbytes)
            if not root.ranges._segs:
                root.ranges = None
            return
        state = root
    _prune_fields(state)


def _prune_fields(state: Any) -> None:
    """``prune`` of a state kept in two fields (an allocation used whole, a capture's state)."""
    # A writer that failed stays the last writer even once retired: the memory's contents are
    # undefined, so later readers fail (read after a failed write) until something overwrites it.
    # (Host memory is exempt, see Hazards.)
    last = state.last_write
    if last is not None and last.retired and last._exc is None:
        state.last_write = None
    reads = state.reads
    for f in reads:                 # (a new list only when something retired)
        if f.retired:
            state.reads = [f for f in reads if not f.retired]
            break


def touching(obj: Any) -> tuple[list[GPUFuture], list[GPUFuture]]:
    """(unretired last writers, unretired readers since) of a Buffer's or view's bytes
    (under the runtime lock): what a consumer outside aiogpu must wait for."""
    state = state_of(obj)
    if isinstance(state, HostRange):
        writers, readers = state.writers(), state.readers()
    else:
        writers, readers = [state.last_write] if state.last_write is not None else [], state.reads
    return [f for f in writers if not f.retired], [f for f in readers if not f.retired]


def dependencies(reads: Iterable[Any], writes: Iterable[Any], after: Iterable[GPUFuture]) -> dict[GPUFuture, bool]:
    """{earlier future: semantic} for an operation touching ``reads``/``writes`` (Buffers,
    views, ranges)."""
    deps: dict[GPUFuture, bool] = {}
    for fut in after:
        deps[fut] = True            # retired ones too: failed_dependency checks them
    for obj in reads:
        if isinstance(obj, BufferState):
            buf = obj
            if buf._base is None and buf.ranges is None:
                # An allocation used whole: its own state (see state_of). Only its last writer
                # matters here; its readers leave ``reads`` as they retire (``track``).
                last = buf.last_write
                if last is not None:
                    if last.retired and last._exc is None:
                        buf.last_write = None
                    else:
                        deps[last] = True
                continue
        state = state_of(obj)
        if isinstance(state, HostRange):
            for writer in state.writers():
                deps[writer] = True
            continue
        _prune_fields(state)
        if state.last_write is not None:
            deps[state.last_write] = True
    for obj in writes:
        if isinstance(obj, BufferState):
            buf = obj
            if buf._base is None and buf.ranges is None:
                last = buf.last_write   # (no pruning: ``record`` replaces both fields next)
                if last is not None:
                    if not last.retired:
                        if last not in deps:
                            deps[last] = False
                    elif last._exc is not None:
                        _order_after(deps, last)
                for reader in buf.reads:
                    if not reader.retired:
                        if reader not in deps:
                            deps[reader] = False
                    elif reader._exc is not None:
                        _order_after(deps, reader)
                continue
        state = state_of(obj)
        if isinstance(state, HostRange):
            for fut in (*state.writers(), *state.readers()):
                _order_after(deps, fut)
            continue
        _prune_fields(state)
        if state.last_write is not None:
            _order_after(deps, state.last_write)
        for other in state.reads:
            _order_after(deps, other)
    return deps


def _order_after(deps: dict[GPUFuture, bool], fut: GPUFuture) -> None:
    """Add an ordering-only edge to ``fut`` (or to what it stands for, see ``_live``)."""
    if not fut.retired:
        if fut not in deps:
            deps[fut] = False
    elif fut._exc is not None:
        for f in _live(fut):
            if f not in deps:
                deps[f] = False


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


def broken_error(label: str, broken: BaseException) -> GPUError:
    """The error of an operation offered to a broken device (``Device.broken``): of the
    broken error's kind (DeviceLost for a lost one), so callers can tell what happened."""
    kind = DeviceLost if isinstance(broken, DeviceLost) else GPUError
    err = kind(f"{label}: {broken}", status=getattr(broken, "status", None))
    if kind is DeviceLost:
        err.__cause__ = broken
    return err


def failed_without_running(hub: Any, label: str, err: GPUError, writes: Iterable[Any]) -> GPUFuture:
    """A future for work not submitted because an input failed. It still becomes the last
    writer of what the work would have written: that memory now holds no defined result, so its
    readers fail too (until something overwrites it)."""
    fut = completed_future(hub, label, err)
    # Host memory (a range with no buffer): nothing ran, nothing there is undefined.
    states = [state_of(s) for s in writes]
    device = [s for s in states if not (isinstance(s, HostRange) and s.buffer is None)]
    for state in device:
        if isinstance(state, HostRange):
            add_preds(fut, [*state.writers(), *state.readers()])
        else:
            prune(state)
            add_preds(fut, [f for f in [state.last_write, *state.reads] if f is not None])
    record(fut, [], device)
    return fut


def record(fut: Any, reads: Iterable[Any], writes: Iterable[Any], deps: Iterable[GPUFuture] = ()) -> None:
    """Make ``fut`` (a GPUFuture, or a GraphNode at capture) the last writer of ``writes`` and a reader of the other ``reads``; ``deps``
    (what it waits for) are remembered in case it fails without running."""
    preds = None
    for d in deps:
        if not d.retired:
            if preds is None:
                preds = preds_list(fut)
            preds.append(d)
    if type(writes) is not list:
        writes = list(writes)
    for obj in writes:
        if isinstance(obj, BufferState):
            buf = obj
            if buf._base is None and buf.ranges is None:
                buf.last_write = fut    # an allocation used whole: its own state (see state_of)
                if buf.reads:           # (an empty list stays: no new list per write)
                    buf.reads = []
                continue
        state = state_of(obj)
        if isinstance(state, HostRange):
            r = state                   # (compiled, its C fields and its Hazards' C method)
            r.hazards._record(r.start, r.end, fut, True)
            continue
        state.last_write = fut
        if state.reads:
            state.reads = []
    for obj in reads:
        if writes and _among(obj, writes):   # written too: its write covers the read
            continue
        if isinstance(obj, BufferState):
            buf = obj
            if buf._base is None and buf.ranges is None:
                buf.reads.append(fut)
                continue
        state = state_of(obj)
        if isinstance(state, HostRange):
            r = state
            r.hazards._record(r.start, r.end, fut, False)
            continue
        state.reads.append(fut)


def _among(obj: Any, objs: list) -> bool:
    """Whether ``obj`` is one of ``objs`` (by identity: what an operation touches defines no
    ``__eq__``, and ``in`` would call the comparison per entry)."""
    for o in objs:
        if o is obj:
            return True
    return False

