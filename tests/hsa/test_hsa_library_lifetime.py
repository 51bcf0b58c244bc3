"""What aiogpu leaves in the HSA library of its process: ``hsa_init`` balanced by
``hsa_shut_down``, one system-event handler however many runtimes come and go, and code objects
whose memory outlives nothing that points at it.

ROCr is one library per process, reference-counted by ``hsa_init``/``hsa_shut_down``, that keeps
its system-event handlers until its last shut-down. The emulator models one process per
instance; ``process_library`` makes every runtime of a test share one instance, as runtimes share
ROCr.
"""
from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import aiogpu
from backends import wait_until
from aiogpu.hsa_bindings import loader
from aiogpu.hsa_bindings.emulator import EmulatedLibrary
from tests import gpu_kernels


def share_library(monkeypatch, backend: str = "emulator", gpus: int = 2) -> EmulatedLibrary:
    """Every runtime of ``backend`` ("emulator", or "hsa": the real-library code path) made from
    now on runs on one emulated library, each with its own ``hsa_init`` (as ``loader`` does)."""
    impl = EmulatedLibrary(gpus=gpus)

    def make(reason: str = "", **_options):
        funcs, keep, missing = loader.bind_python(impl)
        api = loader._make_api(backend, reason or "one library per process", impl, funcs, missing, keep)
        api.check(api.hsa_init(), "hsa_init")
        return api

    if backend == "emulator":
        monkeypatch.setattr(loader, "make_emulator", make)
    else:
        monkeypatch.setattr(loader, "try_real", lambda: (make(), "one library per process"))
    return impl


async def round_trip(rt) -> None:
    dev = rt.devices[0]
    buf = dev.alloc(64)
    await aiogpu.copy(buf, np.arange(8, dtype=np.int64))
    assert (await buf.to_numpy(np.int64) == np.arange(8)).all()
    buf.free()


# ---- hsa_init / hsa_shut_down --------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["hsa", "emulator"])
def test_close_balances_hsa_init(monkeypatch, backend):
    lib = share_library(monkeypatch, backend)
    runtimes = [aiogpu.Runtime(backend) for _ in range(3)]
    assert lib.init_count == 3
    asyncio.run(round_trip(runtimes[0]))
    for i, rt in enumerate(runtimes):
        rt.close()
        rt.close()                       # idempotent: one shut-down per runtime
        assert lib.init_count == 2 - i
    assert not lib.initialized, "the last shut-down ends the library (ROCr destroys its runtime)"
    assert not lib.api_errors


def test_close_with_work_in_flight_shuts_down_after_the_work_is_abandoned(monkeypatch):
    lib = share_library(monkeypatch, "hsa")
    rt = aiogpu.Runtime("hsa")
    dev = rt.devices[0]
    buf = dev.alloc(64)
    lib.faults.delay_completions(2.0)
    fut = aiogpu.copy(buf, np.zeros(8, np.int64))
    rt.close(timeout=0.05)
    with pytest.raises(aiogpu.GPUError, match="abandoned"):
        fut.result()
    assert wait_until(lambda: lib.init_count == 0), "the background release shuts the library down"
    assert not lib.api_errors


def test_a_construction_that_fails_part_way_balances_hsa_init(monkeypatch):
    from aiogpu.hsa.runtime import HsaRuntime
    lib = share_library(monkeypatch, "hsa")

    def fail(self):
        raise RuntimeError("no agents today")

    monkeypatch.setattr(HsaRuntime, "_discover_agents", fail)
    with pytest.raises(RuntimeError, match="no agents today"):
        aiogpu.Runtime("hsa")
    assert lib.init_count == 0


# ---- the system-event handler ----------------------------------------------------------------------
def fault_on(rt) -> None:
    """A GPU memory fault on gpu0 of ``rt``, during a kernel; returns once ``rt`` has seen it."""
    async def go():
        buf = rt.devices[0].alloc(64)
        rt.api.library.faults.memory_fault_at(1, agent=0)
        with pytest.raises(aiogpu.GPUError):
            await rt.devices[0].launch(gpu_kernels.add_const_n, grid=(8,), block=(8,), args=(buf, 1, 8))
    asyncio.run(go())
    assert wait_until(lambda: rt.memory_faults)


def test_one_handler_for_many_runtimes_and_a_fault_reaches_only_the_live_one(monkeypatch):
    lib = share_library(monkeypatch, "emulator")
    lib.hsa_init()                  # someone else in the process holds the library: it stays up
    closed = [aiogpu.Runtime("emulator") for _ in range(3)]
    for rt in closed:
        rt.close()
    rt = aiogpu.Runtime("emulator")
    assert len(lib._require_state().ctx.events._handlers) == 1, "one registration per hsa_init cycle"
    fault_on(rt)
    assert len(rt.memory_faults) == 1, "handled once"
    assert all(not old.memory_faults for old in closed), "closed runtimes hear nothing"
    assert [f.handled for f in lib.memory_faults] == [True]
    rt.close()
    lib.hsa_shut_down()
    assert lib.init_count == 0


def test_a_new_init_cycle_registers_the_handler_again(monkeypatch):
    """After the last shut-down ROCr forgets its handlers: the next runtime registers again."""
    lib = share_library(monkeypatch, "emulator")
    aiogpu.Runtime("emulator").close()
    assert not lib.initialized
    rt = aiogpu.Runtime("emulator")
    fault_on(rt)
    assert [f.handled for f in lib.memory_faults] == [True]
    rt.close()


def test_collected_runtimes_leave_no_dangling_handler():
    """Runtimes dropped without close (collected) and closed ones, then a fault on a later
    runtime: handled once, by it. In a child process: a dangling C callback crashes it."""
    script = textwrap.dedent("""
        import gc, sys
        import pytest
        sys.path.insert(0, "tests")          # (the shared helpers the module imports: backends)
        from tests.hsa.test_hsa_library_lifetime import fault_on, share_library
        import aiogpu

        class Patch(pytest.MonkeyPatch):
            pass

        lib = share_library(Patch(), "emulator")
        for i in range(6):
            rt = aiogpu.Runtime("emulator")
            if i % 2:
                rt.close()
            del rt
            gc.collect()
        rt = aiogpu.Runtime("emulator")
        fault_on(rt)
        assert len(rt.memory_faults) == 1, rt.memory_faults
        assert [f.handled for f in lib.memory_faults] == [True], lib.memory_faults
        assert len(lib._require_state().ctx.events._handlers) == 1
        rt.close()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


# ---- code object memory ----------------------------------------------------------------------------
def test_code_object_memory_lives_as_long_as_its_executable(monkeypatch):
    lib = share_library(monkeypatch, "emulator")
    lib.hsa_init()                  # keeps the library up after the runtime closes
    rt = aiogpu.Runtime("emulator")
    dev = rt.devices[0]
    dev._loaded_kernel(gpu_kernels.add_const_n)
    gc.collect()
    sizes = {size for _, size, _ in lib.link_map()}
    junk = [bytes([0xA5]) * size for size in sizes for _ in range(64)]   # reuse what was freed
    assert lib.link_map() and all(intact for *_, intact in lib.link_map()), \
        "ROCr's link map names the code object's memory while the executable lives"
    del junk
    rt.close()
    assert lib.link_map() == [], "close destroys the executables"
    lib.hsa_shut_down()
