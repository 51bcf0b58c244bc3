"""``aiogpu.ray``: aiogpu inside Ray's async actors, for pipelines and services that span nodes.

Ray schedules GPU processes across nodes and runs async actors on an asyncio event loop; aiogpu
lives on that loop. This module is what it takes to use the two together (``pip install
'aiogpu[ray]'``; ``import aiogpu`` alone never imports Ray)::

    import aiogpu, aiogpu.ray, ray

    @ray.remote
    class Stage(aiogpu.ray.GPUActor):
        async def step(self, boxed_ref):
            dev = self.devices[0]          # this actor's runtime, over the GPUs Ray assigned it
            x = await boxed_ref[0]         # an ObjectRef and GPU futures, awaited on one loop
            ...

    stage = Stage.options(**aiogpu.ray.gpu_options(2)).remote()

- **GPUs**: ``actor_runtime()`` (``GPUActor.runtime``/``.devices``) is one aiogpu runtime per actor
  process, created on first use over the GPUs Ray assigned to the actor, and closed when the actor
  exits gracefully (``__ray_shutdown__``, and ``atexit`` as a backstop). Ray's ``GPU`` resource: Ray
  sets ``CUDA_VISIBLE_DEVICES`` (NVIDIA), which CUDA honours, or ``HIP_VISIBLE_DEVICES`` (AMD),
  which this module turns into ``ROCR_VISIBLE_DEVICES`` for ROCr. The emulator: a node declares
  emulated GPUs as the custom resource ``EMULATED_GPU`` (``"emulated_gpu"``); an actor holding
  ``n`` of them gets the emulator with ``n`` GPUs (``AIOGPU_BACKEND=emulator``,
  ``AIOGPU_EMULATOR_GPUS=n``). ``gpu_options(n)`` asks for whichever the cluster offers.
- **Awaiting both**: ``await ref`` works in an async actor, and so does ``asyncio.gather(ref,
  gpu_future)``. ``gather()`` here also waits for every GPU future to settle when one input fails.
- **Loader sources**: ``batches_from_refs()`` and ``batches_from_dataset()`` are async iterators of
  host batches for ``aiogpu.Loader``, with back-pressure: at most ``max_in_flight`` refs (or
  dataset batches) are being fetched ahead of the consumer.

aiogpu does not move device memory between processes or nodes: Ray's object store carries host
data (NumPy arrays) between actors; each actor copies it into its own GPUs.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import math
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Iterable, Mapping, Sequence

import numpy as np

try:
    import ray
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("aiogpu.ray needs Ray, which is not installed here: pip install 'aiogpu[ray]'") from exc

import aiogpu
from aiogpu.dataloader import aiterate

__all__ = ["EMULATED_GPU", "GPUAssignment", "NoGPUsAssigned", "GPUActor", "assigned_gpus", "gpu_options",
           "actor_runtime", "close_actor_runtime", "gather", "batches_from_refs", "batches_from_dataset"]

EMULATED_GPU = "emulated_gpu"
"""The custom Ray resource by which a node declares emulated GPUs (``ray start --resources``)."""


class NoGPUsAssigned(RuntimeError):
    """The Ray actor asked for an aiogpu runtime but holds no GPU (nor emulated GPU) resource."""


# -- which GPUs this process has ---------------------------------------------------------------
@dataclass(frozen=True)
class GPUAssignment:
    """The GPUs Ray assigned to the calling worker.

    ``kind``: ``"gpu"`` (Ray's ``GPU`` resource), ``"emulated"`` (``EMULATED_GPU``) or ``"none"``;
    ``count``: how many GPUs the runtime should see (fractions round up: a share of one GPU is one
    GPU); ``ids``: Ray's GPU ids (kind ``"gpu"`` only); ``env``: the environment variables
    ``actor_runtime()`` sets before it creates the runtime.
    """

    kind: str
    count: int
    ids: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


def _in_ray_worker() -> bool:
    """True inside a Ray task or actor (not in a driver, not without Ray)."""
    if not ray.is_initialized():
        return False
    return ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def assigned_gpus() -> GPUAssignment:
    """The GPUs Ray assigned to the calling task or actor, and the environment aiogpu needs for them.

    An actor holding both resources counts as ``"gpu"`` (real GPUs win). Raises RuntimeError
    outside a Ray worker (in a driver, Ray assigns nothing), ValueError where the environment
    contradicts the assignment (emulated GPUs while ``AIOGPU_BACKEND`` names a real backend).
    """
    if not _in_ray_worker():
        raise RuntimeError("assigned_gpus() works inside a Ray task or actor; a driver is assigned no GPUs")
    resources = ray.get_runtime_context().get_assigned_resources()
    gpus = float(resources.get("GPU", 0.0))
    emulated = float(resources.get(EMULATED_GPU, 0.0))
    if gpus > 0:
        ids = tuple(str(i) for i in ray.get_gpu_ids())
        return GPUAssignment("gpu", max(len(ids), math.ceil(gpus)), ids, _real_gpu_env(ids, os.environ))
    if emulated > 0:
        count = math.ceil(emulated)
        return GPUAssignment("emulated", count, (), _emulated_env(count, os.environ))
    return GPUAssignment("none", 0)


def _emulated_env(count: int, environ: Mapping[str, str]) -> dict[str, str]:
    backend = environ.get("AIOGPU_BACKEND") or "emulator"
    if backend not in ("emulator", "auto"):
        raise ValueError(f"this actor holds {count} {EMULATED_GPU} resource(s) but AIOGPU_BACKEND={backend!r}; "
                         f"emulated GPUs need the emulator backend")
    return {"AIOGPU_BACKEND": "emulator", "AIOGPU_EMULATOR_GPUS": str(count)}


def _real_gpu_env(ids: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """CUDA reads CUDA_VISIBLE_DEVICES (set by Ray) itself. ROCr reads ROCR_VISIBLE_DEVICES, while
    Ray sets HIP_VISIBLE_DEVICES (indices into what ROCr shows): translate, and re-index HIP's
    variable so that HIP code in the same process sees the same GPUs. Should the backend fall back
    to the emulator (``num_gpus`` declared on a machine without GPUs), it gets as many GPUs."""
    env = {"AIOGPU_EMULATOR_GPUS": str(max(1, len(ids)))}
    hip = environ.get("HIP_VISIBLE_DEVICES")
    if hip:
        chosen = [s.strip() for s in hip.split(",") if s.strip()]
        rocr = environ.get("ROCR_VISIBLE_DEVICES")
        if rocr:
            visible = [s.strip() for s in rocr.split(",") if s.strip()]
            try:
                chosen = [visible[int(i)] for i in chosen]
            except (ValueError, IndexError):
                raise ValueError(f"HIP_VISIBLE_DEVICES={hip!r} does not index ROCR_VISIBLE_DEVICES={rocr!r}") from None
        env["ROCR_VISIBLE_DEVICES"] = ",".join(chosen)
        env["HIP_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(chosen)))
    return env


def gpu_options(count: float, *, emulated: bool | None = None) -> dict[str, Any]:
    """Ray actor options asking for ``count`` GPUs: ``{"num_gpus": count}`` where the cluster
    offers Ray's ``GPU`` resource, else ``{"resources": {EMULATED_GPU: count}}``.

    ``emulated`` forces one or the other; left None, it asks the connected cluster (so call it in a
    driver after ``ray.init``). Use as ``Actor.options(**gpu_options(2)).remote()``. Raises
    ValueError for a count that is not positive, or when ``emulated`` is None and the cluster
    declares neither resource.
    """
    if isinstance(count, bool) or not isinstance(count, (int, float)) or not count > 0:
        raise ValueError(f"count must be a positive number of GPUs, got {count!r}")
    if emulated is None:
        offered = ray.cluster_resources()
        if offered.get("GPU", 0) > 0:
            emulated = False
        elif offered.get(EMULATED_GPU, 0) > 0:
            emulated = True
        else:
            raise ValueError(f"the Ray cluster offers neither 'GPU' nor {EMULATED_GPU!r} resources: start its nodes "
                             f"with GPUs, or declare emulated ones (ray start --resources "
                             f"'{{\"{EMULATED_GPU}\": 2}}', ray.init(resources={{\"{EMULATED_GPU}\": 2}}))")
    return {"resources": {EMULATED_GPU: count}} if emulated else {"num_gpus": count}


# -- one runtime per actor process ---------------------------------------------------------------
_lock = threading.Lock()
_runtime: Any = None
_assignment: GPUAssignment | None = None
_atexit_registered = False


def actor_runtime(backend: str | None = None) -> aiogpu.Runtime:
    """This actor process's aiogpu runtime, over the GPUs Ray assigned to the actor.

    Created on the first call (later calls return it): the environment is set from
    ``assigned_gpus()``, then the process-wide default runtime is made, so ``aiogpu.devices()`` in
    the actor gives the same devices. It is closed by ``close_actor_runtime()``, which
    ``GPUActor.__ray_shutdown__`` and an ``atexit`` hook call. Outside a Ray worker (a driver, or an
    actor class tested as a plain object) it is simply the default runtime.

    Raises NoGPUsAssigned in an actor holding neither ``GPU`` nor ``EMULATED_GPU``; RuntimeError in
    a Ray task (a worker process outlives the task, and the next task may hold other GPUs: create
    ``aiogpu.Runtime()`` in the task and close it there) or when the process's default runtime
    already exists with another GPU count; ValueError for a backend that contradicts the assignment.
    """
    global _runtime, _assignment, _atexit_registered
    with _lock:
        if _runtime is not None and not _runtime.closed:
            if backend is not None and backend != _runtime.backend:
                raise ValueError(f"this actor's runtime uses {_runtime.backend!r}, not {backend!r}")
            return _runtime
        assignment = None
        if _in_ray_worker():
            if ray.get_runtime_context().get_actor_id() is None:
                raise RuntimeError("actor_runtime() is for Ray actors; in a Ray task, create aiogpu.Runtime() "
                                   "and close it before the task returns")
            assignment = assigned_gpus()
            if assignment.kind == "none":
                raise NoGPUsAssigned(
                    "this Ray actor holds no GPUs: create it with .options(**aiogpu.ray.gpu_options(n)), "
                    f"i.e. num_gpus=n, or resources={{'{EMULATED_GPU}': n}} for emulated GPUs")
            if assignment.kind == "emulated" and backend not in (None, "emulator", "auto"):
                raise ValueError(f"this actor holds emulated GPUs; backend {backend!r} cannot use them")
            os.environ.update(assignment.env)
        rt = aiogpu.runtime(backend)
        if assignment is not None and assignment.kind == "emulated" and len(rt.devices) != assignment.count:
            raise RuntimeError(f"this process's default aiogpu runtime was created with {len(rt.devices)} GPU(s) "
                               f"before actor_runtime(), but Ray assigned {assignment.count}: call "
                               f"actor_runtime() before aiogpu.devices()/aiogpu.runtime()")
        _runtime, _assignment = rt, assignment
        if not _atexit_registered:
            atexit.register(close_actor_runtime)
            _atexit_registered = True
        return rt


def close_actor_runtime(timeout: float = 10.0) -> None:
    """Close the runtime made by ``actor_runtime()`` (idempotent; nothing to do if none was made).

    Waits up to ``timeout`` seconds for submitted GPU work, then releases every resource. After
    ``ray.kill`` nothing runs in the actor (Ray ends the process at once): the operating system
    and the GPU driver reclaim its memory; the emulator's GPUs die with the process.
    """
    global _runtime
    with _lock:
        rt, _runtime = _runtime, None
    if rt is not None and not rt.closed:
        rt.close(timeout)


class GPUActor:
    """A base class for Ray actor classes that use aiogpu (decorate the subclass with ``@ray.remote``).

    ``self.runtime`` and ``self.devices`` are this process's runtime (``actor_runtime()``), made on
    first use; ``__ray_shutdown__`` closes it when the actor exits gracefully (its handles go out of
    scope, ``actor.__ray_terminate__.remote()``, ``ray.actor.exit_actor()``). A subclass that
    defines its own ``__ray_shutdown__`` calls ``super().__ray_shutdown__()``. Set the class
    attribute ``aiogpu_backend`` to force a backend (default: the assignment decides).
    """

    aiogpu_backend: str | None = None

    @property
    def runtime(self) -> aiogpu.Runtime:
        return actor_runtime(self.aiogpu_backend)

    @property
    def devices(self) -> list[aiogpu.Device]:
        return list(self.runtime.devices)

    async def aiogpu_info(self) -> dict[str, Any]:
        """(Remote method) where this actor runs and what it drives: node id, pid, backend, GPU
        count and names, and Ray's assignment. Creates the runtime if it does not exist yet."""
        rt = self.runtime
        info: dict[str, Any] = {"pid": os.getpid(), "backend": rt.backend, "gpus": len(rt.devices),
                                "devices": [d.name for d in rt.devices], "node_id": None, "assignment": None}
        if _in_ray_worker():
            info["node_id"] = ray.get_runtime_context().get_node_id()
        if _assignment is not None:
            info["assignment"] = {"kind": _assignment.kind, "count": _assignment.count, "ids": list(_assignment.ids)}
        return info

    def __ray_shutdown__(self) -> None:
        close_actor_runtime()


# -- awaiting ObjectRefs and GPU futures together -------------------------------------------------
async def gather(*awaitables: Awaitable[Any]) -> list[Any]:
    """Await ObjectRefs, GPUFutures and coroutines concurrently; their results, in order.

    As ``asyncio.gather`` (``asyncio.gather(ref, gpu_future)`` works too), plus: when one input
    fails (or the caller is cancelled), the others are cancelled, and before the exception is
    raised every GPUFuture given has completed or failed (GPU work cannot be cancelled; waiting
    for it means no buffer it uses is handed back while the device still uses it). Raises the
    first failure; TypeError for an input that is not awaitable. Needs an asyncio loop (Ray's
    ObjectRefs are asyncio awaitables).
    """
    for i, aw in enumerate(awaitables):
        if not (isinstance(aw, ray.ObjectRef) or hasattr(aw, "__await__")):
            raise TypeError(f"gather argument {i} is not awaitable: {type(aw).__name__}")
    tasks = [asyncio.ensure_future(aw) for aw in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await _settle_gpu_futures([aw for aw in awaitables if isinstance(aw, aiogpu.GPUFuture)])
        raise


async def _settle_gpu_futures(futures: list[aiogpu.GPUFuture]) -> None:
    """Wait, through cancellation, until every future is done (their failures are not ours)."""
    pending = [f for f in futures if not f.done()]
    if not pending:
        return

    async def settle(f: aiogpu.GPUFuture) -> None:
        try:
            await f
        except Exception:
            pass

    waiter = asyncio.ensure_future(asyncio.gather(*(settle(f) for f in pending)))
    cancelled = False
    while not waiter.done():
        try:
            await asyncio.shield(waiter)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


# -- sources for aiogpu.Loader ------------------------------------------------------------------------
def _check_batch(value: Any, where: str) -> None:
    """A host batch the Loader can copy: a numeric NumPy array, or a tuple/list/dict of them."""
    if isinstance(value, dict):
        for key, v in value.items():
            _check_batch(v, f"{where}[{key!r}]")
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _check_batch(v, f"{where}[{i}]")
    elif isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.kind not in "biufc":
            raise TypeError(f"{where}: a {value.dtype} array cannot be copied to a GPU (numeric dtypes only)")
    else:
        raise TypeError(f"{where}: expected a NumPy array (or a tuple/list/dict of them), got {type(value).__name__}")


def _check_in_flight(max_in_flight: Any) -> None:
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValueError(f"max_in_flight must be a positive integer, got {max_in_flight!r}")


def batches_from_refs(refs: AsyncIterable[Any] | Iterable[Any], *, max_in_flight: int = 2) -> AsyncIterator[Any]:
    """The values of ``refs`` (ObjectRefs, from a sync or async iterable, e.g. a streaming
    generator's ``ObjectRefGenerator``), in order, as an async iterator for ``aiogpu.Loader``.

    Back-pressure: at most ``max_in_flight`` refs are taken from ``refs`` and not yet handed to the
    consumer (the one being awaited included); ``refs`` is read no further until the consumer asks
    for more, so a generator that submits Ray work as it yields is throttled too. Each value must be
    a numeric NumPy array or a tuple/list/dict of them (TypeError, naming the batch, otherwise). A
    failed ref raises its Ray exception (e.g. ``ray.exceptions.RayActorError`` when the actor that
    made it died) at the consumer, after the refs fetched ahead are dropped. ValueError at once for
    a bad ``max_in_flight``; TypeError at once for a ``refs`` that is not iterable, and at its turn
    for an item that is not an ObjectRef or awaitable.
    """
    _check_in_flight(max_in_flight)
    if not (hasattr(refs, "__aiter__") or hasattr(refs, "__iter__")):
        raise TypeError(f"refs must be an iterable or async iterable of ObjectRefs, got {type(refs).__name__}")
    return _stream_refs(refs, max_in_flight)


async def _stream_refs(refs: Any, max_in_flight: int) -> AsyncIterator[Any]:
    source = aiterate(refs)
    pending: deque[asyncio.Future] = deque()
    taken = 0
    exhausted = False
    try:
        while True:
            while not exhausted and len(pending) < max_in_flight:
                try:
                    ref = await source.__anext__()
                except StopAsyncIteration:
                    exhausted = True
                    break
                if isinstance(ref, ray.ObjectRef) or hasattr(ref, "__await__"):
                    pending.append(asyncio.ensure_future(ref))
                else:
                    raise TypeError(f"ref {taken} is not an ObjectRef (nor awaitable): {type(ref).__name__}")
                taken += 1
            if not pending:
                return
            index = taken - len(pending)
            value = await pending.popleft()
            _check_batch(value, f"batch {index}")
            yield value
    finally:
        _drop(pending)
        await source.aclose()
        if hasattr(refs, "aclose") and not exhausted:
            try:
                await refs.aclose()
            except Exception:
                pass


def _drop(pending: deque[asyncio.Future]) -> None:
    """Cancel what was fetched ahead; a failure that already arrived is marked as seen (it is not
    the consumer's: the consumer never asked for that batch)."""
    for fut in pending:
        if fut.done():
            if not fut.cancelled():
                fut.exception()
        else:
            fut.cancel()


_END = object()


def _next_or_end(it: Any) -> Any:
    try:
        return next(it)
    except StopIteration:
        return _END


def batches_from_dataset(dataset: Any, *, batch_size: int, columns: str | Sequence[str] | None = None,
                         max_in_flight: int = 2, drop_last: bool = False,
                         **iter_batches_options: Any) -> AsyncIterator[Any]:
    """Batches of a Ray Data dataset as NumPy host batches, an async iterator for ``aiogpu.Loader``.

    ``dataset.iter_batches(batch_size=..., batch_format="numpy", drop_last=...)`` runs in one
    thread of its own (Ray Data's iterator blocks; the event loop must not). ``columns``: None
    yields each batch as a dict of arrays, a name yields that column's array, a sequence of names
    yields a tuple. Back-pressure: at most ``max_in_flight`` batches are taken from Ray Data's
    iterator and not yet handed to the consumer; upstream, Ray Data's streaming executor applies
    its own resource limits. Other keyword arguments go to ``iter_batches`` (e.g.
    ``prefetch_batches``). Raises ValueError at once for a bad ``batch_size`` or
    ``max_in_flight``, TypeError for an object without ``iter_batches``; KeyError (naming the
    columns there are) for a missing column and TypeError for a non-numeric one, at that batch.
    Closing the iterator early closes Ray Data's iterator.
    """
    _check_in_flight(max_in_flight)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not hasattr(dataset, "iter_batches"):
        raise TypeError(f"expected a ray.data.Dataset (with iter_batches), got {type(dataset).__name__}")
    if columns is not None and not isinstance(columns, str):
        columns = tuple(columns)
        if not columns or not all(isinstance(c, str) for c in columns):
            raise ValueError(f"columns must be a column name or a non-empty sequence of names, got {columns!r}")

    def make_iterator() -> Any:
        return iter(dataset.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=drop_last,
                                         **iter_batches_options))

    return _stream_dataset(make_iterator, columns, max_in_flight)


def _select(batch: Any, columns: str | tuple[str, ...] | None, index: int) -> Any:
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch {index}: Ray Data gave a {type(batch).__name__}, expected a dict of NumPy arrays")
    if columns is None:
        out: Any = dict(batch)
    else:
        names = (columns,) if isinstance(columns, str) else columns
        missing = [c for c in names if c not in batch]
        if missing:
            raise KeyError(f"batch {index}: no column {missing[0]!r}; the dataset's columns are {sorted(batch)}")
        out = batch[columns] if isinstance(columns, str) else tuple(batch[c] for c in columns)
    _check_batch(out, f"batch {index}")
    return out


async def _stream_dataset(make_iterator: Any, columns: Any, max_in_flight: int) -> AsyncIterator[Any]:
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiogpu-ray-data")
    pending: deque[asyncio.Future] = deque()
    iterator: Any = None
    try:
        iterator = await loop.run_in_executor(pool, make_iterator)
        index = 0
        while True:
            # One worker thread: the next() calls run one after another, in submission order.
            while len(pending) < max_in_flight:
                pending.append(loop.run_in_executor(pool, _next_or_end, iterator))
            batch = await pending.popleft()
            if batch is _END:
                return
            yield _select(batch, columns, index)
            index += 1
    finally:
        _drop(pending)
        if iterator is not None and hasattr(iterator, "close"):
            pool.submit(iterator.close)   # after any next() still running, in that same thread
        pool.shutdown(wait=False)
