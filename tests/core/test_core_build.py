"""The compiled core's build (aiogpu/_core): which core module is loaded, compiled or its .py,
and why; ``AIOGPU_PURE_CORE=1``; a compiled module older than its sources; the build without
Cython; what ``aiogpu info`` says.

``make test`` sets ``AIOGPU_EXPECT_COMPILED=1`` where a C compiler exists: the suite then fails if
the core it runs on is interpreted. ``make test-interpreted`` sets ``AIOGPU_PURE_CORE=1``.
"""
from __future__ import annotations

import importlib.machinery
import json
import os
import runpy
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import aiogpu._core as core

ROOT = Path(__file__).resolve().parents[2]
CORE_DIR = ROOT / "aiogpu" / "_core"
# Every compiled module, as aiogpu._core names them: the core's ("futures"), then the others by
# full name ("aiogpu.memory"); and each one's source path without its suffix, relative to ROOT.
TYPED = [n for n in core.module_names() if Path(core.source_base(n) + ".pxd").exists()]
SOURCE = {n: Path(core.source_base(n)).relative_to(ROOT / "aiogpu") for n in core.module_names()}
EXPECT_COMPILED = os.environ.get("AIOGPU_EXPECT_COMPILED", "") not in ("", "0")
BUILT = all(any(Path(core.source_base(n) + s).exists() for s in importlib.machinery.EXTENSION_SUFFIXES)
            for n in TYPED)

# What a child reports: each compiled module's (name, compiled, reason, file), then summary().
REPORT = ("import json, sys, aiogpu._core as c\n"
          "mods = c.modules()\n"
          "print(json.dumps([[m.name, m.compiled, m.reason, sys.modules[c.full_name(m.name)].__file__]"
          " for m in mods]))\n"
          "print(c.summary())\n")


