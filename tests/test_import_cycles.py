"""No import cycles: the modules batchgen, jobs/, worker/ and kernels/ import as they load
form a graph without a cycle, read from the source with ``ast``.

An edge A -> B when A's module-level code (including under module-level ``if``, ``try``,
``with`` and class bodies) holds ``import B`` or ``from B import x`` (B's namespace is
read; B.x too, where x is a module). Imports inside functions run later and are left
out (where one is there to break a cycle, it says why), as are imports only for type
checkers (``if TYPE_CHECKING:``). The packages a dotted name passes through are not
counted: Python runs them first, but a package whose ``__init__`` imports nothing is
the ordinary layout, not a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INSTALLED = {"batchgen": "batchgen", "jobs": "batchgen.jobs", "worker": "batchgen.worker",
             "kernels": "batchgen.kernels"}  # fmt: skip


def modules(root: Path, installed: dict[str, str]) -> dict[str, tuple[Path, bool]]:
    """Module name -> (its file, whether it is a package's ``__init__``)."""
    found = {}
    for folder, name in installed.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            package = parts[-1] == "__init__"
            found[".".join([name, *(parts[:-1] if package else parts)])] = (path, package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def module_level_imports(body: list[ast.stmt]):
    """The import statements that run when the module is imported."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from module_level_imports(node.body)
            yield from module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from module_level_imports(block)
            for handler in node.handlers:
                yield from module_level_imports(handler.body)
        elif isinstance(node, ast.With | ast.ClassDef):
            yield from module_level_imports(node.body)


def import_graph(root: Path, installed: dict[str, str]) -> dict[str, set[str]]:
    found = modules(root, installed)
    graph: dict[str, set[str]] = {name: set() for name in found}
    for name, (path, package) in found.items():
        here = name if package else name.rpartition(".")[0]
        for node in module_level_imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            graph[name] |= {t for t in targets if t in found and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """Each strongly connected component of more than one module: its modules, and one
    cycle through the first of them (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return [(sorted(c), _cycle_through(graph, c)) for c in components]


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself."""
    first = min(component)
    came_from = {first: first}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), first]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle in {sorted(component)}")


def test_no_module_imports_itself_round_a_cycle():
    graph = import_graph(REPO, INSTALLED)
    assert len(graph) > 100
    found = [
        f"{len(members)} modules import each other ({', '.join(members)}), "
        f"as in {' -> '.join(cycle)}"
        for members, cycle in cycles(graph)
    ]
    assert found == []


def test_the_check_finds_a_cycle_and_skips_what_runs_later(tmp_path: Path):
    """The rules above, on a tree made for them: a real cycle is named; imports in a
    function or for type checkers, and the packages of a dotted name, make none."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from pkg.b import thing\n",
        "b.py": "import pkg.c\nthing = 1\n",
        "c.py": "try:\n    from . import a\nexcept ImportError:\n    pass\n",
        "lazy.py": "def f():\n    from pkg import late\n",
        "late.py": "import pkg.lazy\n",
        "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import hinted\n",
        "hinted.py": "from pkg import typed\n",
        "sub/__init__.py": "",
        "sub/leaf.py": "from pkg.sub import other\n",
        "sub/other.py": "import pkg.sub.leaf as leaf\n",
        "user.py": "from pkg.sub.other import leaf\n",
    }  # fmt: skip
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert graph["pkg.c"] == {"pkg", "pkg.a"}  # relative, under try
    assert graph["pkg.user"] == {"pkg.sub.other"}  # leaf is a name there, not a module
    assert sorted(cycles(graph)) == [
        (["pkg.a", "pkg.b", "pkg.c"], ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]),
        (["pkg.sub.leaf", "pkg.sub.other"], ["pkg.sub.leaf", "pkg.sub.other", "pkg.sub.leaf"]),
    ]
