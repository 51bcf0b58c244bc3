"""What the ABI tests share: where ROCr's headers and library are, the skip marks, and small runners
for a C compiler and for Python subprocesses.

The tests check aiogpu's ctypes HSA bindings against ROCr as Debian ships it (``libhsa-runtime-dev``
for ``/usr/include/hsa``, ``libhsa-runtime64-1`` for the shared object). They skip only where those
packages or a C compiler are missing (plus the few that assume no AMD GPU, which skip where one may be).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]          # the repository root (holds aiogpu/)
HSA_INCLUDE = Path("/usr/include/hsa")
# Read by the tests in this order; the later ones include hsa.h themselves.
HEADERS = ("hsa.h", "hsa_ext_amd.h", "amd_hsa_signal.h", "amd_hsa_queue.h")
LIBRARY = Path("/usr/lib/x86_64-linux-gnu/libhsa-runtime64.so.1")
CC = shutil.which(os.environ.get("CC", "gcc"))

HAVE_HEADERS = all((HSA_INCLUDE / h).is_file() for h in HEADERS)
HAVE_LIBRARY = LIBRARY.is_file()


def _amd_gpu_may_answer() -> bool:
    """True where ROCr could find an agent: a KFD device node, or a KFD topology node with SIMDs."""
    if Path("/dev/kfd").exists():
        return True
    for props in Path("/sys/class/kfd/kfd/topology/nodes").glob("*/properties"):
        for line in props.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "simd_count" and value.strip().isdigit() and int(value) > 0:
                return True
    return False


AMD_GPU_MAY_ANSWER = _amd_gpu_may_answer()

needs_headers = pytest.mark.skipif(
    not HAVE_HEADERS,
    reason=f"ROCr headers missing ({HSA_INCLUDE}/{{{','.join(HEADERS)}}}): apt install libhsa-runtime-dev")
needs_compiler = pytest.mark.skipif(
    CC is None, reason="no C compiler (gcc, or $CC) on PATH: apt install gcc")
needs_library = pytest.mark.skipif(
    not HAVE_LIBRARY, reason=f"ROCr library missing ({LIBRARY}): apt install libhsa-runtime64-1")
needs_no_gpu = pytest.mark.skipif(
    AMD_GPU_MAY_ANSWER,
    reason="an AMD GPU may answer here (/dev/kfd or a KFD GPU node exists); these checks assume none")

# ---------------------------------------------------------------------------------------------
# headers

C_INCLUDES = "".join(f"#include <hsa/{h}>\n" for h in HEADERS)  # no -I needed: they include "hsa.h"


def header_text() -> str:
    """Every header the tests include (and hsa_ext_image.h, which hsa_ext_amd.h pulls in), comments
    removed."""
    names = (*HEADERS, "hsa_ext_image.h", "amd_hsa_common.h")
    text = "\n".join((HSA_INCLUDE / n).read_text() for n in names if (HSA_INCLUDE / n).is_file())
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def header_constants(text: str) -> set[str]:
    """Names the headers define as enumerators or macros (``NAME = ...`` or ``#define NAME``)."""
    enumerators = re.findall(r"(?:^|[{,])\s*([A-Z][A-Z0-9_]*)\s*=", text, flags=re.M)
    macros = re.findall(r"^\s*#\s*define\s+([A-Z][A-Z0-9_]*)\b", text, flags=re.M)
    return set(enumerators) | set(macros)


def header_typedefs(text: str) -> set[str]:
    """Names the headers introduce with ``typedef ... NAME;`` (or ``} NAME;``)."""
    return set(re.findall(r"(?:typedef[^;{]*?|})\s*(\w+)\s*;", text))


# ---------------------------------------------------------------------------------------------
# running things


def compile_c(source: str, workdir: Path, name: str, *, run: bool) -> str:
    """Compile ``source`` (and run it when ``run``); returns the program's stdout.

    A compiler error fails the calling test with the diagnostics and the path of the kept source.
    """
    src = workdir / f"{name}.c"
    src.write_text(source)
    exe = workdir / name
    cmd = [CC, "-std=gnu11", "-Wall", "-Werror=incompatible-pointer-types",
           "-Werror=implicit-function-declaration", "-Werror=format", str(src)]
    cmd += ["-o", str(exe)] if run else ["-fsyntax-only"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise CompileError(src, done.stderr)
    if not run:
        return done.stderr  # warnings, if any
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout


class CompileError(Exception):
    def __init__(self, src: Path, stderr: str):
        self.src, self.stderr = src, stderr
        super().__init__(f"{CC} rejected {src}:\n{stderr}")


def run_python(code: str, timeout: float = 60) -> dict:
    """Run ``code`` in a fresh interpreter (so a crashing library call, or ROCr's process-wide
    hsa_init state, stays there); its last stdout line must be a JSON object, which is returned."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOGPU_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        how = (f"killed by signal {-done.returncode}" if done.returncode < 0
               else f"exit status {done.returncode}")
        pytest.fail(f"subprocess failed ({how})\n--- code ---\n{code}\n--- stdout ---\n{done.stdout}"
                    f"\n--- stderr ---\n{done.stderr}", pytrace=False)
    return json.loads(lines[-1])
