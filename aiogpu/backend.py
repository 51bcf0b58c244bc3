"""The backend interface: every hook a backend implements, declared once, with its contract.

A backend makes aiogpu run on one kind of driver (HSA: ``aiogpu/hsa``; CUDA: ``aiogpu/cuda``). It
implements four classes of hooks, and only these:

- ``CompletionHooks``, on its hub (a subclass of ``aiogpu._core.hub.FutureHub``): completion
  keys, reading them, waking the waiter thread;
- ``DeviceHooks``, on its device (a subclass of ``aiogpu.device.Device``): memory, kernel
  loading, and *encoding* a dispatch or a fill on a lane;
- ``RuntimeHooks``, on its runtime (a subclass of ``aiogpu.runtime.Runtime``): host memory,
  copy lanes and *encoding* copies and joins, graphs, other libraries' streams, stats, release;
- ``GraphExecHooks``, on its graph executable (a subclass of ``aiogpu.graph.GraphExec``):
  *encoding* a replay, giving back what the executable holds.

The core calls the hooks; a hook never calls back into the core's bookkeeping (futures,
hazards, tracking, dependents, watching, retiring: ``aiogpu/_core``). An encode hook receives a
future the core made, the lane the core (or the backend's lane hook) chose and the live work it
must follow (``waits``); it queues the operation's driver work after those, sets the future's
completion fields (``queue``, ``packet``, and for ticketed lanes ``ticket``/``event``), appends
to ``cleanup`` what must run once the work has retired, and returns the completion keys of
``waits`` its encoding names (kept from reuse until the work retires; ``()`` when it names
none). It raises before anything is queued: a ``GPUError`` (with ``status``) when the driver
refused the work (the core then returns a failed future), anything else for bad input (the
core re-raises it). The core then records hazards, dependents and keys, and watches the future.

Failure reports: work a backend finds failed outside an encode (a queue the driver reports
broken, a device lost to a memory fault, packets that could not be published later) is
reported, not settled, by the backend: a list of ``(future, exception, runs)``, in order, which
``runs`` false marks as work that will never run (its queue or device is gone). A hook the core
calls for it returns that list (``on_timeout``); anything else hands it to the waiter as an
event that returns it (``post_event(fn)``, where ``fn()`` returns the report). The core fails
each future not done yet (and its dependents), and retires those that never run once the work
they were ordered after has (``FutureHub.settle_failed``).

Lock rule: every hook is called with the runtime's lock held (``rt.lock``, an
``InterruptSafeLock``) unless its contract says otherwise.

Compiled hooks: where the core is compiled, it calls the hooks it needs per operation without a
Python method call when the backend's own compiled code provides them. The hub's per-operation
hooks (``watch``, ``reap``, ``_wake_for``, ``spin_poll``, ``parked_done``) are C methods of the
core's ``Hub`` (and of ``AwaitHub`` beside the future), which a backend's extension type
overrides (CUDA's ``LaneHub``); a Python override still wins. ``_copy_lane``, ``_encode_copy``
and ``_encode_kernel`` may be bound as C functions into the runtime's and the device's fields
(``aiogpu/_core/state.pxd``; CUDA's ``bind`` functions): the core then calls those instead of
the methods, so a backend that binds them must not also replace the methods per instance.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence


class CompletionHooks:
    """The hub's hooks: how a backend's completions are named, read and waited for."""

    def _new_key(self) -> int:
        """A fresh completion key for a future about to be encoded (non-zero; HSA: a pool
        signal set to 1). Under the lock. Not called where ``keys_are_resources`` is False
        (CUDA): the hub then counts the keys itself."""
        raise NotImplementedError

    def retain_key(self, key: int) -> None:
        """``key`` is named by work being encoded: keep it from reuse until ``release_key``.
        Under the lock. Neither is called when the hub's ``keys_are_resources`` is False (set
        in the backend's ``__init__``: keys that are plain counters, as CUDA's)."""

    def release_key(self, key: int) -> None:
        """The completion object ``key`` may be reused (nobody reads it any more). Under the
        lock."""

    def is_complete(self, key: int) -> bool:
        """Whether the completion ``key`` reads complete (any thread, no lock)."""
        return False

    def force_complete(self, key: int) -> None:
        """Make ``key`` read as complete, so device work waiting on it proceeds (its work can
        no longer run). Under the lock."""

    def wake(self) -> None:
        """Wake the waiter thread (any thread, no lock; never blocks)."""
        raise NotImplementedError

    def _wake_for(self, fut: Any) -> None:
        """Make sure the waiter is woken when pending device work ``fut`` completes (any
        thread, without the lock; ``FutureHub.arm`` decides who is waited for)."""

    def _run(self) -> None:
        """The waiter thread's loop: observe completions and report them to the core
        (``_settle``), until ``_stop``. Never raises."""
        raise NotImplementedError

    def device_times(self, fut: Any) -> tuple[int, int] | None:
        """(start, end) of ``fut``'s work on the device in host monotonic ns, if known."""
        return None

    def poll(self) -> None:
        """Observe completions now, on the calling thread (where the backend can; else nothing)."""

    def reap(self) -> None:
        """Settle and retire, on the calling thread, the work whose completion reads done
        without a driver call (CUDA: each lane's completion word, one memory load). The core
        calls it outside any section of the lock when work is submitted while other work is
        awaited or once the waiter has fallen ``REAP_MAX`` futures behind (``_core.submit.reap``;
        the CUDA spin also calls it at ``REAP_AT``). A busy loop so finds
        its completions itself, rather than waiting for the waiter thread to get the GIL, and
        what they held is freed while it is young (the garbage collector does not see it
        survive). Never raises what a completion step raises (that fails its future). Default:
        nothing (the waiter does it all)."""

    def parked_done(self, fut: Any) -> None:
        """A parked await of ``fut`` was woken (backends learn from it; no lock)."""


