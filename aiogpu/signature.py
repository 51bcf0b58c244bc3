"""Kernel signatures: ``"f32*, const f32*, f32, u32"`` parsed into typed arguments.

A leaf module (it imports nothing of aiogpu): the core validates launches with it, and the HSA
layer (``hsa_bindings/signature.py``) derives its kernarg layout from it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCALARS = {
    "f32": np.float32, "f64": np.float64,
    "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
    "u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64,
}
DTYPES = {name: np.dtype(t) for name, t in SCALARS.items()}
POINTER_SIZE = 8


@dataclass(frozen=True)
class Arg:
    """One parameter: a scalar, or a pointer to ``dtype`` (``const`` when read-only, ``out``
    when write-only: the kernel overwrites what it touches and reads none of it)."""

    type_name: str
    pointer: bool
    const: bool = False
    out: bool = False

    @property
    def dtype(self) -> np.dtype:
        return DTYPES[self.type_name]

    @property
    def size(self) -> int:
        return POINTER_SIZE if self.pointer else self.dtype.itemsize

    def __str__(self) -> str:
        qualifier = "const " if self.const else "out " if self.out else ""
        return qualifier + self.type_name + ("*" if self.pointer else "")


def parse_signature(text: str) -> tuple[Arg, ...]:
    """Parse a comma-separated signature; raises ValueError naming the bad part."""
    if not isinstance(text, str):
        raise TypeError(f"kernel signature must be a string, not {type(text).__name__}")
    args = []
    for i, raw in enumerate(p.strip() for p in text.split(",")):
        if not raw and text.strip() == "":
            return ()
        words = raw.replace("*", " * ").split()
        qualifier = words[0] if words[:1] in (["const"], ["out"]) else None
        words = words[1:] if qualifier else words
        pointer = words[-1:] == ["*"]
        words = words[:-1] if pointer else words
        if len(words) != 1 or words[0] not in SCALARS or (qualifier and not pointer):
            raise ValueError(f"bad kernel argument type {raw!r} at position {i}: expected one of "
                             f"{', '.join(SCALARS)}, 'T*', 'const T*' or 'out T*'")
        args.append(Arg(words[0], pointer, qualifier == "const", qualifier == "out"))
    return tuple(args)