def _child(code: str, root: Path = ROOT, cwd: Path = ROOT, args: tuple = (), **env: str) -> subprocess.CompletedProcess:
    child_env = {k: v for k, v in os.environ.items() if k not in ("AIOGPU_PURE_CORE", "AIOGPU_EXPECT_COMPILED")}
    child_env.update(env, PYTHONPATH=os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    got = subprocess.run([sys.executable, *(args or ("-c", code))], capture_output=True, text=True, timeout=120,
                         cwd=cwd, env=child_env)
    assert got.returncode == 0, got.stderr
    return got


def _report(root: Path = ROOT, **env: str) -> tuple[list, str]:
    out = _child(REPORT, root, **env).stdout.splitlines()
    return json.loads(out[0]), out[1]


def test_there_is_a_typed_core_module():
    assert "hazards" in TYPED and "hazards" in core.module_names()


def test_pure_core_loads_every_core_module_from_its_source():
    mods, line = _report(AIOGPU_PURE_CORE="1")
    assert {m[0] for m in mods} == set(core.module_names())
    for name, compiled, reason, file in mods:
        assert not compiled and file == str(ROOT / "aiogpu" / SOURCE[name]) + ".py", (name, file)
        assert reason == ("AIOGPU_PURE_CORE=1" if name in TYPED else "no .pxd")
    assert line == "core: interpreted (AIOGPU_PURE_CORE=1)"


@pytest.mark.skipif(not BUILT, reason="the core's extension modules are not built in this tree")
def test_the_built_core_is_compiled_and_pure_core_zero_keeps_it():
    for env in ({}, {"AIOGPU_PURE_CORE": "0"}, {"AIOGPU_PURE_CORE": ""}):
        mods, line = _report(**env)
        for name, compiled, reason, file in mods:
            if name in TYPED:
                assert compiled and reason == "compiled" and not file.endswith(".py"), (env, name, file)
        assert line.startswith("core: compiled (Cython 3.") and line.endswith(": " + ", ".join(TYPED) + ")"), line


def test_this_suite_runs_on_the_core_it_was_asked_for():
    """The guard of ``make test``: with AIOGPU_EXPECT_COMPILED=1 every typed core module in this
    process is an extension module (not the .py, which a failed or skipped build leaves)."""
    mods = {m.name: m for m in core.modules()}
    for name in TYPED:
        file = sys.modules[core.full_name(name)].__file__
        if core.PURE:
            assert not mods[name].compiled and file.endswith(".py")
        elif EXPECT_COMPILED:
            assert mods[name].compiled, (f"make test runs on an interpreted {core.full_name(name)} "
                                         f"({mods[name].reason}; loaded from {file})")
        else:
            assert mods[name].compiled == BUILT or mods[name].reason.startswith("stale build")


def _copy_package(dest: Path) -> Path:
    """A copy of the package under ``dest``; its folder."""
    shutil.copytree(ROOT / "aiogpu", dest / "aiogpu", ignore=shutil.ignore_patterns("__pycache__"))
    return dest / "aiogpu"


@pytest.mark.skipif(not BUILT, reason="the core's extension modules are not built in this tree")
@pytest.mark.parametrize("which", ["first", "last"])
def test_a_compiled_module_older_than_its_sources_is_not_loaded_nor_any_other(tmp_path, which):
    """An edit to X.py or X.pxd without a rebuild: X.py runs (never the stale extension), and so
    do the other compiled modules' .py files: a compiled module reads another's objects as its
    compiled layout (a stale futures.py beside a compiled submit made submit read a Python
    object's memory as a compiled future's fields). The runtime then works."""
    copied = _copy_package(tmp_path)
    name = TYPED[0] if which == "first" else TYPED[-1]
    with open(f"{copied / SOURCE[name]}.pxd", "a") as f:
        f.write("\n# edited\n")
    code = REPORT + ("import aiogpu\nrt = aiogpu.Runtime('emulator')\nb = rt.devices[0].alloc(64)\n"
                     "assert b.fill(7).wait(30)\nprint(int(b.to_numpy('u4').result()[3]))\nrt.close()\n")
    out = _child(code, tmp_path, cwd=tmp_path).stdout.splitlines()
    got = {m[0]: m for m in json.loads(out[0])}
    line = out[1]
    assert got[name][3] == f"{copied / SOURCE[name]}.py"
    assert not got[name][1] and got[name][2].startswith(f"stale build ({name}.py or {name}.pxd changed")
    for other in TYPED:
        if other != name:
            assert got[other][1:] == [False, f"{core.ALL_OR_NONE}: {name} is interpreted",
                                      f"{copied / SOURCE[other]}.py"], got[other]
    assert line.startswith(f"core: interpreted ({name}: stale build (") and line.endswith(
        f"; the others with it: {core.ALL_OR_NONE})"), line
    assert out[2] == "7"


def test_without_a_build_the_core_runs_interpreted_and_says_so(tmp_path):
    copied = _copy_package(tmp_path)
    for name in TYPED:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            Path(f"{copied / SOURCE[name]}{suffix}").unlink(missing_ok=True)
    (copied / "_core" / core.BUILD_RECORD).unlink(missing_ok=True)
    mods, line = _report(tmp_path, cwd=tmp_path)
    for name, compiled, reason, file in mods:
        assert not compiled and file == f"{copied / SOURCE[name]}.py"
        assert reason == ("not built" if name in TYPED else "no .pxd")
    assert line == "core: interpreted (not built)"


def _setup_arguments(monkeypatch, *, cython: bool, scope: bool = False) -> dict:
    """What setup.py passes to setup() (or, with ``scope``, its globals), with or without Cython
    importable; nothing is built."""
    import setuptools
    got: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: got.update(kw))
    monkeypatch.chdir(ROOT)
    if not cython:
        for mod in [m for m in sys.modules if m == "Cython" or m.startswith("Cython.")]:
            monkeypatch.delitem(sys.modules, mod)
        monkeypatch.setitem(sys.modules, "Cython", None)     # import Cython raises ImportError
    namespace = runpy.run_path(str(ROOT / "setup.py"), run_name="setup")
    return namespace if scope else got


