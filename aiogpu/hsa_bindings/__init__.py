"""The HSA ABI in ctypes, and the loader that picks the real ROCr library or the emulator."""
from . import atomics, packets, prototypes, types
from .loader import BackendUnavailable, HsaApi, HsaError, load

__all__ = ["atomics", "packets", "prototypes", "types", "load", "HsaApi", "HsaError", "BackendUnavailable"]