class DeviceHooks:
    """A device's hooks: memory, kernels, and encoding dispatches and fills on its lanes."""

    def _raw_alloc(self, size: int) -> int:
        """Device memory from the driver (``size`` a multiple of 2 MiB); OutOfMemoryError when
        there is none."""
        raise NotImplementedError

    def _raw_free(self, address: int) -> None:
        raise NotImplementedError

    def _memory_size(self) -> int | None:
        """The device's memory in bytes (None: the backend cannot tell); asked once."""
        return None

    def _memory_free(self) -> int | None:
        """What is free now (None: cannot tell)."""
        return None

    def _load(self, kernel: Any) -> Any:
        """``kernel``'s code loaded on this device (the core caches it); fast once
        ``_compile`` has run."""
        raise NotImplementedError

    def _needs_compile(self, kernel: Any) -> bool:
        """Whether loading ``kernel`` must first compile it (slow); cheap, compiles nothing."""
        return False

    def _compile(self, kernel: Any) -> None:
        """The slow part of loading (NVRTC, comgr), leaving its result where ``_load`` finds it.
        Called on a compile worker thread WITHOUT the lock: thread-safe, touches no runtime
        state."""

    def _check_grid(self, grid: tuple, block: tuple) -> None:
        """Backend limits on a validated grid and block (ValueError); none by default."""

    def _lane_load(self, lane: Any) -> int:
        """How much unretired work a compute lane holds (0: idle), for the core's lane choice.
        Default: always 0 (round-robin)."""
        return 0

    def _encode_kernel(self, fut: Any, lane: Any, loaded: Any, grid: tuple, block: tuple,
                       values: Sequence, lengths: Sequence, waits: Sequence, cleanup: list,
                       copy: Any = None, foreign: Sequence = ()) -> Iterable[int]:
        """Queue one dispatch of ``loaded`` on the compute lane ``lane`` after ``waits``,
        completing ``fut`` (see the module doc). ``copy``: the CopyOp when it is a shader
        copy; ``foreign``: other libraries' streams whose queued work it must follow."""
        raise NotImplementedError

    # Whether the backend fills memory itself (``_encode_fill``); else the core runs the
    # built-in fill kernel through ``_encode_kernel``.
    native_fill = False

    def _encode_fill(self, fut: Any, lane: Any, buf: Any, word: int, waits: Sequence,
                     cleanup: list) -> Iterable[int]:
        """Queue a fill of ``buf`` with the 32-bit ``word`` on ``lane`` (only where
        ``native_fill``)."""
        raise NotImplementedError

    def _destroy(self) -> None:
        """Release this device's driver objects (the runtime is closing; no lock needed)."""


