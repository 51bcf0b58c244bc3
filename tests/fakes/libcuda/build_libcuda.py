"""Build the fake ``libcuda.so.1`` (``fakecuda.c`` beside this file) on demand; print its folder.

    LD_LIBRARY_PATH=$(python tests/fakes/libcuda/build_libcuda.py) \\
        PYTHONPATH=tests/fakes:. python bench/hostcost.py --backend cuda

With that folder on ``LD_LIBRARY_PATH`` and the fake ``cuda.bindings`` on ``PYTHONPATH``, the
fake's ``cuGetProcAddress`` exists and ``ctypes.CDLL("libcuda.so.1")`` loads this library, so
aiogpu's C hot path (``aiogpu.cuda._hotc``, where built) runs on the fake driver as it runs on a
GPU. The library goes to ``build/fakecuda/`` under the repository (git-ignored); it is compiled
again when ``fakecuda.c`` is newer. Needs a C compiler (``$CC``, cc, gcc or clang) and nothing
else: no CUDA, no Python headers. Exits 1, saying why, where the build fails.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "fakecuda.c")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
LIB_DIR = os.path.join(ROOT, "build", "fakecuda")
LIB = os.path.join(LIB_DIR, "libcuda.so.1")


def compiler() -> list[str] | None:
    """The C compiler to use (``$CC`` first), or None where there is none."""
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand:
            argv = shlex.split(cand)
            if argv and shutil.which(argv[0]):
                return argv
    return None


def build(source: str = SOURCE, lib: str = LIB) -> str:
    """Compile ``source`` into ``lib`` unless it is there and newer than its source; the
    folder to put on ``LD_LIBRARY_PATH``. Raises RuntimeError (no compiler, or the compile
    failed; a library already there is left as it was: the new one replaces it by a rename)."""
    lib_dir = os.path.dirname(lib)
    if os.path.exists(lib) and os.path.getmtime(lib) >= os.path.getmtime(source):
        return lib_dir
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (tried $CC, cc, gcc, clang)")
    os.makedirs(lib_dir, exist_ok=True)
    tmp = f"{lib}.{os.getpid()}.tmp"
    # The soname lets a later dlopen("libcuda.so.1") find this library once it is loaded.
    cmd = [*cc, "-O2", "-Wall", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", source, "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    os.replace(tmp, lib)
    return lib_dir


def main() -> int:
    try:
        print(build())
    except RuntimeError as exc:
        print(f"build_libcuda: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
