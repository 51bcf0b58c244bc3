"""The hsa-virtual backend: the hsa backend's code over the real ROCr 5.2.3 library, which runs
over aiogpu's virtual KFD (aiogpu/vkfd). Its options, what its devices report, faults as KFD
reports them, the review rules for the AQL writer on the real library with the eager command
processor, and how it says it is unavailable. (The every-backend suites run on it too, through
tests/backends.py.)"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import aiogpu
from aiogpu import vkfd
from backends import ROOT, VIRTUAL_OK, _close_checked, on_hsa_virtual, runtime_factory
from gpu_kernels import add_const_n, saxpy, scale

pytestmark = on_hsa_virtual


@pytest.fixture
def make_virtual():
    """Factory for hsa-virtual runtimes; each is closed and checked for leaks after the test."""
    yield from runtime_factory("hsa-virtual")


def counters(rt, gpu: int) -> dict:
    return rt.stats()["vkfd"][f"gpu{gpu}"]


# -- options and what the devices report ------------------------------------------------------------
def test_options_shape_the_virtual_devices(make_virtual):
    rt = make_virtual(gpus=3, sdma_queues=1, eager=True)
    assert rt.backend == "hsa-virtual" and len(rt.devices) == 3
    assert "libhsa-runtime64" in rt.reason and "virtual KFD" in rt.reason
    text = rt.describe()
    assert "1 SDMA queue(s) per GPU" in text and "eager command processor" in text
    assert text.count("[GPU]") == 3 and "gfx90a" in text
    assert set(rt.stats()["vkfd"]) == {"gpu0", "gpu1", "gpu2"}


def test_every_counter_the_issue_names_is_reported_per_gpu(make_virtual):
    rt = make_virtual()
    names = {"aql_dispatch", "aql_barrier_and", "aql_barrier_or", "aql_vendor", "sdma_copy_linear", "sdma_bytes",
             "sdma_fence", "sdma_trap", "sdma_poll", "sdma_atomic", "blit_copy", "blit_fill", "interrupts"}
    for gpu in ("gpu0", "gpu1"):
        assert names <= set(rt.stats()["vkfd"][gpu])


@pytest.mark.parametrize("options,match", [
    ({"sdma_engines": 2}, "emulator-only"), ({"compute_units": 4}, "emulator-only"),
])
def test_emulator_only_options_are_refused(options, match):
    with pytest.raises(TypeError, match=match):
        aiogpu.Runtime("hsa-virtual", **options)


def test_sdma_queues_is_refused_by_the_emulator_and_the_real_gpu_backend():
    with pytest.raises(TypeError, match="hsa-virtual"):
        aiogpu.Runtime("emulator", sdma_queues=1)
    from aiogpu.hsa.runtime import HsaRuntime
    with pytest.raises(TypeError, match="emulator-only"):
        HsaRuntime.check_options("hsa", {"sdma_queues": 1})


@pytest.mark.parametrize("options", [{"gpus": 0}, {"gpus": 9}, {"sdma_queues": -1}, {"gpus": True}])
def test_bad_virtual_device_counts_raise_value_error(options):
    with pytest.raises(ValueError):
        aiogpu.Runtime("hsa-virtual", **options)


def test_a_second_runtime_must_match_the_devices_rocr_has_open(make_virtual):
    make_virtual(gpus=2)
    with pytest.raises(ValueError, match="fixed until it closes"):
        aiogpu.Runtime("hsa-virtual", gpus=1)
    assert len(make_virtual(gpus=2).devices) == 2      # the same configuration shares ROCr


def test_the_next_runtime_may_have_other_devices_once_rocr_closed():
    for gpus in (1, 3):
        rt = aiogpu.Runtime("hsa-virtual", gpus=gpus)
        try:
            assert len(rt.devices) == gpus
        finally:
            _close_checked(rt)


# -- work ----------------------------------------------------------------------------------------
@aiogpu.kernel("i64*, i64")
def add_to_all(launch, x, c):
    x[:] += c          # the whole view: as long as the Buffer aiogpu passed


@pytest.mark.asyncio
async def test_bodies_see_views_as_long_as_their_buffers(make_virtual):
    """The real ABI passes bare pointers and aiogpu sub-allocates buffers from 2 MiB blocks: a
    body's view must end where its Buffer does, not where the block does."""
    rt = make_virtual()
    d1 = rt.devices[1]
    bufs = [d1.alloc(8 * 32) for _ in range(3)]          # neighbours in one block
    await aiogpu.gather(*(aiogpu.copy(b, np.zeros(32, np.int64)) for b in bufs))
    await d1.launch(add_to_all, grid=(32,), block=(32,), args=(bufs[1], 5))
    got = [await b.to_numpy(np.int64) for b in bufs]
    assert [int(g.sum()) for g in got] == [0, 5 * 32, 0]


