"""The watchdog: work that could run but stays silent for ``watchdog_s`` fails (a lost or
stalled completion), checked by the hub under the lock (``FutureHub._check_watchdog``)."""
from __future__ import annotations

import time
from typing import Any

from ..errors import WatchdogTimeout
from .futures import PENDING, GPUFuture


def _queue_order(fut: GPUFuture) -> tuple:
    """Where ``fut`` stands in its queue or engine: published packets by index, then work not
    yet published (engines: by submission time)."""
    return (fut.packet is None, fut.packet or 0, fut.submitted_at)


def check(hub: Any, posts: dict) -> None:
    """Fail work that could run but stays silent for ``watchdog_s`` (a lost completion).

    Silence counts from when the work could first run, as seen by this check: the oldest
    unretired operation of its queue or engine (they run their work in order, so younger
    work may only be waiting behind it) with everything it waits for complete. Work held up
    behind a stuck operation therefore gets its full time once that one is dealt with. A
    completion that arrived since the scan is not a timeout. An operation that has failed
    already (a dependency failed) but whose work is stuck has its queue aborted, so the work
    behind it is not held up for ever; the timeout names that failure as its cause."""
    now = time.monotonic()
    oldest: dict[Any, GPUFuture] = {}
    for f in hub._pending.values():
        current = oldest.get(f.queue)
        if current is None or _queue_order(f) < _queue_order(current):
            oldest[f.queue] = f
    ready, hub._ready_since = hub._ready_since, {}
    stale = []
    for f in oldest.values():
        if f._retiring or f in hub._given_up or not runnable(hub, f) or hub.is_complete(f.signal):
            continue
        since = hub._ready_since[f] = ready.get(f, now)
        if since <= now - (hub.watchdog_s or 0.0):
            stale.append(f)                                  # runnable, yet silent
    for fut in stale:
        exc = WatchdogTimeout(f"{fut.label} on {fut.queue}: no completion within "
                              f"{hub.watchdog_s:g} s (lost or stalled completion)",
                              queue=fut.queue, packet=fut.packet)
        exc.__cause__ = fut._exc
        failed = hub.on_timeout(fut, exc) if hub.on_timeout is not None else None
        if failed is not None:   # the backend aborted its queue: what it held fails, retires
            hub.settle_failed(failed)
            continue
        hub._given_up.add(fut)
        if fut._state == PENDING:
            # Work that cannot be aborted (a copy on an engine) may still run: fail it for
            # its awaiters but keep watching it, so its memory and signal are reused only
            # once it has really finished.
            hub._finish(fut, exc, posts)
            hub.leaked.append(fut)


def runnable(hub: Any, fut: GPUFuture) -> bool:
    """Nothing ``fut``'s work waits for on the device is still outstanding: the signals its
    packets name, and the work it was ordered after (a graph node waits on its lane's)."""
    return (all(hub.is_complete(k) for k in fut._dep_signals)
            and all(p.retired or (p.signal and hub.is_complete(p.signal)) for p in fut.preds))
