"""The public API's type hints: mypy accepts typical use of it (the package ships py.typed)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_mypy_accepts_typical_use_of_the_public_api():
    pytest.importorskip("mypy")
    here = os.path.dirname(__file__)
    got = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", os.devnull,
                          os.path.join(here, "typed_usage.py")], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