@pytest.mark.asyncio
async def test_kernels_run_through_their_bodies(make_virtual):
    rt = make_virtual()
    d1 = rt.devices[1]
    n = 1000
    x, y = d1.alloc(4 * n), d1.alloc(4 * n)
    await aiogpu.gather(aiogpu.copy(x, np.arange(n, dtype=np.float32)), aiogpu.copy(y, np.ones(n, np.float32)))
    before = counters(rt, 1)["aql_dispatch"]
    await d1.launch(scale, grid=(n,), block=(64,), args=(y, 3.0, n))
    await d1.launch(saxpy, grid=(n,), block=(64,), args=(y, x, 2.0, n))
    np.testing.assert_allclose(await y.to_numpy(np.float32), 3 + 2 * np.arange(n, dtype=np.float32))
    assert counters(rt, 1)["aql_dispatch"] >= before + 2


COPIES_BY_GPU = """
import asyncio, json, sys
import numpy as np, aiogpu

async def main(rt, key):
    d0, d1 = rt.devices
    src = np.arange(1 << 18, dtype=np.uint32)
    b0, b1 = d0.alloc(src.nbytes), d1.alloc(src.nbytes)
    steps = []

    def counts():
        return [rt.stats()["vkfd"][f"gpu{g}"][key] for g in (0, 1)]

    async def step(submit):
        # Counted before the copy is submitted: aiogpu.copy submits at once and the engine
        # threads of the virtual KFD may run the copy before the call even returns.
        before = counts()
        out = await submit()
        steps.append([n - b > 0 for n, b in zip(counts(), before)])
        return out

    await step(lambda: aiogpu.copy(b1, src))         # host-to-device (gpu1)
    await step(lambda: aiogpu.copy(b0, b1))          # peer gpu1 -> gpu0
    back = await step(lambda: b0.to_numpy(np.uint32))  # device-to-host (gpu0)
    return steps, bool((back == src).all()), counts()

with aiogpu.Runtime("hsa-virtual", gpus=2, sdma_queues=int(sys.argv[1])) as rt:
    print(json.dumps(asyncio.run(main(rt, sys.argv[2]))))
"""