def test_the_build_without_cython_warns_and_leaves_the_core_to_its_sources(monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _setup_arguments(monkeypatch, cython=False)
    names = [ext.name for ext in got["ext_modules"]]
    assert "aiogpu.cuda._hotc" in names and not [n for n in names if core.full_name(n) in map(core.full_name, TYPED)]
    assert any("Cython is not installed: the core (aiogpu/_core) runs interpreted" in str(w.message) for w in caught)


def test_the_build_with_cython_compiles_each_typed_core_module(monkeypatch):
    pytest.importorskip("Cython", minversion="3.3.1", reason="the test extras install Cython 3.3.1 or newer")
    got = _setup_arguments(monkeypatch, cython=True)
    exts = {ext.name: ext for ext in got["ext_modules"]}
    for name in TYPED:
        ext = exts[core.full_name(name)]
        assert ext.optional                     # a compiler error warns, never fails the install
        assert [os.path.basename(s) for s in ext.sources] == [f"{SOURCE[name].name}.c"]


def test_the_build_record_matches_the_sources_it_was_built_from(monkeypatch):
    """setup.py's digest is the core's: a mismatch would leave every compiled module unused."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # (Cython is not installed: expected here)
        scope = _setup_arguments(monkeypatch, cython=False, scope=True)
    for name in TYPED:
        assert scope["core_digest"](name) == core.source_digest(name)


def test_info_prints_which_core_is_loaded_first():
    got = _child("", args=("-m", "aiogpu", "info", "--backend", "emulator"), AIOGPU_PURE_CORE="1")
    assert got.stdout.splitlines()[0] == "core: interpreted (AIOGPU_PURE_CORE=1)"
    assert "backend: emulator" in got.stdout


def test_the_core_keeps_positions_as_given_compiled_or_not():
    """The .pxd types no position as a C integer (one would take True and 1.5 silently, or
    truncate): the core sees what the caller passed, as the .py does; validation stays in the
    API, where test_bad_input checks it, compiled and interpreted."""
    from aiogpu._core.hazards import Hazards, HostRange
    hz = Hazards()
    r = hz.host(True, 1.5)
    assert r.start is True and r.end == 2.5 and type(r.end) is float
    big = hz.host(2 ** 70, 1)                   # beyond any C integer: no OverflowError
    assert big.end == 2 ** 70 + 1 and big.writers() == [] and big.last_write is None
    with pytest.raises(AttributeError):
        r.label = "x"                           # slotted, as the .py's __slots__
    assert isinstance(r, HostRange) and r.hazards is hz


def test_a_module_outside_the_core_with_a_pxd_follows_the_same_rules(tmp_path):
    """A per-operation module of the API or a backend (a .pxd beside aiogpu/P/X.py) is listed
    by its full name and loaded by the same rules: its .py while it is not built, or with
    AIOGPU_PURE_CORE=1."""
    copied = _copy_package(tmp_path)
    (copied / "cuda" / "_probe.py").write_text("def twice(x):\n    return 2 * x\n")
    (copied / "cuda" / "_probe.pxd").write_text("cpdef object twice(object x)\n")
    code = REPORT.replace("mods = c.modules()", "import aiogpu.cuda._probe as p; assert p.twice(2) == 4\n"
                          "mods = c.modules()")
    for env, why in (({}, "not built"), ({"AIOGPU_PURE_CORE": "1"}, "AIOGPU_PURE_CORE=1")):
        out = _child(code, tmp_path, cwd=tmp_path, **env).stdout.splitlines()
        got = {m[0]: m for m in json.loads(out[0])}
        assert got["aiogpu.cuda._probe"][1:] == [False, why, str(copied / "cuda" / "_probe.py")], got


def test_the_build_finds_modules_outside_the_core_and_records_them_by_full_name(monkeypatch, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scope = _setup_arguments(monkeypatch, cython=False, scope=True)
    copied = _copy_package(tmp_path)
    (copied / "cuda" / "_probe.py").write_text("x = 1\n")
    (copied / "cuda" / "_probe.pxd").write_text("cdef public object x\n")
    (copied / "cuda" / "_lonely.pxd").write_text("")          # no .py beside it: not a module
    monkeypatch.chdir(tmp_path)
    found = scope["compiled_modules"]()
    assert found["aiogpu.cuda._probe"] == "aiogpu.cuda._probe" and "aiogpu.cuda._lonely" not in found
    assert found["aiogpu._core.hazards"] == "hazards"
    assert scope["source_base"]("aiogpu.cuda._probe") == os.path.join("aiogpu", "cuda", "_probe")
