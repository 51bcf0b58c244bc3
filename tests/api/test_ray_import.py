"""``import aiogpu`` never imports Ray; ``import aiogpu.ray`` without Ray says how to get it.

These run with or without Ray installed (each in a fresh interpreter).
"""
from __future__ import annotations

import subprocess
import sys


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_importing_aiogpu_does_not_import_ray():
    out = python("import sys, aiogpu; aiogpu.Loader; print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_aiogpu_ray_without_ray_names_the_fix():
    # sys.modules["ray"] = None makes "import ray" fail as it does where Ray is not installed.
    out = python("import sys; sys.modules['ray'] = None\n"
                 "try:\n    import aiogpu.ray\n"
                 "except ImportError as exc:\n    print('ImportError:', exc)\n")
    assert out.returncode == 0, out.stderr
    assert "ImportError:" in out.stdout and "pip install 'aiogpu[ray]'" in out.stdout, out.stdout
