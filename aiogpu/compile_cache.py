"""The on-disk cache of compiled GPU code (NVRTC cubins, comgr code objects): backend-neutral.

A second process that loads the same kernels starts without compiling them again. An entry is
keyed by everything that decides the compiler's output: what made it (``nvrtc``, ``comgr``), the
compiler's version, the target architecture, the options and the source; the key is the SHA-256
of those parts.

Where: ``$AIOGPU_CACHE_DIR`` if set (an empty value turns the cache off), else
``$XDG_CACHE_HOME/aiogpu``, else ``~/.cache/aiogpu``. Guarantees:

- writes are atomic (a temporary file in the same directory, then ``os.replace``): a reader
  sees a whole entry or none, also with several processes compiling the same kernel at once
  (the last writer wins; every writer wrote the same bytes);
- each entry carries a checksum of its payload: a truncated or corrupted entry reads as a
  miss (and the next compile rewrites it), never as code;
- the cache never raises: a directory that cannot be created or written costs a compile, nothing
  else.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Callable

MAGIC = b"aiogpu-cache-1\n"
_DIGEST = 32


def directory() -> str | None:
    """The cache directory now (read from the environment at each call), None when off."""
    env = os.environ.get("AIOGPU_CACHE_DIR")
    if env is not None:
        return env or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "aiogpu")


def key(*parts: str | bytes) -> str:
    """The entry name for ``parts`` (compiler, version, architecture, options, source...)."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else bytes(p)
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _path(name: str) -> str | None:
    d = directory()
    return None if d is None else os.path.join(d, name[:2], name)


def get(name: str) -> bytes | None:
    """The payload stored under ``name``, or None (absent, unreadable or corrupted)."""
    path = _path(name)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    head = len(MAGIC) + _DIGEST
    if len(data) < head or not data.startswith(MAGIC):
        return None
    digest, payload = data[len(MAGIC):head], data[head:]
    if hashlib.sha256(payload).digest() != digest:
        return None
    return payload


def put(name: str, payload: bytes) -> bool:
    """Store ``payload`` under ``name`` atomically; False if the cache is off or not writable."""
    path = _path(name)
    if path is None:
        return False
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def cached(name: str, produce: Callable[[], bytes]) -> bytes:
    """The payload under ``name``, else ``produce()`` stored there (errors of ``produce`` pass)."""
    hit = get(name)
    if hit is not None:
        return hit
    payload = produce()
    put(name, payload)
    return payload
