"""Every HSA function aiogpu calls, with its C prototype as ctypes ``(restype, argtypes)``.

The same table types the real library's symbols and the emulator's functions, so the runtime above
cannot tell them apart. ``OPTIONAL`` names are probed: ROCr 5.2.3 lacks the SDMA engine calls.
"""
from __future__ import annotations

from ctypes import POINTER, c_bool, c_char_p, c_int, c_size_t, c_uint32, c_uint64, c_void_p

from .types import (
    agent_iterate_callback_t, hsa_agent_info_t, hsa_agent_t, hsa_amd_memory_pool_info_t,
    hsa_amd_memory_pool_t, hsa_amd_profiling_dispatch_time_t, hsa_amd_queue_priority_t,
    hsa_amd_sdma_engine_id_t, hsa_code_object_reader_t, hsa_default_float_rounding_mode_t,
    hsa_executable_symbol_info_t, hsa_executable_symbol_t, hsa_executable_t,
    hsa_loaded_code_object_t, hsa_profile_t, hsa_queue_t, hsa_queue_type32_t,
    hsa_signal_condition_t, hsa_signal_t, hsa_signal_value_t, hsa_status_t, hsa_system_info_t,
    hsa_wait_state_t, pool_iterate_callback_t, queue_error_callback_t, signal_handler_t, system_event_callback_t,
)

S = hsa_status_t
V = hsa_signal_value_t
Q = POINTER(hsa_queue_t)

