"""The core: what runs per operation, kept free of driver calls, event loops and user-facing
validation so that it can be compiled.

Each module here is one source, ``X.py``. The package build compiles those with a ``X.pxd``
beside them (Cython 3, pure-Python mode) where Cython and a C compiler exist; elsewhere, and for
the modules without a ``.pxd``, the ``.py`` runs as it is. Both must behave the same: the suite
runs both ways (``make test``, ``make test-interpreted``).

``AIOGPU_PURE_CORE=1`` in the environment (read once, when ``aiogpu._core`` is first imported) loads
every core module from its ``.py`` even where its compiled module is built: the finder below
goes before the import system's own, which would prefer the extension. A compiled module older
than its sources (edited since the build, without a rebuild) is not loaded either: the ``.py``
runs and ``modules()`` says why, so an edit is never silently ignored.

``modules()`` and ``summary()`` say what is loaded, per module, and why; ``aiogpu info`` prints
``summary()``.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from typing import NamedTuple, Sequence

PURE_ENV = "AIOGPU_PURE_CORE"
PURE: bool = os.environ.get(PURE_ENV, "") not in ("", "0")

_HERE = os.path.dirname(os.path.abspath(__file__))
# Written by the build beside the compiled modules (see setup.py): the Cython version, then one
# line per compiled module, "name sha256", the hash of its .py and .pxd as compiled.
BUILD_RECORD = "_compiled.txt"


class CoreModule(NamedTuple):
    """What is loaded for one core module: ``compiled`` (an extension module) or not, and why
    (``reason``: 'compiled', 'AIOGPU_PURE_CORE=1', 'not built', 'no .pxd' (interpreted by
    design), 'stale build (...)', or 'not imported')."""

    name: str
    compiled: bool
    reason: str


def source_digest(name: str, directory: str = _HERE) -> str:
    """The hash of a core module's sources (``name.py`` and ``name.pxd``, in that order) as the
    build records it. Raises OSError if ``name.py`` cannot be read."""
    h = hashlib.sha256()
    for suffix in (".py", ".pxd"):
        try:
            with open(os.path.join(directory, name + suffix), "rb") as f:
                h.update(f.read())
        except FileNotFoundError:
            if suffix == ".py":
                raise
        h.update(b"\0")
    return h.hexdigest()


def _read_record() -> tuple[str | None, dict[str, str]]:
    try:
        with open(os.path.join(_HERE, BUILD_RECORD), encoding="ascii") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError):
        return None, {}
    digests = {}
    for line in lines[1:]:
        name, _, digest = line.partition(" ")
        if digest:
            digests[name] = digest
    return lines[0].strip() or None, digests


CYTHON_VERSION, _DIGESTS = _read_record()
# why each core module imported so far was loaded from its .py although it has a .pxd
_WHY_INTERPRETED: dict[str, str] = {}


def _extension_path(name: str) -> str | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(_HERE, name + suffix)
        if os.path.exists(path):
            return path
    return None


class _SourceFirst:
    """A meta-path finder for ``aiogpu._core.X``: the ``.py`` where pure mode is asked for or the
    compiled module is stale; otherwise it declines and the import system finds the extension."""

    @staticmethod
    def find_spec(fullname: str, path: Sequence[str] | None = None, target: object = None):
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or not name:
            return None
        source = os.path.join(_HERE, name + ".py")
        if not os.path.exists(source) or not os.path.exists(os.path.join(_HERE, name + ".pxd")):
            return None
        if PURE:
            why = f"{PURE_ENV}=1"
        elif _extension_path(name) is None:
            why = "not built"
        else:
            recorded = _DIGESTS.get(name)
            if recorded is not None and recorded == source_digest(name):
                return None                      # the extension, found by the import system
            why = (f"stale build ({name}.py or {name}.pxd changed since it was compiled; rebuild: "
                   "make, or python setup.py build_ext --inplace)")
        _WHY_INTERPRETED[name] = why
        return importlib.util.spec_from_file_location(fullname, source)


if not any(isinstance(f, _SourceFirst) for f in sys.meta_path):
    sys.meta_path.insert(0, _SourceFirst())


def module_names() -> list[str]:
    """The core's modules (every ``X.py`` here), sorted."""
    return sorted(f[:-3] for f in os.listdir(_HERE) if f.endswith(".py") and f != "__init__.py")


def modules(import_all: bool = True) -> list[CoreModule]:
    """What is loaded for each core module (importing them first unless ``import_all`` is
    false; a module not imported then reads 'not imported'). Raises what importing one raises."""
    out = []
    for name in module_names():
        full = f"{__name__}.{name}"
        if import_all:
            importlib.import_module(full)
        mod = sys.modules.get(full)
        if mod is None:
            out.append(CoreModule(name, False, "not imported"))
        elif isinstance(getattr(mod, "__loader__", None), importlib.machinery.ExtensionFileLoader):
            out.append(CoreModule(name, True, "compiled"))
        elif not os.path.exists(os.path.join(_HERE, name + ".pxd")):
            out.append(CoreModule(name, False, "no .pxd"))
        else:
            out.append(CoreModule(name, False, _WHY_INTERPRETED.get(name, "not built")))
    return out


def summary() -> str:
    """One line: ``core: compiled (Cython 3.3.1: hazards, ...)``, ``core: interpreted
    (AIOGPU_PURE_CORE=1)``, or, mixed, what is compiled and why the rest is not (modules
    without a ``.pxd`` are interpreted by design and not listed)."""
    mods = [m for m in modules() if m.reason != "no .pxd"]
    compiled = [m.name for m in mods if m.compiled]
    others = [m for m in mods if not m.compiled]
    cython = f"Cython {CYTHON_VERSION}" if CYTHON_VERSION else "Cython"
    if not mods:
        return "core: interpreted (no module has a .pxd)"
    if not others:
        return f"core: compiled ({cython}: {', '.join(compiled)})"
    reasons = sorted({m.reason for m in others})
    if not compiled:
        if len(reasons) == 1:
            return f"core: interpreted ({reasons[0]})"
        return "core: interpreted (" + "; ".join(f"{m.name}: {m.reason}" for m in others) + ")"
    return (f"core: partly compiled ({cython}: {', '.join(compiled)}; interpreted: "
            + "; ".join(f"{m.name}: {m.reason}" for m in others) + ")")
