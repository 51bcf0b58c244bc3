"""ABI tests: aiogpu's ctypes HSA bindings against ROCr's headers and library (see abi_support.py)."""
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1], HERE):  # the repo root (aiogpu/) and this folder (abi_support)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(scope="session")
def abi_workdir(tmp_path_factory) -> Path:
    """One folder per session for the generated C programs (each is built once per session)."""
    return tmp_path_factory.mktemp("abi")
