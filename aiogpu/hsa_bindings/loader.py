"""Pick the HSA library: the real ROCr runtime when it answers with a GPU, else the emulator;
or, for ``hsa-virtual``, the real ROCr library over the virtual KFD (``aiogpu.vkfd``).

Both come back as one ``HsaApi``: an object whose attributes are the HSA functions of
``prototypes.PROTOTYPES``, typed identically. For the real library they are the shared object's
symbols; for the emulator they are C function pointers (ctypes callbacks) over its Python
implementation, so arguments are converted exactly as for the real library.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import BackendUnavailable, HsaError
from . import types as T
from .prototypes import OPTIONAL, PROTOTYPES

LIBRARY_NAMES = ("libhsa-runtime64.so.1", "libhsa-runtime64.so")
BACKENDS = ("hsa", "emulator", "hsa-virtual")


@dataclass
class HsaApi:
    """The HSA functions of one library, and why it was chosen."""

    backend: str
    reason: str
    library: Any = None            # the CDLL, or the emulator object
    missing: tuple[str, ...] = ()  # optional functions the library lacks
    vkfd: Any = None               # hsa-virtual: the aiogpu.vkfd.VirtualKfd ROCr runs over
    _keep: list = field(default_factory=list, repr=False)

    @property
    def has_engine_copy(self) -> bool:
        """True when the library can place a copy on a chosen SDMA engine."""
        return not ({"hsa_amd_memory_async_copy_on_engine", "hsa_amd_memory_copy_engine_status"}
                    & set(self.missing))

    @property
    def emulator(self) -> Any:
        """The emulator object (for fault injection in tests); None on the real library."""
        return self.library if self.backend == "emulator" else None

    def check(self, status: int, what: str) -> None:
        if status != T.HSA_STATUS_SUCCESS:
            raise HsaError(f"{what} failed: {T.status_name(status)} (0x{status:x})", status=status)

    def shut_down(self) -> None:
        self.hsa_shut_down()


def bind_library(lib: ctypes.CDLL) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Type every symbol of PROTOTYPES in ``lib``; returns them and the optional ones absent.

    A required symbol that is absent raises AttributeError.
    """
    funcs, missing = {}, []
    for name, (restype, argtypes) in PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if name in OPTIONAL:
                missing.append(name)
                continue
            raise
        fn.restype, fn.argtypes = restype, argtypes
        funcs[name] = fn
    return funcs, tuple(missing)


def bind_python(impl: Any) -> tuple[dict[str, Any], list, tuple[str, ...]]:
    """Wrap the methods of a Python HSA implementation as C function pointers of PROTOTYPES."""
    funcs, keep, missing = {}, [], []
    for name, (restype, argtypes) in PROTOTYPES.items():
        py = getattr(impl, name, None)
        if py is None:
            missing.append(name)
            continue
        cfunc = ctypes.CFUNCTYPE(restype, *argtypes)(py)
        keep.append(cfunc)
        # A fresh function-pointer object typed like a library symbol (argtypes/restype set).
        fn = ctypes.cast(cfunc, ctypes.CFUNCTYPE(restype, *argtypes))
        fn.argtypes, fn.restype = argtypes, restype
        funcs[name] = fn
    return funcs, keep, tuple(missing)


def _make_api(backend: str, reason: str, library: Any, funcs: dict, missing, keep=()) -> HsaApi:
    api = HsaApi(backend=backend, reason=reason, library=library, missing=tuple(missing))
    api._keep.extend(keep)
    for name, fn in funcs.items():
        setattr(api, name, fn)
    return api


def open_real_library() -> tuple[ctypes.CDLL | None, str]:
    """dlopen ROCr; returns (library or None, what happened)."""
    errors = []
    for name in LIBRARY_NAMES:
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL), name
        except OSError as exc:
            errors.append(str(exc))
    return None, "; ".join(errors)


def _count_gpu_agents(funcs: dict) -> int:
    count = ctypes.c_int(0)

    @T.agent_iterate_callback_t
    def visit(agent, _data):
        kind = ctypes.c_uint32()
        if funcs["hsa_agent_get_info"](agent, T.HSA_AGENT_INFO_DEVICE, ctypes.byref(kind)) == 0:
            if kind.value == T.HSA_DEVICE_TYPE_GPU:
                count.value += 1
        return T.HSA_STATUS_SUCCESS

    funcs["hsa_iterate_agents"](visit, None)
    return count.value


def try_real() -> tuple[HsaApi | None, str]:
    """The real ROCr runtime if it loads, initialises and has a GPU agent; else (None, why not)."""
    lib, how = open_real_library()
    if lib is None:
        return None, f"libhsa-runtime64 not loadable ({how})"
    try:
        funcs, missing = bind_library(lib)
    except AttributeError as exc:
        return None, f"{how} lacks a required HSA symbol: {exc}"
    status = funcs["hsa_init"]()
    if status != T.HSA_STATUS_SUCCESS:
        return None, f"{how} loaded but hsa_init returned 0x{status:x} ({T.status_name(status)})"
    gpus = _count_gpu_agents(funcs)
    if gpus == 0:
        funcs["hsa_shut_down"]()
        return None, f"{how} initialised but has no GPU agent"
    reason = f"{how}: hsa_init succeeded with {gpus} GPU agent(s)"
    if missing:
        reason += f"; optional calls absent: {', '.join(missing)}"
    return _make_api("hsa", reason, lib, funcs, missing), reason


