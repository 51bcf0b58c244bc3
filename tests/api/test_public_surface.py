"""The public classes show their API and nothing else: the core's and the backends' own methods
(submission, tracking, dependency bookkeeping, lane choice, validation helpers) are private, so
that autocomplete and ``help()`` show what a user may call. A new public method is a decision:
add it here on purpose."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

import aiogpu

PUBLIC_METHODS = {
    "Runtime": {"close", "copy", "describe", "fill", "gather", "instantiate", "leaks", "leaks_async", "stats",
                "stream_future", "wait_on"},
    "Device": {"alloc", "launch", "load", "trim"},
    "GPUFuture": {"add_done_callback", "asyncio", "cancel", "cancelled", "done", "exception", "get_loop",
                  "remove_done_callback", "result", "wait", "wait_on"},
    "Buffer": {"fill", "free", "to_numpy", "view"},
}


def public_methods(cls: type) -> set[str]:
    """Names callable on instances of ``cls`` without a leading underscore (properties and data
    attributes are not methods)."""
    out = set()
    for name in dir(cls):
        if name.startswith("_"):
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, (staticmethod, classmethod)) or (callable(attr) and not isinstance(attr, property)):
            out.add(name)
    return out


@pytest.mark.parametrize("backend_kwargs", [{"gpus": 1}, {"gpus": 1, "rocr_version": "5.7"}])
def test_the_public_classes_show_only_their_api(backend_kwargs):
    rt = aiogpu.Runtime("emulator", **backend_kwargs)
    try:
        dev = rt.devices[0]
        buf = dev.alloc(64)
        fut = aiogpu.copy(buf, np.zeros(64, np.uint8))
        fut.wait()
        found = {"Runtime": type(rt), "Device": type(dev), "GPUFuture": type(fut), "Buffer": type(buf)}
        for name, cls in found.items():
            extra = public_methods(cls) - PUBLIC_METHODS[name] - {"probe", "check_options"}
            assert not extra, f"{name} ({cls.__qualname__}) exposes internal methods: {sorted(extra)}"
            assert PUBLIC_METHODS[name] <= public_methods(cls), name
        buf.free()
    finally:
        rt.close()


def test_internal_bookkeeping_is_not_public():
    """The names a first-time user met in autocomplete before they were made private."""
    for cls, names in ((aiogpu.Runtime, ("submit_guarded", "track", "check_after", "check_open", "kernarg_block")),
                       (aiogpu.GPUFuture, ("add_dep_signal", "add_dependent", "on_retired", "submitted_work")),
                       (aiogpu.Device, ("pick_lane", "submit_group", "track_on", "loaded", "shape")),
                       (aiogpu.Buffer, ("check_usable", "unuse"))):
        for name in names:
            assert not hasattr(cls, name), f"{cls.__name__}.{name} is public"
