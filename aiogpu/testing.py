"""pytest plugin for async GPU test suites (registered as the ``aiogpu`` pytest11 entry point).

Fixtures: ``gpu_runtime`` (a fresh runtime per test), ``gpu`` (its first device), ``gpus`` (all),
``inject`` (fault injection on the emulator). Options: ``--aiogpu-backend=emulator|hsa|cuda``
(default emulator), ``--aiogpu-gpus=N`` (emulated GPUs), ``--aiogpu-shared-runtime`` (one runtime
for the whole session instead of one per test; fault injection then needs care),
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
    group.addoption("--aiogpu-backend", default="emulator", choices=("emulator", "hsa", "cuda"),
                    help="backend of the gpu_runtime fixture (default: emulator)")
    group.addoption("--aiogpu-gpus", type=int, default=2, help="number of emulated GPUs (default 2)")
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
    """Fault injection on the emulated runtime of this test (skips on a real backend)."""

    def __init__(self, rt: Any):
        emulator = rt.api.emulator if hasattr(rt, "api") else None
        if emulator is None:
            pytest.skip("fault injection needs the emulator backend")
        self.faults = emulator.faults

    def queue_error(self, at: int = 1, status: int | None = None, gpu: int | None = None) -> None:
        """The ``at``-th packet processed from now fails with ``status`` (default EXCEPTION)."""
        from .hsa_bindings import types as T
        self.faults.queue_error_at(at, status=status or T.HSA_STATUS_ERROR_EXCEPTION, agent=gpu)

    def memory_fault(self, at: int = 1, gpu: int | None = None) -> None:
        self.faults.memory_fault_at(at, agent=gpu)

    def delay_completions(self, seconds: float, count: int | None = None) -> None:
        self.faults.delay_completions(seconds, count)

    def exhaust_sdma(self, gpu: int | None = None) -> None:
        self.faults.exhaust_sdma(gpu)

    def restore_sdma(self, gpu: int | None = None) -> None:
        self.faults.restore_sdma(gpu)

    def eager(self, on: bool = True) -> None:
        self.faults.eager = on


@pytest.fixture
def inject(gpu_runtime: Any) -> Injector:
    """Fault injection for ``gpu_runtime`` (emulator only)."""
    return Injector(gpu_runtime)


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "aiogpu(**options): options for the gpu_runtime fixture")
