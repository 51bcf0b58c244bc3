"""Build the C hot path (``aiogpu/cuda/_hotc.c``) in place, without pip or setuptools.

    python3 -m aiogpu.cuda.build_hotc            # compile; print where the module went
    python3 -m aiogpu.cuda.build_hotc --check    # then print which hot path aiogpu chooses

For a tree used with ``PYTHONPATH=.`` (no ``pip install``); ``pip install -e .`` builds the same
module through setup.py. Needs a C compiler and this Python's headers; nothing of CUDA (the
module takes the driver's entry points at run time). Exits non-zero when the build fails; aiogpu
then runs on its pure-Python hot path as before.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "_hotc.c")


def target() -> str:
    """Where the built module goes: next to its source, named for this interpreter's ABI."""
    return os.path.join(HERE, "_hotc" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def compiler() -> list[str]:
    """The compiler this Python was built with if it is here (``CC`` overrides), else cc/gcc."""
    for cand in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        if cand:
            argv = shlex.split(cand)
            if argv and shutil.which(argv[0]):
                return argv
    raise RuntimeError("no C compiler found (tried $CC, this Python's CC, cc, gcc, clang)")


def build(verbose: bool = True) -> str:
    """Compile ``_hotc.c`` into ``target()``; its path. Raises RuntimeError on failure (the
    module already there, if any, is left as it was: the new one replaces it by a rename)."""
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise RuntimeError(f"no Python.h in {include} (install this Python's development headers)")
    out = target()
    tmp = f"{out}.{os.getpid()}.tmp"
    cmd = [*compiler(), "-O2", "-Wall", "-shared", "-fPIC", f"-I{include}", SOURCE, "-o", tmp]
    if verbose:
        print(" ".join(shlex.quote(c) for c in cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise RuntimeError(f"compiling {SOURCE} failed:\n{proc.stdout}{proc.stderr}")
    os.replace(tmp, out)        # a process that loaded the old module keeps its mapping
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aiogpu.cuda.build_hotc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="after building, import aiogpu's CUDA driver layer and print the hot path it chose")
    args = ap.parse_args(argv)
    try:
        path = build()
    except RuntimeError as exc:
        print(f"build_hotc: {exc}", file=sys.stderr)
        return 1
    print(f"built {path}")
    if args.check:
        from . import driver as D
        print(f"hot path: {D.HOT.name} ({D.HOT_REASON})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