PROTOTYPES: dict[str, tuple[object, list]] = {
    # runtime
    "hsa_init": (S, []),
    "hsa_shut_down": (S, []),
    "hsa_status_string": (S, [hsa_status_t, POINTER(c_char_p)]),
    "hsa_system_get_info": (S, [hsa_system_info_t, c_void_p]),
    # agents and memory
    "hsa_iterate_agents": (S, [agent_iterate_callback_t, c_void_p]),
    "hsa_agent_get_info": (S, [hsa_agent_t, hsa_agent_info_t, c_void_p]),
    "hsa_amd_agent_iterate_memory_pools": (S, [hsa_agent_t, pool_iterate_callback_t, c_void_p]),
    "hsa_amd_memory_pool_get_info": (S, [hsa_amd_memory_pool_t, hsa_amd_memory_pool_info_t, c_void_p]),
    "hsa_amd_memory_pool_allocate": (S, [hsa_amd_memory_pool_t, c_size_t, c_uint32, POINTER(c_void_p)]),
    "hsa_amd_memory_pool_free": (S, [c_void_p]),
    "hsa_amd_agents_allow_access": (S, [c_uint32, POINTER(hsa_agent_t), POINTER(c_uint32), c_void_p]),
    "hsa_amd_memory_lock": (S, [c_void_p, c_size_t, POINTER(hsa_agent_t), c_int, POINTER(c_void_p)]),
    "hsa_amd_memory_unlock": (S, [c_void_p]),
    # signals
    "hsa_signal_create": (S, [V, c_uint32, POINTER(hsa_agent_t), POINTER(hsa_signal_t)]),
    "hsa_amd_signal_create": (S, [V, c_uint32, POINTER(hsa_agent_t), c_uint64, POINTER(hsa_signal_t)]),
    "hsa_signal_destroy": (S, [hsa_signal_t]),
    "hsa_signal_load_scacquire": (V, [hsa_signal_t]),
    "hsa_signal_load_relaxed": (V, [hsa_signal_t]),
    "hsa_signal_store_relaxed": (None, [hsa_signal_t, V]),
    "hsa_signal_store_screlease": (None, [hsa_signal_t, V]),
    "hsa_signal_add_scacq_screl": (None, [hsa_signal_t, V]),
    "hsa_signal_add_relaxed": (None, [hsa_signal_t, V]),
    "hsa_signal_subtract_scacq_screl": (None, [hsa_signal_t, V]),
    "hsa_signal_subtract_relaxed": (None, [hsa_signal_t, V]),
    "hsa_signal_wait_scacquire": (V, [hsa_signal_t, hsa_signal_condition_t, V, c_uint64, hsa_wait_state_t]),
    "hsa_amd_signal_wait_any": (c_uint32, [c_uint32, POINTER(hsa_signal_t), POINTER(hsa_signal_condition_t),
                                           POINTER(V), c_uint64, hsa_wait_state_t, POINTER(V)]),
    "hsa_amd_signal_async_handler": (S, [hsa_signal_t, hsa_signal_condition_t, V, signal_handler_t, c_void_p]),
    # queues
    "hsa_queue_create": (S, [hsa_agent_t, c_uint32, hsa_queue_type32_t, queue_error_callback_t, c_void_p,
                             c_uint32, c_uint32, POINTER(Q)]),
    "hsa_queue_destroy": (S, [Q]),
    "hsa_amd_queue_set_priority": (S, [Q, hsa_amd_queue_priority_t]),
    "hsa_queue_load_write_index_scacquire": (c_uint64, [Q]),
    "hsa_queue_load_write_index_relaxed": (c_uint64, [Q]),
    "hsa_queue_store_write_index_screlease": (None, [Q, c_uint64]),
    "hsa_queue_add_write_index_scacq_screl": (c_uint64, [Q, c_uint64]),
    "hsa_queue_cas_write_index_scacq_screl": (c_uint64, [Q, c_uint64, c_uint64]),
    "hsa_queue_load_read_index_scacquire": (c_uint64, [Q]),
    # copies
    "hsa_amd_memory_async_copy": (S, [c_void_p, hsa_agent_t, c_void_p, hsa_agent_t, c_size_t, c_uint32,
                                      POINTER(hsa_signal_t), hsa_signal_t]),
    "hsa_amd_memory_async_copy_on_engine": (S, [c_void_p, hsa_agent_t, c_void_p, hsa_agent_t, c_size_t,
                                                c_uint32, POINTER(hsa_signal_t), hsa_signal_t,
                                                hsa_amd_sdma_engine_id_t, c_bool]),
    "hsa_amd_memory_copy_engine_status": (S, [hsa_agent_t, hsa_agent_t, POINTER(c_uint32)]),
    # code objects and executables
    "hsa_code_object_reader_create_from_memory": (S, [c_void_p, c_size_t, POINTER(hsa_code_object_reader_t)]),
    "hsa_code_object_reader_destroy": (S, [hsa_code_object_reader_t]),
    "hsa_executable_create_alt": (S, [hsa_profile_t, hsa_default_float_rounding_mode_t, c_char_p,
                                      POINTER(hsa_executable_t)]),
    "hsa_executable_load_agent_code_object": (S, [hsa_executable_t, hsa_agent_t, hsa_code_object_reader_t,
                                                  c_char_p, POINTER(hsa_loaded_code_object_t)]),
    "hsa_executable_freeze": (S, [hsa_executable_t, c_char_p]),
    "hsa_executable_destroy": (S, [hsa_executable_t]),
    "hsa_executable_get_symbol_by_name": (S, [hsa_executable_t, c_char_p, POINTER(hsa_agent_t),
                                              POINTER(hsa_executable_symbol_t)]),
    "hsa_executable_symbol_get_info": (S, [hsa_executable_symbol_t, hsa_executable_symbol_info_t, c_void_p]),
    # events and profiling
    "hsa_amd_register_system_event_handler": (S, [system_event_callback_t, c_void_p]),
    "hsa_amd_profiling_set_profiler_enabled": (S, [Q, c_int]),
    "hsa_amd_profiling_get_dispatch_time": (S, [hsa_agent_t, hsa_signal_t,
                                                POINTER(hsa_amd_profiling_dispatch_time_t)]),
}

OPTIONAL = frozenset({"hsa_amd_memory_async_copy_on_engine", "hsa_amd_memory_copy_engine_status"})
REQUIRED = tuple(name for name in PROTOTYPES if name not in OPTIONAL)
