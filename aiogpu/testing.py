"""pytest plugin for async GPU test suites (registered as the ``aiogpu`` pytest11 entry point).

Fixtures: ``gpu_runtime`` (a fresh runtime per test), ``gpu`` (its first device), ``gpus`` (all),
``inject`` (fault injection on the emulator and on hsa-virtual). Options:
``--aiogpu-backend=emulator|hsa|hsa-virtual|cuda`` (default emulator; ``hsa-virtual`` runs the
suite on the real ROCr library over aiogpu's virtual KFD, no GPU needed), ``--aiogpu-gpus=N``
(emulated or virtual GPUs), ``--aiogpu-shared-runtime`` (one runtime for the whole session
instead of one per test; fault injection then needs care),
``--aiogpu-track-allocs=N`` (frames of each allocation's stack recorded for the leak report;
default 8, 0: off). A test fails if it leaves GPU work pending or leaks signals, kernel-argument
memory, host locks or buffers; the error names each buffer it left and where it was allocated.
The check waits for pending work only (``Runtime.leaks``): a buffer the test still holds is
reported at once. A test that failed is not checked for buffers: its traceback keeps its locals,
buffers included, alive, so the count would only repeat the failure as a second, spurious error.
"""
from __future__ import annotations

from typing import Any, Iterator

import pytest


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("aiogpu")
    group.addoption("--aiogpu-backend", default="emulator", choices=("emulator", "hsa", "hsa-virtual", "cuda"),
                    help="backend of the gpu_runtime fixture (default: emulator)")
    group.addoption("--aiogpu-gpus", type=int, default=2, help="number of emulated or virtual GPUs (default 2)")
    group.addoption("--aiogpu-sdma-engines", type=int, default=2, help="SDMA engines per emulated GPU")
    group.addoption("--aiogpu-shared-runtime", action="store_true",
                    help="one runtime for the whole session instead of a fresh one per test")
    group.addoption("--aiogpu-track-allocs", type=int, default=8, metavar="N",
                    help="frames of each allocation's call stack that the leak report shows (default 8; 0: off)")


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    # Remember whether the test body failed, for the leak check in the fixture's teardown.
    outcome = yield
    if call.when == "call":
        item.stash[_CALL_FAILED] = outcome.get_result().failed


def _open(config: Any, marker_options: dict) -> Any:
    import aiogpu

    backend = config.getoption("--aiogpu-backend", "emulator")
    options: dict[str, Any] = {}
    if backend == "emulator":
        options = {"gpus": config.getoption("--aiogpu-gpus", 2),
                   "sdma_engines": config.getoption("--aiogpu-sdma-engines", 2)}
    elif backend == "hsa-virtual":
        options = {"gpus": config.getoption("--aiogpu-gpus", 2)}
    options.update(marker_options)
    rt = aiogpu.Runtime(backend, **options)
    rt.track_allocations = max(0, config.getoption("--aiogpu-track-allocs", 8))
    return rt


@pytest.fixture(scope="session")
def _aiogpu_session_runtime(request: Any) -> Iterator[Any]:
    rt = _open(request.config, {})
    yield rt
    rt.close()


@pytest.fixture
def gpu_runtime(request: Any) -> Iterator[Any]:
    """A fresh aiogpu runtime for this test (or the session's, with --aiogpu-shared-runtime),
    closed afterwards; the test fails if it left GPU work or resources behind."""
    marker = request.node.get_closest_marker("aiogpu")
    if request.config.getoption("--aiogpu-shared-runtime", False) and marker is None:
        rt = request.getfixturevalue("_aiogpu_session_runtime")
        yield rt
        leaks = rt.leaks(buffers=False)
    else:
        rt = _open(request.config, marker.kwargs if marker else {})
        yield rt
        leaks = rt.leaks(buffers=not request.node.stash.get(_CALL_FAILED, False))
        rt.close()
    if leaks:
        pytest.fail(f"the test left GPU work or resources behind: {leaks.describe()}", pytrace=False)


@pytest.fixture
def gpus(gpu_runtime: Any) -> list:
    """Every device of ``gpu_runtime``."""
    return list(gpu_runtime.devices)


@pytest.fixture
def gpu(gpus: list) -> Any:
    """The first device of ``gpu_runtime``."""
    return gpus[0]


