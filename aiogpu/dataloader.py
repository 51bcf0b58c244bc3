"""``aiogpu.Loader``: an async multi-GPU data loader with bounded prefetch and no thread pool.

    async with aiogpu.Loader(batches, devices, prefetch=2) as loader:
        async for batch in loader:
            out = batch.device.launch(k, grid, block, args=(batch.data, ...), after=[batch.ready])
            batch.release()          # its buffers may be reused; the device orders the reuse

Host batches (NumPy arrays, or tuples/dicts of them) come from a sync or async iterable and are
spread round-robin over the devices. Each is copied ahead on its device's host-to-device engine,
at most ``prefetch`` batches per device in flight (back-pressure: the source is not read further
until the consumer releases a batch). A batch's ``ready`` future completes when its copies have;
pass it as ``after=`` so that compute waits on the device, not on the host.

Fresh host arrays (a new array every step, as real loaders make) are not pinned per batch:
arrays of ``STAGE_MIN`` bytes and more are copied into the runtime's pinned memory off the event
loop, in ``STAGE_CHUNK`` pieces over the loader's ``stage_threads`` worker threads (as PyTorch's
``pin_memory`` thread does); the worker that staged a piece submits its upload at once, so
staging overlaps the uploads, within a batch and across batches, and the loop takes part once
per batch, not once per piece. Arrays the
runtime can use in place go as they are: pinned memory (``Buffer.to_numpy`` results) and, on
CUDA, arrays a cached registration covers; so do arrays the source hands out again (a source
cycling through a few arrays: pinning each once where it is pays).

A released batch's buffers go back to a pool at once: the next copy into them is ordered after
the consumer's submitted work on the device (write after read), so a copy can never overwrite
data a kernel still reads. Leaving the ``async with`` block (at the end of the data, by an
exception or by cancellation) cancels the producer and waits for the copies it started, so none
is left writing into a buffer that someone else reuses; then it frees the pool and the batches
prefetched but never consumed (each buffer's memory goes back once the work that uses it has
retired), so a loader kept after its block holds no device memory. A batch the consumer still
holds unreleased stays usable; releasing it after the block frees its buffers.
"""
from __future__ import annotations

import os
import weakref
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, AsyncIterator, Iterable

import anyio
import numpy as np

from .futures import GPUFuture
from .memory import Buffer

STAGE_MIN = 1 << 20          # smaller arrays are copied on submission (the runtime's staging)
STAGE_CHUNK = 8 << 20        # one worker thread's piece of a staging copy (H200 host, 8 threads:
                             # 4 MiB pieces staged at 19.7 GB/s, 8 MiB at 30.5)


class Batch:
    """One batch on one device. ``data`` mirrors the host batch's structure with Buffers."""

    def __init__(self, loader: "Loader", index: int, device: Any, data: Any, buffers: list[Buffer],
                 ready: GPUFuture):
        self._loader = loader
        self.index, self.device, self.data, self.ready = index, device, data, ready
        self._buffers = buffers
        self._released = False
        self._run = loader._run        # the loader's ``async with`` block it was loaded in

    def release(self) -> None:
        """Give the buffers back for later batches (idempotent). Submit your work first."""
        if not self._released:
            self._released = True
            self._loader._recycle(self)

    async def __aenter__(self) -> "Batch":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<Batch {self.index} on {self.device.name}>"