def _copies_by_gpu(sdma_queues: int, key: str):
    """In a process of its own: a fresh virtual KFD (a device another test's memory fault left
    evicted in this process would run its copies as shader copies, as on KFD)."""
    import json
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    out = subprocess.run([sys.executable, "-c", COPIES_BY_GPU, str(sdma_queues), key], capture_output=True,
                         text=True, timeout=120, env=full, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_copies_run_on_the_sdma_engine_of_the_gpu_rocr_picks():
    """Runtime::CopyMemory on 5.2.3: host-to-device on the destination's engine, peer and
    device-to-host on the source's."""
    steps, right, _ = _copies_by_gpu(16, "sdma_copy_linear")
    assert right and steps == [[False, True], [False, True], [True, False]]


def test_without_sdma_queues_the_same_copies_run_as_rocrs_blit_kernels_and_are_right():
    steps, right, _ = _copies_by_gpu(0, "blit_copy")
    assert right and steps == [[False, True], [False, True], [True, False]]
    _, _, sdma = _copies_by_gpu(0, "sdma_copy_linear")
    assert sdma == [0, 0]


# -- faults as KFD reports them --------------------------------------------------------------------
@pytest.mark.asyncio
async def test_an_injected_queue_error_fails_the_dispatch_with_rocrs_exception_status(make_virtual):
    rt = make_virtual(watchdog_s=5)
    d0, buf = rt.devices[0], rt.devices[0].alloc(64)
    await d0.launch(scale, grid=(16,), block=(16,), args=(buf, 2.0, 16))
    rt.api.vkfd.inject(0, vkfd.INJECT_QUEUE_ERROR, 0x80000000)
    with pytest.raises(aiogpu.GPUError, match="HSA_STATUS_ERROR_EXCEPTION"):
        await d0.launch(scale, grid=(16,), block=(16,), args=(buf, 2.0, 16))
    assert counters(rt, 0)["queue_errors"] == 1


@pytest.mark.asyncio
async def test_a_memory_fault_as_kfd_reports_it_names_the_device_and_the_address(make_virtual):
    rt = make_virtual(watchdog_s=5)
    d0, buf = rt.devices[0], rt.devices[0].alloc(64)
    await d0.launch(scale, grid=(16,), block=(16,), args=(buf, 2.0, 16))
    rt.api.vkfd.inject(0, vkfd.INJECT_MEMORY_FAULT_NEXT, 0)
    with pytest.raises(aiogpu.GPUError, match="gpu0 was lost to a GPU memory fault"):
        await d0.launch(scale, grid=(16,), block=(16,), args=(buf, 2.0, 16))
    assert counters(rt, 0)["memory_faults"] == 1 and counters(rt, 1)["memory_faults"] == 0
    # KFD keeps the device evicted: later work there fails at once, the other device goes on
    with pytest.raises(aiogpu.GPUError, match="lost"):
        await asyncio.wait_for(d0.launch(scale, grid=(16,), block=(16,), args=(buf, 2.0, 16)), 10)
    d1, buf1 = rt.devices[1], rt.devices[1].alloc(64)
    await aiogpu.copy(buf1, np.ones(16, np.float32))
    await d1.launch(scale, grid=(16,), block=(16,), args=(buf1, 2.0, 16))
    np.testing.assert_array_equal(await buf1.to_numpy(np.float32), 2)


@pytest.mark.asyncio
async def test_a_body_that_indexes_past_its_buffer_is_a_gpu_memory_fault(make_virtual):
    rt = make_virtual(watchdog_s=5)

    @aiogpu.kernel("f32*, u32")
    def past_the_end(launch, x, n):
        x[n] = 1.0

    d1, buf = rt.devices[1], rt.devices[1].alloc(64)
    with pytest.raises(aiogpu.GPUError, match="memory fault"):
        await d1.launch(past_the_end, grid=(1,), block=(1,), args=(buf, 16))
    assert counters(rt, 1)["memory_faults"] == 1


@pytest.mark.asyncio
async def test_work_completes_when_interrupts_are_lost(make_virtual):
    """The waiter does not rely on the interrupt alone: a lost one delays, never loses, work."""
    rt = make_virtual(watchdog_s=10)
    d0, buf = rt.devices[0], rt.devices[0].alloc(8 * 16)
    await aiogpu.copy(buf, np.zeros(16, np.int64))
    rt.api.vkfd.inject(0, vkfd.INJECT_LOST_INTERRUPTS, 3)
    for _ in range(3):
        await d0.launch(add_const_n, grid=(16,), block=(16,), args=(buf, 1, 16))
    np.testing.assert_array_equal(await buf.to_numpy(np.int64), 3)
    assert counters(rt, 0)["lost_interrupts"] >= 1



@pytest.mark.asyncio
async def test_a_back_log_drains_when_every_interrupt_is_lost(make_virtual):
    """Room marks tell a back-logged queue of room through ROCr's asynchronous handler, which
    wakes only on an interrupt (Signal::WaitAny waits for events with no short timeout): with
    every interrupt lost from the moment the ring is full, the back-log still drains and every
    launch completes, in order."""
    from gpu_kernels import Gate, wait_gate

    rt = make_virtual(ring_size=64, queues_per_device=1, watchdog_s=30)
    d0, buf = rt.devices[0], rt.devices[0].alloc(8 * 16)
    await aiogpu.copy(buf, np.zeros(16, np.int64))
    await aiogpu.gather(d0.load(add_const_n), d0.load(wait_gate))
    gate = Gate()
    held = gate.launch(d0)
    futs = [d0.launch(add_const_n, grid=(16,), block=(16,), args=(buf, 1, 16), after=[held] if i == 0 else [])
            for i in range(300)]
    assert rt._crowded()
    rt.api.vkfd.inject(0, vkfd.INJECT_LOST_INTERRUPTS, 1 << 40)
    try:
        gate.open()
        await asyncio.wait_for(aiogpu.gather(*futs), 30)
        assert counters(rt, 0)["lost_interrupts"] >= 10
    finally:
        rt.api.vkfd.inject(0, vkfd.INJECT_LOST_INTERRUPTS, 0)
    np.testing.assert_array_equal(await buf.to_numpy(np.int64), 300)

# -- the AQL writer's rules on the real ROCr with the eager command processor -------------------------
@pytest.mark.asyncio
async def test_eager_cp_many_pending_launches_on_a_small_ring_bodies_before_headers(make_virtual):
    """The eager CP reads a slot the moment its header is valid: a header published before its
    body, a doorbell short of the last index, or a completion signal reused before retirement
    shows as a wrong sum, a hang or a leak."""
    rt = make_virtual(eager=True, ring_size=64, watchdog_s=30)
    d0, buf = rt.devices[0], rt.devices[0].alloc(8 * 16)
    await aiogpu.copy(buf, np.zeros(16, np.int64))
    futs = [d0.launch(add_const_n, grid=(16,), block=(16,), args=(buf, 1, 16)) for _ in range(600)]
    await aiogpu.gather(*futs)
    np.testing.assert_array_equal(await buf.to_numpy(np.int64), 600)


@pytest.mark.asyncio
@pytest.mark.parametrize("eager", [False, True])
async def test_a_launch_after_more_than_five_queues_work_waits_for_all(make_virtual, eager):
    """Barrier-AND packets hold five dependencies: a join of seven other queues' work needs a
    chain of them, and the launch runs only after every one of the dependencies completed."""
    from gpu_kernels import sleep_ms

    rt = make_virtual(eager=eager, queues_per_device=4, watchdog_s=30)
    d0, d1 = rt.devices
    await d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))     # loaded before the timed part
    parts = [d.launch(sleep_ms, grid=(1,), block=(1,), args=(50,)) for d in (d0, d1) for _ in range(4)]
    assert len({p.queue for p in parts}) == 8, [p.queue for p in parts]
    before = counters(rt, 0)["aql_barrier_and"]
    last = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=parts)
    seen = []
    last.add_done_callback(lambda _f: seen.append([p.done() for p in parts]))
    await last
    await asyncio.sleep(0)
    assert seen == [[True] * 8]
    assert counters(rt, 0)["aql_barrier_and"] >= before + 2