class Injector:
    """Fault injection on the emulated runtime of this test, or on the virtual KFD beneath the
    real ROCr (hsa-virtual: faults as KFD reports them; what it cannot model skips the test).
    Skips on a real backend."""

    def __init__(self, rt: Any):
        api = getattr(rt, "api", None)
        self.vkfd = getattr(api, "vkfd", None)
        emulator = getattr(api, "emulator", None)
        if emulator is None and self.vkfd is None:
            pytest.skip("fault injection needs the emulator or the hsa-virtual backend")
        self.faults = emulator.faults if emulator is not None else None
        self._gpus = len(rt.devices)

    def _virtual_gpus(self, gpu: int | None) -> range:
        return range(self._gpus) if gpu is None else range(gpu, gpu + 1)

    def queue_error(self, at: int = 1, status: int | None = None, gpu: int | None = None) -> None:
        """The ``at``-th packet processed from now fails with ``status`` (default EXCEPTION).
        hsa-virtual: the next dispatch on ``gpu`` (default every GPU) fails with a CP trap, which
        ROCr reports as HSA_STATUS_ERROR_EXCEPTION (``at`` and ``status`` other than that skip)."""
        from .hsa_bindings import types as T
        if self.vkfd is not None:
            if at != 1 or status not in (None, T.HSA_STATUS_ERROR_EXCEPTION):
                pytest.skip("hsa-virtual injects a queue error at the next dispatch, as a trap only")
            from .vkfd import INJECT_QUEUE_ERROR
            for g in self._virtual_gpus(gpu):
                self.vkfd.inject(g, INJECT_QUEUE_ERROR, 0x80000000)
            return
        self.faults.queue_error_at(at, status=status or T.HSA_STATUS_ERROR_EXCEPTION, agent=gpu)

    def memory_fault(self, at: int = 1, gpu: int | None = None) -> None:
        """The ``at``-th packet from now faults. hsa-virtual: the next dispatch on ``gpu``
        (default GPU 0) faults, as KFD reports it (memory-exception event, the device's queues
        evicted for the rest of the process's use of it)."""
        if self.vkfd is not None:
            if at != 1:
                pytest.skip("hsa-virtual injects a memory fault at the next dispatch only")
            from .vkfd import INJECT_MEMORY_FAULT_NEXT
            self.vkfd.inject(0 if gpu is None else gpu, INJECT_MEMORY_FAULT_NEXT, 0)
            return
        self.faults.memory_fault_at(at, agent=gpu)

    def lose_interrupts(self, count: int = 1, gpu: int | None = None) -> None:
        """hsa-virtual: the next ``count`` interrupts of ``gpu`` (default every GPU) are lost
        (the signal's value changes, its event is never raised). Skips on the emulator."""
        if self.vkfd is None:
            pytest.skip("lost interrupts are injected on hsa-virtual (the emulator: delay_completions)")
        from .vkfd import INJECT_LOST_INTERRUPTS
        for g in self._virtual_gpus(gpu):
            self.vkfd.inject(g, INJECT_LOST_INTERRUPTS, count)

    def delay_completions(self, seconds: float, count: int | None = None) -> None:
        if self.vkfd is not None:
            pytest.skip("hsa-virtual does not delay completions")
        self.faults.delay_completions(seconds, count)

    def exhaust_sdma(self, gpu: int | None = None) -> None:
        """No SDMA queue is granted from now (hsa-virtual: KFD refuses the ones ROCr creates
        later, and ROCr falls back to its blit kernels)."""
        if self.vkfd is not None:
            from .vkfd import INJECT_SDMA_QUEUES
            for g in self._virtual_gpus(gpu):
                self.vkfd.inject(g, INJECT_SDMA_QUEUES, 0)
            return
        self.faults.exhaust_sdma(gpu)

    def restore_sdma(self, gpu: int | None = None) -> None:
        if self.vkfd is not None:
            from .vkfd import INJECT_SDMA_QUEUES
            for g in self._virtual_gpus(gpu):
                self.vkfd.inject(g, INJECT_SDMA_QUEUES, 16)
            return
        self.faults.restore_sdma(gpu)

    def eager(self, on: bool = True) -> None:
        """The command processor reads a slot as soon as its header is valid, before any doorbell."""
        if self.vkfd is not None:
            self.vkfd.set_eager(on)
            return
        self.faults.eager = on


@pytest.fixture
def inject(gpu_runtime: Any) -> Injector:
    """Fault injection for ``gpu_runtime`` (emulator and hsa-virtual)."""
    return Injector(gpu_runtime)


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "aiogpu(**options): options for the gpu_runtime fixture")
