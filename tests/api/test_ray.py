"""aiogpu.ray: GPUs per actor, runtimes closed at exit, ObjectRefs and GPU futures awaited together,
Loader sources with back-pressure, and the two-stage pipeline on a simulated two-node cluster
(``ray.cluster_utils.Cluster``: two nodes on this machine, each declaring two emulated GPUs), with
an actor killed mid-pipeline. CI installs the ``ray`` extra, so none of this is skipped there.
"""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

# Before Ray is imported: every Ray process on loopback addresses only, and no usage report.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

ray = pytest.importorskip("ray")

import aiogpu                                   # noqa: E402
import aiogpu.ray as aray                       # noqa: E402
from ray import cloudpickle                     # noqa: E402
from ray.cluster_utils import Cluster           # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_pipeline.py"
NODE = {"num_cpus": 2, "resources": {aray.EMULATED_GPU: 2}, "object_store_memory": 100 << 20}
# Actor classes defined here (and in the example, loaded below) travel to the workers by value:
# the workers cannot import this test module by name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def load_example():
    name = "aiogpu_ray_pipeline_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        cloudpickle.register_pickle_by_value(module)
    return sys.modules[name]


# -- without a cluster ----------------------------------------------------------------------------
def test_hip_visible_devices_become_rocr_visible_devices():
    env = aray._real_gpu_env(["2", "3"], {"HIP_VISIBLE_DEVICES": "2,3"})
    assert env == {"AIOGPU_EMULATOR_GPUS": "2", "ROCR_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "0,1"}
    # HIP's indices count what ROCR_VISIBLE_DEVICES already shows.
    env = aray._real_gpu_env(["1"], {"HIP_VISIBLE_DEVICES": "1", "ROCR_VISIBLE_DEVICES": "4,6,7"})
    assert env["ROCR_VISIBLE_DEVICES"] == "6" and env["HIP_VISIBLE_DEVICES"] == "0"
    with pytest.raises(ValueError, match="does not index"):
        aray._real_gpu_env(["5"], {"HIP_VISIBLE_DEVICES": "5", "ROCR_VISIBLE_DEVICES": "0,1"})
    # NVIDIA: CUDA reads CUDA_VISIBLE_DEVICES itself; nothing to translate.
    assert aray._real_gpu_env(["0"], {"CUDA_VISIBLE_DEVICES": "3"}) == {"AIOGPU_EMULATOR_GPUS": "1"}


def test_emulated_gpus_set_the_emulator_and_its_gpu_count():
    assert aray._emulated_env(3, {}) == {"AIOGPU_BACKEND": "emulator", "AIOGPU_EMULATOR_GPUS": "3"}
    with pytest.raises(ValueError, match="AIOGPU_BACKEND='cuda'"):
        aray._emulated_env(1, {"AIOGPU_BACKEND": "cuda"})


def test_gpu_options_validate_and_choose():
    assert aray.gpu_options(2, emulated=True) == {"resources": {aray.EMULATED_GPU: 2}}
    assert aray.gpu_options(0.5, emulated=False) == {"num_gpus": 0.5}
    for bad in (0, -1, True, "2", None):
        with pytest.raises(ValueError):
            aray.gpu_options(bad, emulated=True)


def test_sources_reject_bad_arguments_before_running():
    with pytest.raises(ValueError, match="max_in_flight"):
        aray.batches_from_refs([], max_in_flight=0)
    with pytest.raises(TypeError, match="iterable"):
        aray.batches_from_refs(42)
    with pytest.raises(ValueError, match="batch_size"):
        aray.batches_from_dataset(object(), batch_size=0)
    with pytest.raises(TypeError, match="iter_batches"):
        aray.batches_from_dataset(object(), batch_size=4)


async def _value(v, delay: float = 0.0):
    await asyncio.sleep(delay)
    return v


@pytest.mark.asyncio
@pytest.mark.parametrize("max_in_flight", [1, 3])
async def test_batches_from_refs_back_pressure(max_in_flight):
    """Refs taken from the source and not yet consumed never exceed max_in_flight, and reach it."""
    taken = consumed = 0
    in_flight_at_take = []

    async def refs():
        nonlocal taken
        for i in range(12):
            taken += 1
            in_flight_at_take.append(taken - consumed)
            yield _value(np.full(4, i, np.float32), delay=0.001 * (i % 3))

    got = []
    async for value in aray.batches_from_refs(refs(), max_in_flight=max_in_flight):
        consumed += 1
        got.append(int(value[0]))
        await asyncio.sleep(0.005)     # a slow consumer: the source must wait for it
    assert got == list(range(12))
    assert max(in_flight_at_take) == max_in_flight


@pytest.mark.asyncio
async def test_batches_from_refs_rejects_what_the_loader_cannot_copy():
    with pytest.raises(TypeError, match="batch 1.*object"):
        async for _ in aray.batches_from_refs([_value(np.zeros(2)), _value(np.array([None, 1]))]):
            pass
    with pytest.raises(TypeError, match="ref 1 is not an ObjectRef"):
        async for _ in aray.batches_from_refs([_value(np.zeros(2)), np.zeros(2)]):
            pass


class FakeDataset:
    """Duck-typed Ray Data dataset: counts the batches its iterator has produced."""

    def __init__(self, batches: int, rows: int = 4):
        self.batches, self.rows, self.produced, self.closed = batches, rows, 0, False

    def iter_batches(self, *, batch_size, batch_format, drop_last):
        assert batch_format == "numpy" and batch_size == self.rows
        try:
            for i in range(self.batches):
                self.produced += 1
                yield {"x": np.full(batch_size, i, np.float32), "label": np.arange(batch_size)}
        finally:
            self.closed = True


@pytest.mark.asyncio
async def test_batches_from_dataset_back_pressure_and_close():
    ds = FakeDataset(20)
    ahead = []
    seen = 0
    stream = aray.batches_from_dataset(ds, batch_size=4, columns=("x", "label"), max_in_flight=2)
    async for x, label in stream:
        assert x[0] == seen and list(label) == [0, 1, 2, 3]
        seen += 1
        await asyncio.sleep(0.02)      # the thread has time to run ahead, if it were allowed to
        ahead.append(ds.produced - seen)
        if seen == 6:
            break
    await stream.aclose()
    assert max(ahead) <= 2 and max(ahead) >= 1, ahead
    for _ in range(100):               # the iterator is closed in its own thread
        if ds.closed:
            break
        await asyncio.sleep(0.01)
    assert ds.closed and ds.produced <= 8


@pytest.mark.asyncio
async def test_batches_from_dataset_names_a_missing_column():
    with pytest.raises(KeyError, match="'y'.*'label', 'x'"):
        async for _ in aray.batches_from_dataset(FakeDataset(2), batch_size=4, columns="y"):
            pass


@pytest.mark.asyncio
async def test_gather_waits_for_gpu_work_before_raising(gpu, inject):
    buf = gpu.alloc(1 << 12)
    inject.delay_completions(0.3, count=1)
    fill = buf.fill(7)

    async def fails():
        raise KeyError("from the object store")

    t0 = time.monotonic()
    with pytest.raises(KeyError, match="object store"):
        await aray.gather(fill, fails())
    assert fill.done(), "gather raised while the GPU still used the buffer"
    assert time.monotonic() - t0 >= 0.25
    small = gpu.alloc(16)
    assert await aray.gather(small.fill(1), _value(5)) == [None, 5]
    with pytest.raises(TypeError, match="argument 0"):
        await aray.gather(3)
    buf.free()
    small.free()


def test_actor_runtime_outside_ray_is_the_default_runtime():
    rt = aray.actor_runtime()
    try:
        assert rt is aiogpu.runtime() and rt is aray.actor_runtime()
    finally:
        aray.close_actor_runtime()
    assert rt.closed
    aray.close_actor_runtime()       # idempotent


# -- on a simulated two-node cluster -------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine, two emulated GPUs each; the test process is a driver."""
    constants = ray._private.ray_constants
    saved = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False         # loopback, should Ray have been imported earlier
    c = None
    try:
        c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
        c.add_node(**NODE)
        c.wait_for_nodes(timeout=90)
        ray.init(address=c.address, logging_level=logging.WARNING, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        constants.ENABLE_RAY_CLUSTER = saved


def kill_all(*actors):
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:
            pass


@pytest.mark.timeout(180)
def test_pipeline_example_on_two_nodes(cluster):
    out = subprocess.run([sys.executable, str(EXAMPLE), "--address", cluster.address, "--batches", "6"],
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.endswith(" 0 mismatches") and "6 batches" in line, line
    nodes = [part.split("node ")[1].split()[0] for part in line.split("stage ")[1:]]
    assert len(nodes) == 2 and nodes[0] != nodes[1], line       # the stages ran on different nodes
    assert line.count("(2 GPU(s), emulator)") == 2, line


@ray.remote
class Probe(aray.GPUActor):
    """Reports its runtime; records whether it was closed when the actor exits."""

    def __init__(self, marker: str | None = None):
        self.marker = marker

    async def check(self) -> dict:
        info = await self.aiogpu_info()
        info["same_runtime"] = aiogpu.runtime() is self.runtime and len(aiogpu.devices()) == info["gpus"]
        dev = self.devices[-1]
        buf = dev.alloc(64)
        await buf.fill(3)
        info["fill_ok"] = bool((await buf.to_numpy(np.uint32) == 3).all())
        return info

    def __ray_shutdown__(self) -> None:
        rt = self.runtime
        super().__ray_shutdown__()
        if self.marker:
            Path(self.marker).write_text(f"closed={rt.closed}")


@ray.remote
def runtime_in_a_task():
    return aray.actor_runtime()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_each_actor_gets_the_gpus_ray_assigned(cluster):
    one = Probe.options(**aray.gpu_options(1)).remote()
    two = Probe.options(resources={aray.EMULATED_GPU: 2}).remote()
    none = Probe.remote()
    try:
        info1, info2 = await asyncio.wait_for(asyncio.gather(one.check.remote(), two.check.remote()), 60)
        assert (info1["gpus"], info2["gpus"]) == (1, 2)
        for info in (info1, info2):
            assert info["backend"] == "emulator" and info["same_runtime"] and info["fill_ok"]
            assert info["assignment"]["kind"] == "emulated"
        with pytest.raises(aray.NoGPUsAssigned, match="holds no GPUs"):
            await asyncio.wait_for(none.check.remote(), 60)
        with pytest.raises(RuntimeError, match="in a Ray task, create aiogpu.Runtime"):
            await asyncio.wait_for(runtime_in_a_task.options(**aray.gpu_options(1)).remote(), 60)
    finally:
        kill_all(one, two, none)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_runtime_closed_when_the_actor_exits(cluster, tmp_path):
    marker = tmp_path / "closed.txt"
    actor = Probe.options(**aray.gpu_options(1)).remote(str(marker))
    info = await asyncio.wait_for(actor.check.remote(), 60)
    assert info["fill_ok"]
    actor.__ray_terminate__.remote()
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert marker.read_text() == "closed=True"


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_batches_from_refs_feeds_the_loader(cluster, make_runtime):
    devices = make_runtime(gpus=2).devices
    taken = consumed = 0
    in_flight = []

    async def refs():
        nonlocal taken
        for i in range(10):
            taken += 1
            in_flight.append(taken - consumed)
            yield ray.put(np.arange(256, dtype=np.float32) + i)

    sums = {}
    source = aray.batches_from_refs(refs(), max_in_flight=2)
    async with aiogpu.Loader(source, devices, prefetch=1) as loader:
        async for batch in loader:
            consumed += 1
            sums[batch.index] = float((await batch.data.to_numpy(np.float32)).sum())
            batch.release()
    assert sums == {i: float(np.arange(256).sum() + 256 * i) for i in range(10)}
    # The loader holds at most prefetch batches per device (2), batches_from_refs 2 more.
    assert max(in_flight) <= 2 * 1 + 2 + 1, in_flight


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # Ray Data's own, about its settings
async def test_batches_from_a_ray_data_dataset(cluster, make_runtime):
    import ray.data

    data = np.arange(40 * 8, dtype=np.float32).reshape(40, 8)
    ds = ray.data.from_numpy(data).map_batches(lambda b: {"data": b["data"] * 2})
    devices = make_runtime(gpus=2).devices
    rows = []
    source = aray.batches_from_dataset(ds, batch_size=16, columns="data", max_in_flight=2)
    async with aiogpu.Loader(source, devices, prefetch=2) as loader:
        async for batch in loader:
            rows.append((await batch.data.to_numpy(np.float32)).reshape(-1, 8))
            batch.release()
    assert [len(r) for r in rows] == [16, 16, 8]
    np.testing.assert_array_equal(np.sort(np.concatenate(rows), axis=0), data * 2)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_object_refs_and_gpu_futures_awaited_together(cluster, make_runtime):
    dev = make_runtime(gpus=1).devices[0]
    host = np.arange(1024, dtype=np.float32)
    buf = dev.alloc(host.nbytes)
    # Plain asyncio.gather takes both kinds.
    value, _ = await asyncio.gather(ray.put(host * 2), aiogpu.copy(buf, host))
    assert (value == host * 2).all()
    # So does an aiogpu.TaskGroup (anyio), which also waits for the GPU work submitted inside it.
    got = {}

    async def fetch(ref):
        got["ref"] = await ref

    async def square():
        got["gpu"] = await buf.to_numpy(np.float32)

    async with aiogpu.TaskGroup() as tg:
        tg.start_soon(fetch, ray.put(host + 1))
        tg.start_soon(square)
    assert (got["ref"] == host + 1).all() and (got["gpu"] == host).all()
    # aiogpu.ray.gather: a failed ObjectRef raises its Ray error, after the GPU work settled.
    failing = boom.remote()
    fill = buf.fill(0)
    with pytest.raises(ray.exceptions.RayTaskError, match="boom"):
        await asyncio.wait_for(aray.gather(fill, failing), 60)
    assert fill.done()
    buf.free()


@ray.remote
def boom():
    raise ValueError("boom")


async def _until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "the pipeline made no progress"
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", ["stage1", "stage2"])
async def test_killing_an_actor_mid_pipeline_fails_the_driver_fast(cluster, victim):
    example = load_example()
    stage1, stage2 = example.start_stages(2, delay_s=0.3)
    try:
        await asyncio.wait_for(asyncio.gather(example.placed(stage1), example.placed(stage2)), 60)
        running = asyncio.ensure_future(example.run_pipeline(stage1, stage2, batches=40, n=1024))

        async def started():
            return running.done() or await stage2.progress.remote() >= 2
        await _until(started, 60)
        assert not running.done(), "the pipeline finished before the kill: slow stage one down"
        ray.kill(stage1 if victim == "stage1" else stage2)
        t0 = time.monotonic()
        with pytest.raises(ray.exceptions.RayActorError) as err:
            await asyncio.wait_for(running, 30)
        assert time.monotonic() - t0 < 30
        assert "ray.kill" in str(err.value), str(err.value)
        if victim == "stage1":   # stage two survives it, with its runtime, and reports the cause
            assert isinstance(err.value, ray.exceptions.RayTaskError)
            assert "Transform" in str(err.value)
            assert await asyncio.wait_for(stage2.progress.remote(), 30) >= 2
    finally:
        kill_all(stage1, stage2)