class RuntimeHooks:
    """A runtime's hooks: host memory, copies and joins, graphs, other libraries' streams."""

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        """(True, what was found) when this backend can run here, else (False, why not).
        Never raises."""
        raise NotImplementedError

    def _pin_host(self, address: int, size: int) -> int:
        """Page-lock ``size`` bytes of host memory at ``address`` for every device; the address
        devices use for it (the pinned pool's slabs)."""
        raise NotImplementedError

    def _unpin_host(self, address: int) -> None:
        raise NotImplementedError

    def _host_pointers(self, op: Any) -> None:
        """Device-visible pointers for the host sides of copy ``op`` whose ``ptr`` is None
        (lock or pin them; what must be undone goes to ``op.cleanup``). Called only when one
        is: a host side in the pinned pool, or one staged, already has its pointer."""
        raise NotImplementedError

    # Whether ``_copy_lane`` gives every copy a lane (a copy stream always takes one): the
    # core then never asks ``_engine_may_take`` while copy engines are on.
    engines_take_every_copy = False

    def _engine_may_take(self, op: Any) -> bool:
        """Whether ``_copy_lane`` is expected to give ``op`` an engine now: a cheap
        prediction, asked only while the built-in copy kernel is not loaded. Default: always."""
        return True

    def _shader_can_copy(self, op: Any) -> bool:
        """Whether a shader on ``op.device`` can address both sides (else an engine must)."""
        return True

    def _copy_lane(self, op: Any, deps: dict) -> Any:
        """The copy lane (engine, copy stream) that is to run ``op``; None when none can take
        it now (the core then runs a shader copy)."""
        raise NotImplementedError

    def _encode_copy(self, fut: Any, op: Any, lane: Any, waits: Sequence, cleanup: list) -> Iterable[int] | None:
        """Queue copy ``op`` on ``lane`` after ``waits``, completing ``fut`` (module doc);
        None when the engine refused it after all (nothing queued: the core runs a shader
        copy)."""
        raise NotImplementedError

    def _join_lane(self, device: Any, live: list, deps: dict) -> Any:
        """The lane on which a join of the pending futures ``live`` completes."""
        raise NotImplementedError

    def _encode_join(self, fut: Any, lane: Any, waits: Sequence, cleanup: list) -> Iterable[int]:
        """Queue on ``lane`` a completion of ``fut`` after every one of ``waits``."""
        raise NotImplementedError

    def _instantiate(self, graph: Any) -> Any:
        """A captured graph's executable."""
        raise NotImplementedError

    def _foreign(self, obj: Any, what: str, write: bool) -> tuple | None:
        """(pointer, nbytes, device, stream to wait on) of another library's device array;
        None if ``obj`` is none this backend accepts (ValueError/TypeError naming ``what`` if
        it is one it cannot use; ``write``: the operation writes it). Default: none."""
        return None

    def _foreign_check(self, obj: Any) -> None:
        """Raise NotOnCudaError where this backend has no CUDA streams (the default: always)."""
        from .errors import NotOnCudaError
        raise NotOnCudaError(f"the {getattr(self, 'backend', '?')} backend has no CUDA streams or events "
                             f"({type(obj).__name__} given); stream futures and wait_on need the cuda backend")

    def _foreign_work(self, obj: Any, device: Any) -> tuple:
        """(device, lane, label, encode) for a future of another library's stream or event
        ``obj`` (on ``device`` when given): the lane that captures its queued work, and
        ``encode(fut, lane, waits, cleanup)``, which encodes that capture as ``_encode_join``
        encodes a join. ``lane`` None: nothing to wait for (the future is done at once, named
        ``label``). ValueError/TypeError for what cannot be used."""
        self._foreign_check(obj)
        raise NotImplementedError

    def _wait_on(self, fut: Any, obj: Any, device: Any) -> None:
        """Make another library's stream wait for ``fut`` on the device."""
        raise NotImplementedError

    def _backend_stats(self) -> dict:
        """The backend's leak counters and figures (``Runtime.stats``)."""
        return {}

    def _release(self) -> None:
        """Free every driver resource, and the hub's completion objects (``hub.close()``), once
        nothing on the device can use them (the waiter has stopped; called without the lock,
        possibly on a background thread after ``close`` abandoned work)."""
        raise NotImplementedError


class GraphExecHooks:
    """A graph executable's hooks (a subclass of ``aiogpu.graph.GraphExec``): one replay, and
    giving back what the executable holds. Under the runtime's lock."""

    def home_device(self) -> Any:
        """The device that runs (or joins) the replay."""
        raise NotImplementedError

    def _replay_work(self, patches: dict) -> tuple | None:
        """(device, lane, encode) for one replay with ``patches`` (checked: node -> values,
        lengths, grid, block): the core submits it as any operation, and ``encode(fut, lane,
        waits, cleanup)`` queues the replay (with its patches) after ``waits``. ValueError
        when the executable can no longer run. None: the replay spans several lanes
        (``_replay_parts``)."""
        return None

    def _replay_parts(self, patches: dict, deps: dict) -> tuple:
        """(home device, parts, plan) of a replay that spans several lanes: a list of
        ``aiogpu._core.submit.Part`` (each becomes a future: a node others wait for, a lane's
        share, an engine copy) and the backend's own ``plan`` for ``_encode_parts``. It may
        add work the replay must follow to ``deps`` (not semantic). Raises before anything is
        queued (nothing is made yet)."""
        raise NotImplementedError

    def _encode_parts(self, plan: Any, fut: Any, parts: list, waits: Sequence) -> tuple[list, list]:
        """Queue the replay: each of ``parts`` (their futures, in ``_replay_parts``'s order)
        after the parts it depends on and, where it says so, ``waits`` (the replay's live
        dependencies), then a completion of ``fut`` after the joined parts. Returns (each
        part's cleanup list, ``fut``'s): what runs once each has retired. Never raises: work
        that cannot be queued goes in a failure report."""
        raise NotImplementedError

    def _release(self) -> None:
        """Give back what the executable holds (no replay is left to read it)."""

    def destroy(self) -> None:
        """Free the executable's driver objects (idempotent; the runtime calls it at close)."""