def make_emulator(reason: str, *, gpus: int | None = None, **options: Any) -> HsaApi:
    """A fresh in-process emulator with ``gpus`` GPU agents (default AIOGPU_EMULATOR_GPUS or 2).

    Raises ValueError naming AIOGPU_EMULATOR_GPUS when that variable is not a whole number."""
    from .emulator import EmulatedLibrary  # the one place the emulator enters

    if gpus is None:
        raw = os.environ.get("AIOGPU_EMULATOR_GPUS", "2")
        try:
            gpus = int(raw)
        except ValueError:
            raise ValueError(f"AIOGPU_EMULATOR_GPUS must be a whole number of GPUs, got {raw!r}") from None
    impl = EmulatedLibrary(gpus=gpus, **options)
    funcs, keep, missing = bind_python(impl)
    api = _make_api("emulator", reason, impl, funcs, missing, keep)
    api.check(api.hsa_init(), "hsa_init")
    return api


HSA_FIX = ("needs an AMD GPU with the ROCm driver and ROCr installed (Debian package libhsa-runtime64-1); "
           "use the emulator backend where there is none")


def make_virtual(reason: str, *, gpus: int | None = None, sdma_queues: int | None = None, eager: bool = False) -> HsaApi:
    """The real ROCr library over the virtual KFD with ``gpus`` GPUs (default, as the emulator's,
    AIOGPU_EMULATOR_GPUS or 2), ``sdma_queues`` SDMA queues
    granted per GPU before KFD refuses (default: 16, the engines' queue slots) and the eager
    command processor if ``eager``; ``hsa_init`` called (the caller balances it with
    ``shut_down``). BackendUnavailable where the library was not built or ROCr is missing;
    ValueError for a configuration unlike the one another open hsa-virtual runtime of this
    process has (ROCr's devices are fixed while it is initialised)."""
    from .. import vkfd as vkfd_module   # the one place the virtual KFD enters

    if gpus is None:
        raw = os.environ.get("AIOGPU_EMULATOR_GPUS", "2")
        gpus = int(raw) if raw.isdigit() else -1
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= 8:
        raise ValueError(f"hsa-virtual takes 1..8 GPUs, got {gpus!r}")
    sdma = 16 if sdma_queues is None else sdma_queues
    if isinstance(sdma, bool) or not isinstance(sdma, int) or sdma < 0:
        raise ValueError(f"sdma_queues must be a whole number >= 0, got {sdma_queues!r}")
    from ..vkfd import harness

    vk = vkfd_module.load()
    harness.install(vk)
    if not vk.configure(gpus, sdma, bool(eager)):
        have = (vk.gpus, vk.kfd.vkfd_sdma_limit(0))
        if have != (gpus, sdma):
            raise ValueError(f"another hsa-virtual runtime of this process is open with {have[0]} GPU(s) and "
                             f"sdma_queues={have[1]}; ROCr's devices are fixed until it closes "
                             f"(asked for {gpus} and {sdma})")
        vk.set_eager(bool(eager))
    try:
        funcs, missing = bind_library(vk.rocr)
    except AttributeError as exc:
        raise BackendUnavailable("hsa-virtual", f"{vk.how} lacks a required HSA symbol: {exc}",
                                 vkfd_module.PACKAGES) from None
    vk.sync_environment()    # ROCr reads its flags (HSA_*) from the environment at hsa_init
    status = funcs["hsa_init"]()
    if status != T.HSA_STATUS_SUCCESS:
        raise BackendUnavailable("hsa-virtual", f"hsa_init over the virtual KFD returned 0x{status:x} "
                                 f"({T.status_name(status)})", vkfd_module.PACKAGES)
    found = _count_gpu_agents(funcs)
    why = f"{vk.how}: hsa_init succeeded with {found} virtual GPU agent(s)"
    if missing:
        why += f"; optional calls absent: {', '.join(missing)}"
    api = _make_api("hsa-virtual", f"{reason}; {why}" if reason else why, vk.rocr, funcs, missing)
    api.vkfd = vk
    return api


def load(backend: str, reason: str = "", **emulator_options: Any) -> HsaApi:
    """The HSA API of ``backend``: ``"hsa"`` (the real ROCr library), ``"emulator"`` or
    ``"hsa-virtual"`` (the real ROCr over the virtual KFD; options ``gpus``, ``sdma_queues``,
    ``eager``, see ``make_virtual``).

    Raises BackendUnavailable for ``"hsa"`` where ROCr does not answer with a GPU (never a
    silent fallback: the caller chose). ``reason`` says why this backend was chosen.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown HSA backend {backend!r}; expected one of {BACKENDS}")
    if backend == "emulator":
        return make_emulator(reason or "emulator requested", **emulator_options)
    if backend == "hsa-virtual":
        return make_virtual(reason, **emulator_options)
    api, why = try_real()
    if api is None:
        raise BackendUnavailable("hsa", why, HSA_FIX)
    if reason:
        api.reason = f"{reason}; {api.reason}"
    return api