# -- availability, the CLI and the plugin ---------------------------------------------------------
def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=full, cwd=ROOT)


def test_a_library_that_was_not_built_is_backend_unavailable_naming_the_packages():
    out = _run("""
        from pathlib import Path
        import aiogpu, aiogpu.vkfd as v
        v.LIBRARY = Path("/nonexistent/libhsakmt.so.1")
        try:
            aiogpu.Runtime("hsa-virtual")
        except aiogpu.BackendUnavailable as exc:
            print("UNAVAILABLE", exc)
    """)
    assert "UNAVAILABLE" in out.stdout, out.stderr
    assert "libhsakmt-dev" in out.stdout and "libhsa-runtime64-1" in out.stdout


def test_info_names_the_rocr_library_and_the_virtual_agents():
    out = subprocess.run([sys.executable, "-m", "aiogpu", "info", "--backend", "hsa-virtual"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert "libhsa-runtime64.so" in out.stdout and "virtual KFD" in out.stdout
    assert out.stdout.count("[GPU] aiogpu virtual gfx90a") == 2


def test_the_pytest_plugin_runs_a_suite_on_the_real_rocr(tmp_path):
    (tmp_path / "test_suite.py").write_text(textwrap.dedent("""
        import numpy as np, aiogpu

        @aiogpu.kernel("f32*, u32")
        def twice(launch, x, n):
            x[:n] *= 2

        async def test_twice(gpu, gpu_runtime):
            assert gpu_runtime.backend == "hsa-virtual"
            buf = gpu.alloc(64)
            await aiogpu.copy(buf, np.ones(16, np.float32))
            await gpu.launch(twice, grid=(16,), block=(16,), args=(buf, 16))
            assert (await buf.to_numpy(np.float32) == 2).all()
    """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--aiogpu-backend",
                          "hsa-virtual", "-o", "asyncio_mode=auto", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "1 passed" in out.stdout, out.stdout + out.stderr


def test_the_emulator_and_real_rocr_share_one_process():
    """The virtual KFD and its ROCr live in a link-map namespace of their own: the process's
    real ROCr (the hsa backend's probe) still answers with its own thunk."""
    from aiogpu.hsa_bindings import loader
    api, why = loader.try_real()
    assert api is None and "0x1008" in why or api is not None
    assert VIRTUAL_OK


def test_stress_on_the_real_rocr_with_the_eager_command_processor_runs_clean():
    """``python -m aiogpu stress --backend hsa-virtual`` in small: random kernels, copies, peer
    copies, gathers and graph replays on two virtual GPUs, every read-back checked."""
    from aiogpu.cli import stress
    stats, leaks = stress.run_stress(ops=1500, gpus=2, seed=3, tasks=32, backend="hsa-virtual")
    assert (stats.ops, stats.mismatches, stats.unexpected, stats.hangs, leaks) == (1500, 0, 0, 0, {})
    assert stats.checks > 0


def test_hsa_virtual_works_in_a_process_that_loaded_the_real_thunk_first():
    """The real ROCr (and with it the real libhsakmt.so.1) loaded and initialised in the
    process's own namespace first, as the hsa backend's probe does: hsa-virtual still binds ROCr
    to the virtual KFD in a namespace of its own."""
    out = _run("""
        import ctypes, aiogpu
        real = ctypes.CDLL("libhsa-runtime64.so.1")
        print("real hsa_init", hex(real.hsa_init()))
        with aiogpu.Runtime("hsa-virtual", gpus=1) as rt:
            print("virtual", len(rt.devices), rt.api.vkfd.version)
    """)
    assert "real hsa_init 0x1008" in out.stdout and "virtual 1 vkfd" in out.stdout, out.stdout + out.stderr
