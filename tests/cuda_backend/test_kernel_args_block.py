"""The CUDA launch's parameter block (``encode.LoadedCudaKernel.pack``): compiled, the values
are stored by C code (``pack_direct``); the bytes must be exactly what ``struct.pack_into``
of the block's format writes, and what struct refuses must still be refused with its error.
Runs without a driver: packing is host memory only."""
from __future__ import annotations

import ctypes
import struct

import pytest

import aiogpu
from aiogpu.cuda.encode import LoadedCudaKernel

SIGNATURE = "u8, i8, u16, i16, u32, i32, u64, i64, f32, f64, f32*, u8, f64"


def _loaded(signature: str = SIGNATURE) -> LoadedCudaKernel:
    k = aiogpu.kernel(signature, cuda='extern "C" __global__ void k() {}', name="k")(lambda launch, *a: None)
    return LoadedCudaKernel(k, 0x1234, None)


def _block(loaded: LoadedCudaKernel) -> bytes:
    return ctypes.string_at(loaded.base, loaded.size)


def _expected(loaded: LoadedCudaKernel, values) -> bytes:
    block = bytearray(loaded.size)
    struct.pack_into(loaded.fmt, block, 0, *values)
    return bytes(block)


CASES = [
    (0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0, 0, 0.0),
    (255, -128, 65535, -32768, 2**32 - 1, -2**31, 2**64 - 1, -2**63, 3.4028234663852886e38, -1e308,
     0xFFFF_FFFF_FFFF_FFF0, 1, 5e-324),
    (7, 127, 1, 32767, 123456, 2**31 - 1, 2**40 + 3, 2**63 - 1, float("inf"), float("-inf"), 0x7000_0000, True, -0.0),
    (1, -1, 2, -2, 3, -3, 4, -4, 1.5, 2.25, 8, 9, 1e-300),
]


@pytest.mark.parametrize("values", CASES)
def test_the_block_holds_what_struct_writes(values):
    loaded = _loaded()
    assert len(loaded.kinds) == len(loaded.offsets) == 13
    ptrs = loaded.pack(values)
    assert ptrs == loaded.params != 0
    assert _block(loaded) == _expected(loaded, values)
    # (a list as well as a tuple, as the core passes either)
    loaded.pack([0] * 8 + [0.0, 0.0, 0, 0, 0.0])
    loaded.pack(list(values))
    assert _block(loaded) == _expected(loaded, values)


def test_nan_and_a_float_of_a_float32_argument_round_as_struct_rounds():
    loaded = _loaded("f32, f64")
    for values in [(float("nan"), float("nan")), (0.1, 0.1), (1 / 3, 1 / 3), (3, 4)]:
        loaded.pack(values)
        assert _block(loaded) == _expected(loaded, values)


@pytest.mark.parametrize("index, bad", [(0, 256), (1, -129), (4, -1), (6, 2**64), (7, 2**63), (8, 3.5e38),
                                        (8, "1.0"), (0, 1.0), (9, None)])
def test_what_struct_refuses_is_refused_with_its_error(index, bad):
    loaded = _loaded()
    good = list(CASES[3])
    loaded.pack(good)
    before = _block(loaded)
    values = list(good)
    values[index] = bad
    with pytest.raises(Exception) as got:
        struct.pack_into(loaded.fmt, bytearray(loaded.size), 0, *values)
    with pytest.raises(type(got.value)):
        loaded.pack(values)
    loaded.pack(good)
    assert _block(loaded) == before


def test_a_wrong_count_raises_structs_error():
    loaded = _loaded("u32, u32")
    with pytest.raises(struct.error):
        loaded.pack((1,))
    with pytest.raises(struct.error):
        loaded.pack((1, 2, 3))


def test_a_kernel_without_arguments_packs_nothing():
    loaded = _loaded("")
    assert loaded.pack(()) == 0 and loaded.kinds == b"" and loaded.offsets == ()
