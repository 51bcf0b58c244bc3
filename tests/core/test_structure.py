"""The package's structure, read from its sources (``ast``; nothing is imported or run).

- No import cycle inside ``aiogpu/``. The graph is built from *module-level* imports only: those
  that run when the module is first imported (its top-level statements, the bodies of its
  classes, of its top-level ``if``/``try``/``with``). Imports under ``if TYPE_CHECKING:`` and
  imports inside functions do not count: they run later, or never. An edge goes to the module
  named (``from . import x`` to ``x`` where ``x`` is a submodule, else to the package); the
  implicit import of a module's parent packages does not count (every submodule would
  otherwise "cycle" through ``aiogpu/__init__.py``, which imports the public API).
- The core imports nothing above it (only the leaf modules of ``CORE_MAY_IMPORT``), and the two
  backends do not import each other; these count every import, in functions too.
- Calls go API -> core -> backend: no module under the backends (``aiogpu/hsa/``,
  ``aiogpu/cuda/``) calls the core's bookkeeping, except the allowlisted calls below, each with
  its reason; a new one fails the test.
- Nothing outside ``aiogpu/_core/`` touches the hub's private fields, except the backends' hub
  subclasses (their waiter threads observe completions) and the allowlisted uses below.
- The stubs ``aiogpu/_core/futures.pyi`` and ``hub.pyi`` declare every method of the classes of
  ``futures.py`` and ``hub.py``.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "aiogpu"


def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> source file."""
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_statements(body: list[ast.stmt]):
    """The statements run when the module is imported (see the module doc)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _import_time_statements(node.body)
            yield from _import_time_statements(node.orelse)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            for part in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _import_time_statements(part)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _import_time_statements(node.body)


def _resolve(mod: str, path: Path, level: int, name: str | None) -> str:
    """The absolute name of a relative import ``from <level dots><name> import ...`` in ``mod``."""
    if level == 0:
        return name or ""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{name}" if name else package


def import_graph() -> dict[str, set[str]]:
    """aiogpu's modules -> the aiogpu modules each imports at module level."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _import_time_statements(tree.body):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, path, node.level, node.module)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                # ``import aiogpu.x.y`` names aiogpu.x.y; the nearest module of ours it names.
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _a_cycle(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One concrete cycle through the component's first module, for the failure message."""
    start, members = comp[0], set(comp)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    return comp


def test_the_graph_sees_imports():
    """The graph is not vacuous: known module-level imports are in it, function-level ones not."""
    graph = import_graph()
    assert "aiogpu._core.futures" in graph["aiogpu._core.hub"]
    assert "aiogpu.backend" in graph["aiogpu._core.hub"]
    assert len(graph) > 40


def test_cycle_detection_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph = import_graph()
    found = [" -> ".join(_a_cycle(graph, comp)) for comp in _cycles(graph)]
    assert not found, "module-level import cycles in aiogpu/:\n" + "\n".join(found)


# -- layers: what the core and the backends import ---------------------------------------------------
# What aiogpu/_core/ may import from the rest of the package, any import (in functions too: an
# import there is still a call up when it runs): the leaf modules below it, with why.
CORE_MAY_IMPORT = {
    "aiogpu.errors": "the exceptions it raises",
    "aiogpu.backend": "the hooks the hub calls (CompletionHooks)",
    "aiogpu._loops": "awaiters are woken through each event loop's port",
    "aiogpu.trace": "a completion is recorded when a trace is active",
    "aiogpu.kernels": "the built-in fill and copy kernels submission launches",
}


def _all_imports(path: Path, mod: str, mods: dict[str, Path]) -> set[str]:
    """The aiogpu modules ``path`` imports anywhere (functions and TYPE_CHECKING blocks too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, path, node.level, node.module)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t:
                out.add(t)
    return out


def test_the_core_imports_nothing_above_it():
    mods = _modules()
    bad = []
    used = set()
    for mod, path in sorted(mods.items()):
        if mod == "aiogpu._core" or mod.startswith("aiogpu._core."):
            for t in sorted(_all_imports(path, mod, mods)):
                used.add(t)
                if not (t.startswith("aiogpu._core") or t in CORE_MAY_IMPORT):
                    bad.append(f"{mod} imports {t}")
    assert not bad, "aiogpu/_core/ imports from above it:\n" + "\n".join(bad)
    assert not set(CORE_MAY_IMPORT) - used, f"allowed but no longer imported: {set(CORE_MAY_IMPORT) - used}"


def test_what_the_core_imports_is_below_it():
    """The modules of ``CORE_MAY_IMPORT`` import, when they are imported, nothing of aiogpu but
    one another (and the kernels' signature parser): the core does not reach above itself
    through them."""
    graph = import_graph()
    below = set(CORE_MAY_IMPORT) | {"aiogpu.signature"}
    bad = [f"{m} imports {t}" for m in sorted(below) for t in sorted(graph[m] - below)]
    assert not bad, "\n".join(bad)


def test_the_backends_do_not_import_each_other():
    mods = _modules()
    bad = []
    for mine, other in (("aiogpu.hsa", "aiogpu.cuda"), ("aiogpu.cuda", "aiogpu.hsa")):
        for mod, path in sorted(mods.items()):
            if mod == mine or mod.startswith(mine + "."):
                bad += [f"{mod} imports {t}" for t in sorted(_all_imports(path, mod, mods))
                        if t == other or t.startswith(other + ".")]
    assert not bad, "a backend imports the other:\n" + "\n".join(bad)


# -- calls go API -> core -> backend ---------------------------------------------------------------
BACKENDS = ("aiogpu/hsa", "aiogpu/cuda")

# The core's bookkeeping (aiogpu/_core/hub.py, futures.py, submit.py, hazards.py): what a backend
# must leave to the core. Names unique to the core count on any receiver; the others
# (``fail``, ``join``, ...) only on a receiver that names the hub or a core module.
BOOKKEEPING = {"new_future", "depend", "track", "_add_dependent", "_add_dep_signal", "_on_retired",
               "failed_without_running", "completed_future", "GPUFuture", "retire_failed",
               "_force_retire", "_unwatch", "_propagate", "_completed", "guarded", "encoded",
               "pick_lane", "failed_dependency", "_refused", "_withdraw"}
BOOKKEEPING_ON_CORE = {"watch", "fail", "discard", "_finish", "_retire", "join", "record", "failed",
                       "dependencies", "prune", "arm", "_submitted"}
_CORE_RECEIVERS = ("hub", "submit", "hazards", "deferred")

# (file, enclosing function, call) -> why it stays: empty, and a new call fails the test (the
# HSA queue's back-log learns of room from its own room marks, not from the core's futures).
ALLOWED_BOOKKEEPING: dict[tuple[str, str, str], str] = {}


def _receiver_is_core(func: ast.expr) -> bool:
    return isinstance(func, ast.Attribute) and any(r in ast.unparse(func.value) for r in _CORE_RECEIVERS)


def _on_self(func: ast.expr, names: tuple = ("self",)) -> bool:
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in names


def _hub_helper(node: ast.AST, scope: list[str]) -> bool:
    """A module-level function over a hub (its first parameter ``hub``, typed ``h`` where it
    is compiled): the body of a hub subclass's method, written as a function so that it
    compiles to a C call (cuda/lanehub.py)."""
    return not scope and isinstance(node, ast.FunctionDef) and bool(node.args.args) \
        and node.args.args[0].arg == "hub"


def _calls(path: Path):
    """(enclosing function's qualified name, called name, call node) for each call in ``path``,
    except a hub subclass's calls on itself, and its helpers' on their hub (the hub's own
    rules, run by its waiter)."""
    tree = ast.parse(path.read_text(), str(path))

    def walk(node: ast.AST, scope: list[str], hub: bool = False):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, scope + [child.name],
                                any("Hub" in ast.unparse(b) for b in child.bases))
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, scope + [child.name], "helper" if _hub_helper(child, scope) else hub)
                continue
            if isinstance(child, ast.Call) and not (
                    hub and _on_self(child.func, ("hub", "h") if hub == "helper" else ("self",))):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if name is not None:
                    yield ".".join(scope) or "<module>", name, child
            yield from walk(child, scope, hub)

    yield from walk(tree, [])


def backend_bookkeeping() -> dict[tuple[str, str, str], int]:
    """(file, function, call) -> the line of its first such call, for every bookkeeping call
    made under the backends."""
    found: dict[tuple[str, str, str], int] = {}
    for top in BACKENDS:
        for path in sorted((ROOT / top).rglob("*.py")):
            for where, name, call in _calls(path):
                if name in BOOKKEEPING or (name in BOOKKEEPING_ON_CORE and _receiver_is_core(call.func)):
                    found.setdefault((str(path.relative_to(ROOT)), where, name), call.lineno)
    return found


def test_backends_leave_bookkeeping_to_the_core():
    found = backend_bookkeeping()
    new = [f"{f}:{line} {where}: {name}()" for (f, where, name), line in sorted(found.items())
           if (f, where, name) not in ALLOWED_BOOKKEEPING]
    assert not new, ("a backend calls the core's bookkeeping (leave it to aiogpu/_core/submit.py; "
                     "see aiogpu/backend.py):\n" + "\n".join(new))


def test_the_bookkeeping_allowlist_is_current():
    """An allowlisted call that is gone leaves the list (so the list stays the debt that is left)."""
    found = backend_bookkeeping()
    stale = sorted(k for k in ALLOWED_BOOKKEEPING if k not in found)
    assert not stale, f"allowlisted but no longer made: {stale}"


# -- the hub's private fields ------------------------------------------------------------------------
# (file, function, attribute) -> why it stays: a private name of the hub used outside aiogpu/_core/
# by something other than a hub subclass on itself.
ALLOWED_HUB_PRIVATE: dict[tuple[str, str, str], str] = {}


def hub_private_names() -> set[str]:
    """The hub's private attributes: its ``_`` methods and the ``self._x`` fields it sets
    (aiogpu/_core/hub.py, classes Hub and FutureHub)."""
    tree = ast.parse((PKG / "_core" / "hub.py").read_text())
    names: set[str] = set()
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name in ("Hub", "FutureHub"):
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                    names.add(node.name)
                elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                      and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _names_a_hub(expr: ast.expr) -> bool:
    """``hub``, ``self.hub``, ``rt.hub``, ``self._hub``, ...: an expression that is a hub."""
    last = expr.attr if isinstance(expr, ast.Attribute) else expr.id if isinstance(expr, ast.Name) else ""
    return "hub" in last.lower()


def hub_private_uses() -> dict[tuple[str, str, str], int]:
    """(file, function, attribute) -> first line, for each use of a hub's private attribute
    outside aiogpu/_core/ (a hub subclass's uses of ``self`` excepted)."""
    private = hub_private_names()
    found: dict[tuple[str, str, str], int] = {}
    for path in sorted(PKG.rglob("*.py")):
        if path.is_relative_to(PKG / "_core"):
            continue
        tree = ast.parse(path.read_text(), str(path))

        def walk(node: ast.AST, scope: list[str]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    walk(child, scope + [child.name])
                    continue
                # (a hub subclass's ``self._x`` names no hub: not counted)
                if isinstance(child, ast.Attribute) and child.attr in private and _names_a_hub(child.value):
                    found.setdefault((str(path.relative_to(ROOT)), ".".join(scope) or "<module>", child.attr),
                                     child.lineno)
                walk(child, scope)

        walk(tree, [])
    return found


def test_hub_private_names_are_read_from_the_hub():
    names = hub_private_names()
    assert {"_pending", "_backlog", "_settle", "_retire"} <= names


def test_nothing_outside_the_core_touches_the_hubs_private_fields():
    new = [f"{f}:{line} {where}: .{name}" for (f, where, name), line in sorted(hub_private_uses().items())
           if (f, where, name) not in ALLOWED_HUB_PRIVATE]
    assert not new, ("the hub's private fields used outside aiogpu/_core/ (give the hub a read-only "
                     "property or a method for it):\n" + "\n".join(new))


def test_the_hub_private_allowlist_is_current():
    found = hub_private_uses()
    stale = sorted(k for k in ALLOWED_HUB_PRIVATE if k not in found)
    assert not stale, f"allowlisted but no longer used: {stale}"


# -- the core's stubs ----------------------------------------------------------------------------------
# Compiled, hub.py's Hub is an extension type joined to the hooks by FutureHub: its stub declares
# the two as one class, FutureHub.
STUB_CLASS = {"hub": {"Hub": "FutureHub"}, "futures": {}}


def _defs(path: Path) -> tuple[dict[str, set[str]], set[str], set[str]]:
    """A module's classes -> their methods; its top-level functions; its top-level assigned names."""
    tree = ast.parse(path.read_text(), str(path))
    classes: dict[str, set[str]] = {}
    functions: set[str] = set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    names.add(t.id)
    return classes, functions, names


def stub_differences(module: str) -> list[str]:
    """What ``aiogpu/_core/<module>.pyi`` lacks, or has beyond, of ``<module>.py``'s classes'
    methods and its top-level functions. A class the stub declares as a plain name (``X: Any``)
    has no methods to compare."""
    src_classes, src_functions, _ = _defs(PKG / "_core" / f"{module}.py")
    stub_classes, stub_functions, stub_names = _defs(PKG / "_core" / f"{module}.pyi")
    in_stub: dict[str, set[str]] = {}
    for cls, methods in src_classes.items():
        in_stub.setdefault(STUB_CLASS[module].get(cls, cls), set()).update(methods)
    out = []
    for cls, methods in sorted(in_stub.items()):
        if cls in stub_classes:
            out += [f"{cls}.{m} is not in {module}.pyi" for m in sorted(methods - stub_classes[cls])]
            out += [f"{cls}.{m} is in {module}.pyi, not in {module}.py"
                    for m in sorted(stub_classes[cls] - methods)]
        elif cls not in stub_names:
            out.append(f"class {cls} is not in {module}.pyi")
    out += [f"{f}() is not in {module}.pyi" for f in sorted(src_functions - stub_functions - stub_names)]
    return out


def test_stub_check_sees_a_missing_method():
    classes, _, _ = _defs(PKG / "_core" / "hub.py")
    assert "retry_backlog" in classes["Hub"]
    assert "retry_backlog" in _defs(PKG / "_core" / "hub.pyi")[0]["FutureHub"]


def test_the_core_stubs_declare_every_method():
    diffs = stub_differences("futures") + stub_differences("hub")
    assert not diffs, "the core's stubs and sources differ:\n" + "\n".join(diffs)
