"""The package's structure, read from its sources (``ast``; nothing is imported or run).

- No import cycle inside ``aiogpu/``. The graph is built from *module-level* imports only: those
  that run when the module is first imported (its top-level statements, the bodies of its
  classes, of its top-level ``if``/``try``/``with``). Imports under ``if TYPE_CHECKING:`` and
  imports inside functions do not count: they run later, or never. An edge goes to the module
  named (``from . import x`` to ``x`` where ``x`` is a submodule, else to the package); the
  implicit import of a module's parent packages does not count (every submodule would
  otherwise "cycle" through ``aiogpu/__init__.py``, which imports the public API).
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
