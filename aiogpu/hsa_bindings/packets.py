"""AQL packet structs (64 bytes each) and header encoding, as ``hsa.h``/``hsa_ext_amd.h`` define them.

A packet's first 32 bits are ``header | setup << 16``; the writer publishes that word last, in one
release store, so a packet processor never sees a valid header over a half-written body.
"""
from __future__ import annotations

import ctypes
from ctypes import c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

from .types import hsa_signal_t

PACKET_SIZE = 64

# hsa_packet_type_t
HSA_PACKET_TYPE_VENDOR_SPECIFIC = 0
HSA_PACKET_TYPE_INVALID = 1
HSA_PACKET_TYPE_KERNEL_DISPATCH = 2
HSA_PACKET_TYPE_BARRIER_AND = 3
HSA_PACKET_TYPE_AGENT_DISPATCH = 4
HSA_PACKET_TYPE_BARRIER_OR = 5
HSA_AMD_PACKET_TYPE_BARRIER_VALUE = 2

# hsa_fence_scope_t
HSA_FENCE_SCOPE_NONE = 0
HSA_FENCE_SCOPE_AGENT = 1
HSA_FENCE_SCOPE_SYSTEM = 2

# hsa_packet_header_t (bit offsets) and widths
HSA_PACKET_HEADER_TYPE = 0
HSA_PACKET_HEADER_BARRIER = 8
HSA_PACKET_HEADER_SCACQUIRE_FENCE_SCOPE = 9
HSA_PACKET_HEADER_SCRELEASE_FENCE_SCOPE = 11
HSA_PACKET_HEADER_WIDTH_TYPE = 8
HSA_PACKET_HEADER_WIDTH_BARRIER = 1
HSA_PACKET_HEADER_WIDTH_SCACQUIRE_FENCE_SCOPE = 2
HSA_PACKET_HEADER_WIDTH_SCRELEASE_FENCE_SCOPE = 2
HSA_KERNEL_DISPATCH_PACKET_SETUP_DIMENSIONS = 0
HSA_KERNEL_DISPATCH_PACKET_SETUP_WIDTH_DIMENSIONS = 2

BARRIER_MAX_DEPS = 5  # dep_signal[5] in a barrier-AND/OR packet


class hsa_kernel_dispatch_packet_t(ctypes.Structure):
    _fields_ = [
        ("header", c_uint16),
        ("setup", c_uint16),
        ("workgroup_size_x", c_uint16),
        ("workgroup_size_y", c_uint16),
        ("workgroup_size_z", c_uint16),
        ("reserved0", c_uint16),
        ("grid_size_x", c_uint32),
        ("grid_size_y", c_uint32),
        ("grid_size_z", c_uint32),
        ("private_segment_size", c_uint32),
        ("group_segment_size", c_uint32),
        ("kernel_object", c_uint64),
        ("kernarg_address", c_void_p),
        ("reserved2", c_uint64),
        ("completion_signal", hsa_signal_t),
    ]


class hsa_barrier_and_packet_t(ctypes.Structure):
    _fields_ = [
        ("header", c_uint16),
        ("reserved0", c_uint16),
        ("reserved1", c_uint32),
        ("dep_signal", hsa_signal_t * BARRIER_MAX_DEPS),
        ("reserved2", c_uint64),
        ("completion_signal", hsa_signal_t),
    ]


class hsa_barrier_or_packet_t(ctypes.Structure):
    _fields_ = hsa_barrier_and_packet_t._fields_


class hsa_amd_vendor_packet_header_t(ctypes.Structure):
    _fields_ = [("header", c_uint16), ("AmdFormat", c_uint8), ("reserved", c_uint8)]


class hsa_amd_barrier_value_packet_t(ctypes.Structure):
    _fields_ = [
        ("header", hsa_amd_vendor_packet_header_t),
        ("reserved0", c_uint32),
        ("signal", hsa_signal_t),
        ("value", c_int64),
        ("mask", c_int64),
        ("cond", c_uint32),
        ("reserved1", c_uint32),
        ("reserved2", c_uint64),
        ("reserved3", c_uint64),
        ("completion_signal", hsa_signal_t),
    ]


def make_header(packet_type: int, *, barrier: bool = False,
                acquire: int = HSA_FENCE_SCOPE_SYSTEM, release: int = HSA_FENCE_SCOPE_SYSTEM) -> int:
    """The 16-bit AQL header for a packet type with its barrier bit and fence scopes."""
    return (packet_type << HSA_PACKET_HEADER_TYPE
            | int(barrier) << HSA_PACKET_HEADER_BARRIER
            | acquire << HSA_PACKET_HEADER_SCACQUIRE_FENCE_SCOPE
            | release << HSA_PACKET_HEADER_SCRELEASE_FENCE_SCOPE)


def header_type(header: int) -> int:
    return header & ((1 << HSA_PACKET_HEADER_WIDTH_TYPE) - 1)


def header_barrier(header: int) -> bool:
    return bool(header >> HSA_PACKET_HEADER_BARRIER & 1)


INVALID_HEADER = make_header(HSA_PACKET_TYPE_INVALID, acquire=0, release=0)
