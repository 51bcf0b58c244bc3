"""The core: what runs per operation, kept free of driver calls, event loops and user-facing
validation so that it can be compiled; and the loading of every compiled module of aiogpu.

Each module here is one source, ``X.py``. The package build compiles those with a ``X.pxd``
beside them (Cython 3, pure-Python mode) where Cython and a C compiler exist; elsewhere, and for
the modules without a ``.pxd``, the ``.py`` runs as it is. Both must behave the same: the suite
runs both ways (``make test``, ``make test-interpreted``). The same holds for the per-operation
modules outside the core, in the API and the backends (a ``.pxd`` beside ``aiogpu/P/X.py``):
the rules below cover them too, and they are named by their full name (``aiogpu.memory``), the
core's modules by their own (``futures``). ``aiogpu/__init__.py`` imports this package first, so
that the finder below is in place before any of them is imported.

``AIOGPU_PURE_CORE=1`` in the environment (read once, when ``aiogpu._core`` is first imported) loads
every compiled module from its ``.py`` even where it is built: the finder below goes before the
import system's own, which would prefer the extension. A compiled module older than its sources
(edited since the build, without a rebuild) is not loaded either: the ``.py`` runs and
``modules()`` says why, so an edit is never silently ignored.

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
_PACKAGE = os.path.dirname(_HERE)           # aiogpu/
_TOP = os.path.basename(_PACKAGE)           # "aiogpu"
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


def source_base(name: str) -> str:
    """The path, without its suffix, of a compiled module's sources: ``futures`` (a core module)
    or ``aiogpu.cuda.streams`` (any other)."""
    if name.startswith(_TOP + "."):
        return os.path.join(_PACKAGE, *name.split(".")[1:])
    return os.path.join(_HERE, name)


def source_digest(name: str) -> str:
    """The hash of a compiled module's sources (``X.py`` and ``X.pxd``, in that order) as the
    build records it. Raises OSError if ``X.py`` cannot be read."""
    h = hashlib.sha256()
    base = source_base(name)
    for suffix in (".py", ".pxd"):
        try:
            with open(base + suffix, "rb") as f:
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
    base = source_base(name)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = base + suffix
        if os.path.exists(path):
            return path
    return None


def _name_of(fullname: str) -> str | None:
    """A module's name as the lists here give it (None: not a module of this package)."""
    if not fullname.startswith(_TOP + "."):
        return None
    prefix, _, name = fullname.rpartition(".")
    return name if prefix == __name__ else fullname


def _own_reason(name: str) -> str | None:
    """Why the compiled module ``name`` cannot be loaded (None: it is built from its sources)."""
    if _extension_path(name) is None:
        return "not built"
    recorded = _DIGESTS.get(name)
    if recorded is not None and recorded == source_digest(name):
        return None
    return (f"stale build ({name}.py or {name}.pxd changed since it was compiled; rebuild: "
            "make, or python setup.py build_ext --inplace)")


_FIRST_UNLOADABLE: list = []       # once computed: [(name, why)] or [None]
ALL_OR_NONE = "compiled modules load all or none"   # (the reason of those a stale one holds back)


def _first_unloadable() -> tuple[str, str] | None:
    """The first compiled module that cannot be loaded, and why; None when all can. Compiled
    modules read each other's objects as C structs (a .pxd's ``cimport``): a compiled module
    beside the interpreted .py of another would read a Python object's memory as the compiled
    layout. So they load all or none."""
    if not _FIRST_UNLOADABLE:
        found = None
        for name in module_names():
            if os.path.exists(source_base(name) + ".pxd"):
                why = _own_reason(name)
                if why is not None:
                    found = (name, why)
                    break
        _FIRST_UNLOADABLE.append(found)
    return _FIRST_UNLOADABLE[0]


class _SourceFirst:
    """A meta-path finder for aiogpu's modules that have a ``.pxd``: the ``.py`` where pure mode
    is asked for, or where any compiled module is not built or stale (they load all or none:
    ``_first_unloadable``); otherwise it declines and the import system finds the extension."""

    @staticmethod
    def find_spec(fullname: str, path: Sequence[str] | None = None, target: object = None):
        name = _name_of(fullname)
        if name is None:
            return None
        base = source_base(name)
        source = base + ".py"
        if not os.path.exists(base + ".pxd") or not os.path.exists(source):
            return None
        if PURE:
            why = f"{PURE_ENV}=1"
        else:
            blocker = _first_unloadable()
            if blocker is None:
                return None                      # the extension, found by the import system
            why = _own_reason(name) or f"{ALL_OR_NONE}: {blocker[0]} is interpreted"
        _WHY_INTERPRETED[name] = why
        return importlib.util.spec_from_file_location(fullname, source)


if not any(isinstance(f, _SourceFirst) for f in sys.meta_path):
    sys.meta_path.insert(0, _SourceFirst())


def module_names() -> list[str]:
    """The core's modules (every ``X.py`` here), sorted, then the compiled modules elsewhere in
    aiogpu (an ``X.py`` with an ``X.pxd`` beside it), by full name, sorted."""
    core = sorted(f[:-3] for f in os.listdir(_HERE) if f.endswith(".py") and f != "__init__.py")
    others = []
    for folder, dirs, files in os.walk(_PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        if os.path.samefile(folder, _HERE):
            continue
        parts = [_TOP, *os.path.relpath(folder, _PACKAGE).split(os.sep)]
        parts = [p for p in parts if p != "."]
        others += [".".join([*parts, f[:-4]]) for f in files if f.endswith(".pxd") and f[:-4] + ".py" in files]
    return core + sorted(others)


def full_name(name: str) -> str:
    """The importable name of ``name`` as ``module_names`` gives it."""
    return name if name.startswith(_TOP + ".") else f"{__name__}.{name}"


def modules(import_all: bool = True) -> list[CoreModule]:
    """What is loaded for each core module and each compiled module elsewhere (importing them
    first unless ``import_all`` is false; a module not imported then reads 'not imported').
    Raises what importing one raises."""
    out = []
    for name in module_names():
        full = full_name(name)
        if import_all:
            importlib.import_module(full)
        mod = sys.modules.get(full)
        if mod is None:
            out.append(CoreModule(name, False, "not imported"))
        elif isinstance(getattr(mod, "__loader__", None), importlib.machinery.ExtensionFileLoader):
            out.append(CoreModule(name, True, "compiled"))
        elif not os.path.exists(source_base(name) + ".pxd"):
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
    own = [m for m in others if not m.reason.startswith(ALL_OR_NONE)]
    if own and len(own) < len(others):       # one stale or missing module holds the rest back
        return ("core: interpreted (" + "; ".join(f"{m.name}: {m.reason}" for m in own)
                + f"; the others with it: {ALL_OR_NONE})")
    reasons = sorted({m.reason for m in others})
    if not compiled:
        if len(reasons) == 1:
            return f"core: interpreted ({reasons[0]})"
        return "core: interpreted (" + "; ".join(f"{m.name}: {m.reason}" for m in others) + ")"
    return (f"core: partly compiled ({cython}: {', '.join(compiled)}; interpreted: "
            + "; ".join(f"{m.name}: {m.reason}" for m in others) + ")")
