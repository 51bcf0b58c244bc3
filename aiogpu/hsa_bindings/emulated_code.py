"""Code objects for the emulator: a NumPy reference body stands in for GPU machine code.

A real code object is ELF bytes; an emulated one is a small JSON document behind a magic prefix,
naming kernels and a token for each body in this process's registry. The runtime builds it with
``code_object`` and hands it to ``hsa_code_object_reader_create_from_memory`` like any other;
the emulator reads it back with ``parse``. Tokens make the bytes meaningless outside this process,
as a code object for another GPU would be.
"""
from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass
from typing import Callable

from .signature import Arg, KernargLayout, parse_signature

MAGIC = b"AIOGPU-EMULATED-CODE-OBJECT\x00"
CODE_OBJECT_VERSION = 5  # hidden dispatch-geometry arguments, as v5 (see codeobject)
KERNARG_ALIGN = 16

_lock = threading.Lock()
_bodies: dict[int, Callable] = {}
_tokens = itertools.count(1)


@dataclass(frozen=True)
class EmulatedKernel:
    name: str
    signature: str
    body: Callable
    kernarg_align: int = KERNARG_ALIGN

    @property
    def args(self) -> tuple[Arg, ...]:
        return parse_signature(self.signature)

    @property
    def layout(self) -> KernargLayout:
        """Explicit arguments, a hidden byte length per pointer, then the implicit geometry."""
        return KernargLayout.of(self.args, hidden_lengths=True, implicit=True)


def register(body: Callable) -> int:
    with _lock:
        token = next(_tokens)
        _bodies[token] = body
        return token


def code_object(kernels: list[tuple[str, str, int]], *, kernarg_align: int = KERNARG_ALIGN) -> bytes:
    """Bytes of a code object holding ``(name, signature, token)`` kernels; ``kernarg_align`` is
    their kernarg segment alignment (a power of two >= 16)."""
    if kernarg_align < 16 or kernarg_align & (kernarg_align - 1):
        raise ValueError("the kernarg segment alignment is a power of two >= 16")
    doc = {"kernels": [{"name": n, "signature": s, "token": t, "kernarg_align": kernarg_align}
                       for n, s, t in kernels]}
    return MAGIC + json.dumps(doc).encode()


def metadata(blob: bytes, name: str) -> dict:
    """Kernel ``name``'s metadata in the shape of an AMD code object's (``.args`` with
    ``.offset``/``.size``/``.value_kind``, ``.kernarg_segment_size``/``_align``)."""
    kernel = parse(blob).get(name)
    if kernel is None:
        raise ValueError(f"no kernel {name!r} in the emulated code object")
    layout = kernel.layout
    args = [{".offset": off, ".size": a.size, ".value_kind": "global_buffer" if a.pointer else "by_value"}
            for a, off in zip(kernel.args, layout.offsets)]
    args += [{".offset": off, ".size": size, ".value_kind": kind} for kind, off, size in layout.implicit]
    return {".name": name, ".args": args, ".kernarg_segment_size": layout.size,
            ".kernarg_segment_align": kernel.kernarg_align}


def parse(blob: bytes) -> dict[str, EmulatedKernel]:
    """Kernels by name; raises ValueError for bytes that are not an emulated code object."""
    if not blob.startswith(MAGIC):
        raise ValueError("not an emulated code object")
    doc = json.loads(blob[len(MAGIC):])
    out = {}
    for k in doc["kernels"]:
        body = _bodies.get(k["token"])
        if body is None:
            raise ValueError(f"kernel {k['name']!r}: unknown body token {k['token']}")
        out[k["name"]] = EmulatedKernel(k["name"], k["signature"], body, k.get("kernarg_align", KERNARG_ALIGN))
    return out
