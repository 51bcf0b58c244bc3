"""The virtual KFD: ROCr 5.2.3's kernel-driver thunk (``libhsakmt.so.1``, ABI ``HSAKMT_1``)
implemented over emulated gfx90a GPUs, so that the real ROCr library runs without a GPU.

``vkfd.c`` is built by the package build into ``libhsakmt.so.1`` next to this file (where a C
compiler and Debian's ``libhsakmt-dev`` headers exist). ``load()`` puts it and the real
``libhsa-runtime64.so.1`` into a link-map namespace of their own (``dlmopen``): there ROCr's
``DT_NEEDED libhsakmt.so.1`` resolves to the virtual thunk by its soname, and the process's
own namespace keeps the real ROCr and thunk for the ``hsa`` backend, so both can be loaded in
one process in either order. The real ROCr is initialised at most once at a time per process
(``hsa_init`` is reference counted); the device configuration applies when ROCr opens the KFD.

Only the hsa-virtual backend (``aiogpu.hsa.runtime``) and its tests use this module.
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailable

LIBRARY = Path(__file__).with_name("libhsakmt.so.1")
ROCR = "libhsa-runtime64.so.1"
PACKAGES = ("build it with gcc and Debian's libhsakmt-dev headers (pip install the package again), "
            "and install ROCr 5.2.3 (Debian package libhsa-runtime64-1)")
RTLD_NOW = 2
RTLD_NOLOAD = 4
LM_ID_NEWLM = -1
RTLD_DI_LMID = 1

INJECT_QUEUE_ERROR, INJECT_MEMORY_FAULT, INJECT_LOST_INTERRUPTS, INJECT_SDMA_QUEUES = 1, 2, 3, 4
INJECT_MEMORY_FAULT_NEXT = 5
# The per-GPU counters ``counters()`` reports (the C library's names, in its order).
DISPATCH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64,
                                     ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint16),
                                     ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32)


class VirtualKfd:
    """The loaded virtual thunk and the real ROCr bound to it (one per process)."""

    def __init__(self, kfd: ctypes.CDLL, rocr: ctypes.CDLL, how: str, environ: Any = None):
        self.kfd, self.rocr, self.how = kfd, rocr, how
        self._environ = environ          # the namespace's libc ``environ`` (a c_void_p in_dll)
        self._environments: list = []    # every snapshot handed to it: never freed
        k = kfd
        k.vkfd_configure.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        k.vkfd_counter.restype = ctypes.c_uint64
        k.vkfd_counter.argtypes = [ctypes.c_int, ctypes.c_int]
        k.vkfd_counter_name.restype = ctypes.c_char_p
        k.vkfd_inject.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint64]
        k.vkfd_host_address.restype = ctypes.c_uint64
        k.vkfd_host_address.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        k.vkfd_can_access.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]
        k.vkfd_allocation.argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
        k.vkfd_report_fault.argtypes = [ctypes.c_uint64]
        k.vkfd_set_dispatch_callback.argtypes = [DISPATCH_CALLBACK]
        k.vkfd_version.restype = ctypes.c_char_p
        k.vkfd_note_user_kernel.argtypes = [ctypes.c_uint64]
        self.counter_names = tuple(k.vkfd_counter_name(i).decode() for i in range(k.vkfd_counter_count()))
        self.version = k.vkfd_version().decode()
        self._callback: Any = None

    # -- configuration ---------------------------------------------------------------------------
    def sync_environment(self) -> None:
        """Give the namespace's libc a snapshot of ``os.environ``. Its ``environ`` pointed at the
        process's array as it was when it loaded, which the process's libc frees once the
        environment grows (``os.environ[...] = ...``): ROCr's getenv then read freed memory.
        Snapshots are kept forever, as a libc keeps what ``environ`` pointed at."""
        if self._environ is None:
            return
        items = [f"{k}={v}".encode() for k, v in os.environ.items()]
        arr = (ctypes.c_char_p * (len(items) + 1))(*items, None)
        self._environments.append((arr, items))
        self._environ.value = ctypes.addressof(arr)

    def configure(self, gpus: int, sdma_queues: int, eager: bool) -> bool:
        """Devices for ROCr's next KFD open; False while ROCr has it open (configuration fixed)."""
        rc = self.kfd.vkfd_configure(gpus, sdma_queues, int(eager))
        if rc == -2:
            raise ValueError(f"the virtual KFD takes 1..8 GPUs and sdma_queues >= 0 (got {gpus}, {sdma_queues})")
        return rc == 0

    @property
    def is_open(self) -> bool:
        return bool(self.kfd.vkfd_is_open())

    @property
    def gpus(self) -> int:
        return self.kfd.vkfd_gpus()

    @property
    def generation(self) -> int:
        """Which opening of the KFD by ROCr this is: each one is a fresh process to the virtual
        KFD (a device evicted by a memory fault is back), where real KFD keeps a process
        evicted until it exits."""
        return self.kfd.vkfd_generation()

    def set_eager(self, eager: bool) -> None:
        self.kfd.vkfd_set_eager(int(eager))

    def set_dispatch_callback(self, fn: Any) -> None:
        """``fn(gpu, kernel_object, kernarg, grid, workgroup, dims, group, private) -> int``
        runs each user dispatch on an engine thread: 0 done, < 0 a memory fault at the address
        given to ``report_fault``, > 0 a queue error with that CP error code. None clears it
        (returns once no call is running)."""
        cb = DISPATCH_CALLBACK(fn) if fn is not None else DISPATCH_CALLBACK()
        self.kfd.vkfd_set_dispatch_callback(cb)
        self._callback = cb          # the C side holds the pointer: keep the thunk alive

    def note_user_kernel(self, kernel_object: int) -> None:
        """``kernel_object`` is a kernel aiogpu loaded: never taken for one of ROCr's blits."""
        self.kfd.vkfd_note_user_kernel(kernel_object)

    def report_fault(self, address: int) -> None:
        self.kfd.vkfd_report_fault(address)

    # -- what the devices did, and faults --------------------------------------------------------
    def counters(self, gpu: int) -> dict[str, int]:
        """What GPU ``gpu``'s emulated device executed since the configuration."""
        return {name: self.kfd.vkfd_counter(gpu, i) for i, name in enumerate(self.counter_names)}

    def inject(self, gpu: int, kind: int, arg: int = 0) -> None:
        """Fault injection (``INJECT_*``); ValueError for a GPU the KFD does not have."""
        if self.kfd.vkfd_inject(gpu, kind, arg) != 0:
            raise ValueError(f"the virtual KFD has no GPU {gpu} (it has {self.gpus})")

    def host_address(self, address: int, nbytes: int) -> int:
        """The host address behind a GPU address range (0 where no allocation holds it)."""
        return self.kfd.vkfd_host_address(address, nbytes)

    def can_access(self, gpu: int, address: int, nbytes: int) -> bool:
        return bool(self.kfd.vkfd_can_access(gpu, address, nbytes))

    def allocation(self, address: int) -> tuple[int, int] | None:
        base, size = ctypes.c_uint64(), ctypes.c_uint64()
        if not self.kfd.vkfd_allocation(address, ctypes.byref(base), ctypes.byref(size)):
            return None
        return base.value, size.value


