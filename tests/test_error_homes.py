"""Errors have one home per part: every exception class of batchgen, jobs/, worker/ and
kernels/ is defined in its part's errors module (HOMES), read from the source with ``ast``.

A class is an exception when a base resolves to one: a builtin exception, a class of the
tree that is one, or a name imported from a library (imported here to ask it).
"""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTS = {"batchgen": "batchgen", "jobs": "batchgen.jobs", "worker": "batchgen.worker",
         "kernels": "batchgen.kernels"}  # fmt: skip
# the CLI and serve's; jobs' (the Redis layer's apart: the engine, which imports
# jobs/schema, never loads redis); the worker's; the kernels'
HOMES = {"batchgen/interface_errors.py": "batchgen.interface_errors",
         "jobs/schema/errors.py": "batchgen.jobs.schema.errors",
         "jobs/redis/redis_errors.py": "batchgen.jobs.redis.redis_errors",
         "worker/worker_errors.py": "batchgen.worker.worker_errors",
         "kernels/kernel_errors.py": "batchgen.kernels.kernel_errors"}  # fmt: skip


def parsed_modules(root: Path) -> dict[str, ast.Module]:
    found = {}
    for folder, name in PARTS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = ast.parse(path.read_text())
    return found


class Resolver:
    """Answers whether a class defined in the tree is an exception."""

    def __init__(self, modules: dict[str, ast.Module]) -> None:
        self.modules = modules
        self.memo: dict[tuple[str, str], bool] = {}

    def imported(self, module: str) -> dict[str, str]:
        """Local name -> the dotted name it stands for."""
        names = {}
        package = module if self._is_package(module) else module.rpartition(".")[0]
        for node in ast.walk(self.modules[module]):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    names[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{base}.{alias.name}"
        return names

    def _is_package(self, module: str) -> bool:
        return any(other.startswith(module + ".") for other in self.modules)

    def is_exception(self, module: str, class_name: str) -> bool:
        key = (module, class_name)
        if key not in self.memo:
            self.memo[key] = False  # a base cycle is no exception
            node = next(n for n in self.modules[module].body
                        if isinstance(n, ast.ClassDef) and n.name == class_name)  # fmt: skip
            self.memo[key] = any(self.base_is_exception(module, b) for b in node.bases)
        return self.memo[key]

    def base_is_exception(self, module: str, base: ast.expr) -> bool:
        text = ast.unparse(base)
        head, _, rest = text.partition(".")
        local = {n.name for n in self.modules[module].body if isinstance(n, ast.ClassDef)}
        if not rest and head in local:
            return self.is_exception(module, head)
        dotted = self.imported(module).get(head)
        if dotted is None:
            found = getattr(builtins, text, None)
            return isinstance(found, type) and issubclass(found, BaseException)
        dotted = f"{dotted}.{rest}" if rest else dotted
        owner, _, name = dotted.rpartition(".")
        if owner in self.modules:
            return any(
                isinstance(n, ast.ClassDef) and n.name == name for n in self.modules[owner].body
            ) and self.is_exception(owner, name)
        if dotted.startswith("batchgen."):
            return False  # a module of the tree, not a class
        found = getattr(importlib.import_module(owner), name, None)
        return isinstance(found, type) and issubclass(found, BaseException)


def exception_classes(root: Path) -> list[tuple[str, str]]:
    modules = parsed_modules(root)
    resolver = Resolver(modules)
    return [
        (module, node.name)
        for module, tree in modules.items()
        for node in tree.body
        if isinstance(node, ast.ClassDef) and resolver.is_exception(module, node.name)
    ] + [  # classes inside functions and classes
        (module, f"{outer.name}.{node.name}")
        for module, tree in modules.items()
        for outer in ast.walk(tree)
        if isinstance(outer, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        for node in outer.body
        if isinstance(node, ast.ClassDef)
        and any(resolver.base_is_exception(module, b) for b in node.bases)
    ]


def test_every_exception_class_lives_in_its_parts_errors_module():
    outside = [f"{module}.{name}" for module, name in exception_classes(REPO)
               if module not in HOMES.values()]  # fmt: skip
    assert outside == []


def test_each_part_has_its_home_and_the_names_do_not_clash():
    found = exception_classes(REPO)
    assert {module for module, _ in found} == set(HOMES.values())
    names = [name for _, name in found]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


@pytest.mark.parametrize(
    "source",
    [
        "class Stray(ValueError):\n    pass\n",
        "import redis\n\nclass Stray(redis.ConnectionError):\n    pass\n",
        "from batchgen.jobs.schema.errors import UsageError\n\nclass Stray(UsageError):\n    pass\n",
        "def f():\n    class Stray(Exception):\n        pass\n",
    ],
)
def test_a_stray_exception_class_is_found(tmp_path, source):
    """The check finds a class outside the homes, whether its base is a builtin, a
    library's or the tree's own exception."""
    for folder in PARTS:
        (tmp_path / folder).mkdir()
    for home in HOMES:  # the homes, as they are
        (tmp_path / home).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / home).write_text((REPO / home).read_text())
    (tmp_path / "worker" / "stray.py").write_text(source)
    assert [(m, n.split(".")[-1]) for m, n in exception_classes(tmp_path)
            if m not in HOMES.values()] == [("batchgen.worker.stray", "Stray")]  # fmt: skip
