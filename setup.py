"""The optional compiled parts: the core and the per-operation modules of the API and the
backends (every aiogpu/**/X.py with an X.pxd beside it, compiled by Cython 3 in pure-Python mode), the CUDA backend's hot path (aiogpu/cuda/_hotc.c) and the virtual
KFD of the hsa-virtual backend (aiogpu/vkfd/vkfd.c, built as aiogpu/vkfd/libhsakmt.so.1);
everything else about the package is in pyproject.toml.

The core is compiled where Cython 3 and a C compiler exist; elsewhere (or if compiling fails)
the install warns and the same .py files run interpreted. Each compiled module is recorded, with
the hash of the sources it was compiled from, in aiogpu/_core/_compiled.txt: aiogpu loads a
compiled module only while its sources still match (see aiogpu/_core/__init__.py).

The extension is built where a C compiler and this Python's headers exist and skipped, with a
warning, where they do not: aiogpu then uses its pure-Python hot path (aiogpu.cuda.driver picks
the C one only when the module imports). It needs no CUDA headers or libraries to build.

The virtual KFD is a plain shared library (no Python module): the thunk ABI ``HSAKMT_1`` that
ROCr 5.2.3 links against, with soname ``libhsakmt.so.1``. It builds where a C compiler and
Debian's libhsakmt-dev headers (``hsakmt.h``) exist and is skipped, with a warning, elsewhere;
the hsa-virtual backend is then unavailable and says which packages it needs.
"""
import glob
import hashlib
import os
import re
import warnings

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: ``optional=True`` covers compiler errors; this
    also covers a missing compiler or headers detected before compiling (setup errors)."""

    def run(self) -> None:
        self._core_built: list[str] = []
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any failure here means "no compiled parts"
            self.warn(f"the optional compiled parts (C hot path, compiled core) were not built: {exc}")
        self._write_core_record()

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            if ext.name == VKFD:
                what = "virtual KFD (hsa-virtual backend)"
            elif ext.name in COMPILED_NAMES:
                what = f"compiled module ({ext.name}; its .py runs interpreted)"
            else:
                what = f"C hot path ({ext.name})"
            self.warn(f"the optional {what} was not built: {exc}")
            return
        if ext.name in COMPILED_NAMES:
            self._core_built.append(COMPILED_NAMES[ext.name])

    def _write_core_record(self) -> None:
        """aiogpu/_core/_compiled.txt beside the compiled core: the Cython version, then one line
        per compiled module, "name digest" (the format aiogpu/_core/__init__.py reads; a core
        module's name is its own, "futures", any other's its full name, "aiogpu.memory")."""
        if not COMPILED_NAMES:
            return
        out_dir = os.path.dirname(self.get_ext_fullpath(f"{CORE}.__init__"))
        os.makedirs(out_dir, exist_ok=True)
        lines = [CYTHON_VERSION] + [f"{name} {core_digest(name)}" for name in sorted(self._core_built)]
        with open(os.path.join(out_dir, "_compiled.txt"), "w", encoding="ascii") as f:
            f.write("\n".join(lines) + "\n")

    def get_ext_filename(self, fullname: str) -> str:
        # the soname ROCr's DT_NEEDED names, not a Python module's name (distutils passes the
        # last component of the name when it builds outside the source tree)
        if fullname == VKFD:
            return os.path.join("aiogpu", "vkfd", "libhsakmt.so.1")
        if fullname == VKFD.rsplit(".", 1)[1] and VKFD in getattr(self, "ext_map", {}):
            return "libhsakmt.so.1"
        return super().get_ext_filename(fullname)

    def get_export_symbols(self, ext: Extension) -> list:
        return [] if ext.name == VKFD else super().get_export_symbols(ext)


VKFD = "aiogpu.vkfd.libhsakmt"
# The oldest Cython that compiles the core right: with 3.3.0 (the H200 image's) the compiled core
# crashed the HSA waiter on its first emulator test on Python 3.12 (a segmentation fault in the
# hub's settling); 3.3.1 passes the whole suite there.
MIN_CYTHON = (3, 3, 1)
CORE = "aiogpu._core"
CORE_DIR = os.path.join("aiogpu", "_core")


def compiled_modules() -> dict[str, str]:
    """{full module name: the name the build record gives it} of every aiogpu/**/X.py with an
    X.pxd beside it: a core module's own name ("futures"), any other's full name."""
    out = {}
    for pxd in sorted(glob.glob(os.path.join("aiogpu", "**", "*.pxd"), recursive=True)):
        if not os.path.exists(pxd[:-4] + ".py"):
            continue
        full = pxd[:-4].replace(os.sep, ".")
        out[full] = full.rsplit(".", 1)[1] if os.path.dirname(pxd) == CORE_DIR else full
    return out


def source_base(name: str) -> str:
    """A recorded name's source path without suffix (as aiogpu._core.source_base)."""
    if name.startswith("aiogpu."):
        return os.path.join(*name.split("."))
    return os.path.join(CORE_DIR, name)