_lock = threading.Lock()
_loaded: VirtualKfd | None = None
_failed: str | None = None


def available() -> tuple[bool, str]:
    """(True, what was loaded) when the virtual KFD and ROCr load here, else (False, why not)."""
    try:
        vk = load()
    except BackendUnavailable as exc:
        return False, exc.reason
    return True, vk.how


def load() -> VirtualKfd:
    """The process's virtual KFD with ROCr bound to it. Raises BackendUnavailable naming the
    packages when the library was not built or ROCr is missing."""
    global _loaded, _failed
    with _lock:
        if _loaded is not None:
            return _loaded
        if _failed is not None:
            raise BackendUnavailable("hsa-virtual", _failed, PACKAGES)
        try:
            _loaded = _load()
        except BackendUnavailable as exc:
            _failed = exc.reason
            raise
        return _loaded


def _dlerror(libc: ctypes.CDLL) -> str:
    err = libc.dlerror()
    text = ctypes.cast(err, ctypes.c_char_p).value if err else None
    return text.decode(errors="replace") if text else "unknown error"


def _load() -> VirtualKfd:
    if not LIBRARY.exists():
        raise BackendUnavailable("hsa-virtual", f"the virtual KFD ({LIBRARY.name}) was not built", PACKAGES)
    libc = ctypes.CDLL(None)
    libc.dlmopen.restype = ctypes.c_void_p
    libc.dlmopen.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.c_int]
    libc.dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    libc.dlsym.restype = ctypes.c_void_p
    libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    libc.dlerror.restype = ctypes.c_void_p
    kfd_handle = libc.dlmopen(LM_ID_NEWLM, os.fsencode(LIBRARY), RTLD_NOW)
    if not kfd_handle:
        raise BackendUnavailable("hsa-virtual", f"dlmopen of the virtual KFD failed: {_dlerror(libc)}", PACKAGES)
    lmid = ctypes.c_long()
    libc.dlinfo(kfd_handle, RTLD_DI_LMID, ctypes.byref(lmid))
    rocr_handle = libc.dlmopen(lmid.value, ROCR.encode(), RTLD_NOW)
    if not rocr_handle:
        raise BackendUnavailable("hsa-virtual", f"{ROCR} not loadable beside the virtual KFD: {_dlerror(libc)}",
                                 PACKAGES)
    # ROCr must have bound to this thunk (its soname matched); a symbol only the virtual KFD has,
    # looked up through ROCr's handle (its dependencies), says so.
    if not libc.dlsym(rocr_handle, b"vkfd_version"):
        raise BackendUnavailable("hsa-virtual", f"{ROCR} bound to another libhsakmt.so.1 than the virtual KFD",
                                 PACKAGES)
    kfd = ctypes.CDLL(str(LIBRARY), handle=kfd_handle)
    rocr = ctypes.CDLL(ROCR, handle=rocr_handle)
    path = _library_path(libc, rocr_handle) or ROCR
    environ = None
    libc_handle = libc.dlmopen(lmid.value, b"libc.so.6", RTLD_NOW | RTLD_NOLOAD)
    if libc_handle:
        environ = ctypes.c_void_p.in_dll(ctypes.CDLL("libc.so.6", handle=libc_handle), "environ")
    vk = VirtualKfd(kfd, rocr, f"{path} over the virtual KFD ({LIBRARY.name})", environ)
    vk.sync_environment()
    return vk


def _library_path(libc: ctypes.CDLL, handle: int) -> str | None:
    """The file a dlopen handle loaded (its link_map's l_name)."""
    class LinkMap(ctypes.Structure):
        _fields_ = [("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p)]

    out = ctypes.POINTER(LinkMap)()
    if libc.dlinfo(ctypes.c_void_p(handle), 2, ctypes.byref(out)) != 0:   # RTLD_DI_LINKMAP
        return None
    name = out.contents.l_name
    return os.path.realpath(name.decode()) if name else None