class Loader:
    """Streams host batches into several GPUs; see the module docstring for the guarantees."""

    def __init__(self, source: Iterable | AsyncIterator, devices: list, *, prefetch: int = 2,
                 ordered: bool = True, stage_threads: int | None = None):
        if not devices:
            raise ValueError("Loader needs at least one device")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be a positive integer, got {prefetch!r}")
        if stage_threads is None:
            stage_threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        if isinstance(stage_threads, bool) or not isinstance(stage_threads, int) or stage_threads < 1:
            raise ValueError(f"stage_threads must be a positive integer, got {stage_threads!r}")
        self.source, self.devices = source, list(devices)
        self.prefetch, self.ordered = prefetch, ordered
        self.stage_threads = stage_threads
        self._workers: ThreadPoolExecutor | None = None   # the staging threads (on first use)
        self._seen: dict[int, weakref.ref] = {}   # arrays staged once (by id, while alive)
        self.staged_bytes = 0
        self._pool: dict[tuple[int, int], list[Buffer]] = defaultdict(list)
        self._slots: dict[int, anyio.Semaphore] = {}
        self._inflight: list[GPUFuture] = []
        self.batches = 0
        self.allocated = 0
        self._error: Exception | None = None
        self._run = 0                 # counts ``async with`` blocks; the pool serves the open one
        self._open = False
        self._unclaimed: dict[int, Batch] = {}   # loaded, not yet received by the consumer

    async def __aenter__(self) -> "Loader":
        self._run += 1
        self._open = True
        self._slots = {id(d): anyio.Semaphore(self.prefetch) for d in self.devices}
        self._send, self._recv = anyio.create_memory_object_stream[Batch](self.prefetch * len(self.devices))
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._produce)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        # The body's own exception propagates untouched: the producer never raises (its errors
        # reach the consumer through __anext__), so the task group exits cleanly.
        self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                for fut in self._inflight:
                    if not fut.done():
                        try:
                            await fut
                        except Exception:
                            pass
            self._open = False
            self._free_buffers()
            self._recv.close()
            if self._workers is not None:    # (idle: the producer waited for its staging)
                self._workers.shutdown(wait=False)
                self._workers = None

    def _free_buffers(self) -> None:
        """The block is left: free the batches prefetched but never consumed, and the pool
        (``Buffer.free``: the memory goes back once the work using it has retired)."""
        unclaimed, self._unclaimed = self._unclaimed, {}
        for batch in unclaimed.values():  # in the stream, or with a producer task cancelled
            batch.release()
        pool, self._pool = self._pool, defaultdict(list)
        for buffers in pool.values():
            for buf in buffers:
                buf.free()
        self._inflight = []               # (all done: awaited above)

    def __aiter__(self) -> "Loader":
        return self

    async def __anext__(self) -> Batch:
        try:
            batch = await self._recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration from None
        del self._unclaimed[batch.index]         # the consumer's from now on
        return batch

    # -- producer ----------------------------------------------------------------------------
    async def _produce(self) -> None:
        try:
            await self._produce_all()
        except Exception as exc:  # handed to the consumer at its next __anext__
            while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]
            self._error = exc

    async def _produce_all(self) -> None:
        async with self._send:
            async with anyio.create_task_group() as waiting:
                index = 0
                async for host in aiterate(self.source):
                    device = self.devices[index % len(self.devices)]
                    await self._slots[id(device)].acquire()
                    batch = await self._load(index, device, host)
                    if self.ordered:
                        await self._send.send(batch)
                    else:
                        waiting.start_soon(self._send_when_ready, batch)
                    index += 1

    async def _send_when_ready(self, batch: Batch) -> None:
        try:
            await batch.ready
        except Exception:
            pass  # the consumer sees the failure when it uses batch.ready
        await self._send.send(batch)

    async def _load(self, index: int, device: Any, host: Any) -> Batch:
        """Take the batch's buffers and start its copies: arrays the runtime can copy from as
        they are at once; fresh large arrays chunk by chunk, each chunk's upload submitted as
        soon as a worker thread has staged it into pinned memory (staging the next chunks
        overlaps the upload of this one)."""
        rt = device.runtime
        buffers: list[Buffer] = []
        copies: list[GPUFuture] = []
        fresh: list[tuple[Buffer, np.ndarray]] = []

        def put(arr: Any) -> Buffer:
            if not isinstance(arr, np.ndarray):
                raise TypeError(f"batch {index}: expected NumPy arrays (or tuples/dicts of them), "
                                f"got {type(arr).__name__}")
            arr = np.ascontiguousarray(arr)
            buf = self._take(device, arr.nbytes)
            buffers.append(buf)
            if self._fresh(rt, arr):
                fresh.append((buf, arr))
            else:
                copies.append(self._started(rt.copy(buf, arr)))
            return buf

        try:
            data = _map_structure(put, host)
            if fresh:
                copies.extend(await self._stage_uploads(rt, fresh))
            ready = copies[0] if len(copies) == 1 else rt.gather(copies)
        except BaseException:     # (a bad batch, cancellation): no batch will own these
            for buf in buffers:
                buf.free()
            raise
        self.batches += 1
        batch = self._unclaimed[index] = Batch(self, index, device, data, buffers, ready)
        return batch

    def _started(self, fut: GPUFuture) -> GPUFuture:
        """Remember ``fut`` until done: leaving the loader waits for every copy it started."""
        if len(self._inflight) > 256:
            self._inflight = [f for f in self._inflight if not f.done()]
        self._inflight.append(fut)
        return fut

    def _fresh(self, rt: Any, arr: np.ndarray) -> bool:
        """Whether ``arr`` is staged: large, numeric (the copy refuses the rest), not usable in
        place (pinned memory), and not handed out by the source before (a source cycling
        through a few arrays: pinning each once where it is pays)."""
        if arr.nbytes < STAGE_MIN or arr.dtype.kind not in "biufc" or rt._host_pinned(arr):
            return False
        key, seen = id(arr), self._seen.get(id(arr))
        if seen is not None and seen() is arr:
            return False
        self._seen[key] = weakref.ref(arr, self._forget)
        return True

    def _forget(self, ref: weakref.ref) -> None:
        """A staged array died: its id may name another array next."""
        for key, seen in list(self._seen.items()):
            if seen is ref:
                del self._seen[key]

    async def _stage_uploads(self, rt: Any, fresh: list[tuple[Buffer, np.ndarray]]) -> list[GPUFuture]:
        """Copy the ``fresh`` arrays into pinned memory in ``STAGE_CHUNK`` pieces on the staging
        threads, each worker submitting a piece's upload into its buffer as soon as it has
        staged it. One hand-off to a thread per batch: with a hop back to the loop per piece,
        each upload waited for the loop's turn (0.2-0.3 ms a piece in an H200 timeline; the
        batch as a whole stays bound by staging's memory traffic)."""
        pieces = []
        with rt.lock:
            for buf, arr in fresh:
                staging = rt.pinned.empty(arr.nbytes, np.uint8)
                flat = arr.reshape(-1).view(np.uint8)
                bounds = list(range(0, arr.nbytes, STAGE_CHUNK)) + [arr.nbytes]
                pieces += [(buf, flat, staging, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        if self._workers is None:
            self._workers = ThreadPoolExecutor(self.stage_threads, thread_name_prefix="aiogpu-stage")
        submitted: list[GPUFuture] = []
        try:
            await anyio.to_thread.run_sync(_stage_pieces, self._workers, rt, pieces, submitted)
        finally:
            # (Also when cancelled: the thread is waited for, and leaving the loader waits
            # for every upload it submitted.)
            for fut in submitted:
                self._started(fut)
        self.staged_bytes += sum(arr.nbytes for _, arr in fresh)
        return submitted

    def _take(self, device: Any, nbytes: int) -> Buffer:
        # The buffer released longest ago: its consumer's work is the likeliest to be done, so
        # the copy into it (ordered after that work on the device) starts soonest.
        free = self._pool[(id(device), nbytes)]
        if free:
            return free.pop(0)
        self.allocated += 1
        return device.alloc(nbytes)

    def _recycle(self, batch: Batch) -> None:
        if not self._open or batch._run != self._run:    # released after its block: no pool
            for buf in batch._buffers:
                buf.free()
            return
        for buf in batch._buffers:
            self._pool[(id(batch.device), buf.nbytes)].append(buf)
        self._slots[id(batch.device)].release()


def _stage_pieces(workers: ThreadPoolExecutor, rt: Any, pieces: list, submitted: list) -> None:
    """On a worker thread: stage ``pieces`` (buffer, flat source, pinned staging, lo, hi) on
    ``workers``, each piece's upload submitted by the worker that staged it and appended to
    ``submitted``; waits for all of them, then raises the first failure."""
    def one(buf: Buffer, flat: np.ndarray, staging: np.ndarray, lo: int, hi: int) -> None:
        np.copyto(staging[lo:hi], flat[lo:hi])
        submitted.append(rt.copy(buf[lo:hi], staging[lo:hi]))

    jobs = [workers.submit(one, *piece) for piece in pieces]
    wait(jobs)
    for job in jobs:
        job.result()


async def aiterate(source: Any) -> AsyncIterator:
    """The items of a sync or async iterable, as an async iterator (a sync one yields to the
    loop between items)."""
    if hasattr(source, "__aiter__"):
        async for item in source:
            yield item
    else:
        for item in source:
            yield item
            await anyio.sleep(0)  # a long sync source must not starve the loop


def _map_structure(fn: Any, obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _map_structure(fn, v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_structure(fn, v) for v in obj)
    return fn(obj)
