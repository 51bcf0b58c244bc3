"""The public API's type hints: mypy accepts typical use of it, reveals the futures' result
types (``GPUFuture[np.ndarray]`` from ``to_numpy``, ``GPUFuture[None]`` from launches, copies,
fills, joins), and finds the installed package by itself (it ships ``py.typed``, and the
editable install that ``make`` creates exposes it without ``MYPYPATH``)."""
from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
USAGE = HERE / "typed_usage.py"


def _mypy(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", os.devnull,
                           "--python-executable", sys.executable, *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def _expected() -> dict[int, str]:
    """Line number -> the type its ``reveal_type`` must reveal (the ``# expect:`` comments)."""
    out = {}
    for i, line in enumerate(USAGE.read_text().splitlines(), 1):
        m = re.search(r"reveal_type\(.*#\s*expect:\s*(.+)$", line)
        if m:
            out[i] = m.group(1).strip()
    return out


def _short(revealed: str) -> str:
    """mypy's ``Revealed type is "aiogpu.futures.GPUFuture[numpy.ndarray[Any, ...]]"`` as
    ``GPUFuture[ndarray]``: module paths and ndarray's parameters left out."""
    revealed = re.sub(r"\b(?:[a-z_][a-z0-9_]*\.)+([A-Za-z_])", r"\1", revealed)
    while True:
        shorter = re.sub(r"ndarray\[[^\[\]]*(?:\[[^\[\]]*\][^\[\]]*)*\]", "ndarray", revealed)
        if shorter == revealed:
            return revealed.replace("builtins.", "")
        revealed = shorter


def test_mypy_accepts_typical_use_and_reveals_the_result_types():
    pytest.importorskip("mypy")
    expected = _expected()
    assert len(expected) >= 8
    got = _mypy(str(USAGE), cwd=HERE.parents[1])    # (the repository's aiogpu, from the root)
    revealed = {int(m.group(1)): _short(m.group(2)) for m in
                re.finditer(r"typed_usage\.py:(\d+): note: Revealed type is \"(.+)\"", got.stdout)}
    errors = [line for line in got.stdout.splitlines() if ": error:" in line]
    assert not errors, got.stdout + got.stderr
    assert revealed == expected, got.stdout


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed("aiogpu"),
                    reason="aiogpu is not installed in this Python (run `make test`, which installs it)")
def test_mypy_finds_the_installed_package_without_mypypath(tmp_path):
    """From outside the repository, with neither MYPYPATH nor PYTHONPATH, mypy finds the
    aiogpu installed in this Python (``make`` installs it editable) and its hints."""
    pytest.importorskip("mypy")
    probe = tmp_path / "probe.py"
    probe.write_text("import aiogpu\n\n\ndef f(b: aiogpu.Buffer) -> None:\n"
                     "    reveal_type(b.to_numpy())\n")
    got = _mypy(str(probe), cwd=tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "Revealed type is \"aiogpu.futures.GPUFuture[numpy.ndarray" in got.stdout, got.stdout