def core_digest(name: str) -> str:
    """The hash of a compiled module's .py and .pxd (the same as aiogpu._core.source_digest,
    which this file cannot import: the package's dependencies are not in the build environment)."""
    h = hashlib.sha256()
    for suffix in (".py", ".pxd"):
        path = source_base(name) + suffix
        if os.path.exists(path) or suffix == ".py":
            with open(path, "rb") as f:
                h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()


def _version(text: str) -> tuple[int, ...]:
    """A version string's leading numbers ("3.3.1" -> (3, 3, 1), "3.4.0b1" -> (3, 4, 0))."""
    m = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def core_extensions() -> tuple[list, dict[str, str], str]:
    """(extensions, {full name: recorded name}, Cython version) of the modules that have a .pxd;
    none, with a warning, where Cython 3 is missing or cannot translate them."""
    names = compiled_modules()
    if not names or os.environ.get("AIOGPU_NO_COMPILE_CORE", "") not in ("", "0"):
        return [], {}, ""
    try:
        import Cython
        from Cython.Build import cythonize
    except ImportError:
        warnings.warn("Cython is not installed: the core (aiogpu/_core) runs interpreted")
        return [], {}, ""
    if _version(Cython.__version__) < MIN_CYTHON:
        warnings.warn(f"Cython {Cython.__version__} is older than {'.'.join(map(str, MIN_CYTHON))}: "
                      f"the core (aiogpu/_core) runs interpreted")
        return [], {}, ""
    exts = [Extension(full, [full.replace(".", os.sep) + ".py"], optional=True) for full in names]
    try:
        exts = cythonize(exts, build_dir=os.path.join("build", "cython"), quiet=True,
                         compiler_directives={"language_level": 3,
                                             # the .pxd types, not the annotations (those are for
                                             # mypy: a C int would take True and 1.5)
                                             "annotation_typing": False})
    except Exception as exc:  # noqa: BLE001 - a translation error means "interpreted", never a failed install
        warnings.warn(f"Cython could not translate the core (aiogpu/_core runs interpreted): {exc}")
        return [], {}, ""
    for ext in exts:
        ext.optional = True
    return exts, names, Cython.__version__


CORE_EXTENSIONS, COMPILED_NAMES, CYTHON_VERSION = core_extensions()


setup(
    ext_modules=[
        *CORE_EXTENSIONS,
        Extension("aiogpu.cuda._hotc", ["aiogpu/cuda/_hotc.c"], optional=True),
        Extension(VKFD, ["aiogpu/vkfd/vkfd.c"], optional=True, libraries=["pthread"],
                  depends=["aiogpu/vkfd/hsakmt.ver"],
                  extra_compile_args=["-fvisibility=hidden", "-Wall", "-Wno-unused-parameter"],
                  extra_link_args=["-Wl,--version-script=aiogpu/vkfd/hsakmt.ver", "-Wl,-soname,libhsakmt.so.1"]),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
