"""The tree shows the architecture: each folder imports only the parts below it.

Checked on the source (every import statement, lazy ones inside functions
included; imports only for type checkers are left out), so a forbidden import
fails here even on a path no other test runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INSTALLED = {"jobs": "batchgen.jobs", "worker": "batchgen.worker", "kernels": "batchgen.kernels",
             "batchgen": "batchgen"}  # fmt: skip

# part -> the parts of batchgen it may import (besides itself); "*" = any
MAY_IMPORT: dict[str, set[str]] = {
    "jobs.schema": set(),
    "jobs.backoff": set(),
    "jobs.environment": {"jobs.schema"},
    "jobs.redis": {"jobs.schema", "jobs.backoff", "jobs.environment"},
    "jobs.storage": {"jobs.schema", "jobs.redis", "jobs.environment"},
    "jobs.intake": {"jobs.schema", "jobs.storage", "jobs.environment"},
    "jobs.crashpoints": {"jobs.environment"},
    "jobs.ops": {
        "jobs.schema",
        "jobs.redis",
        "jobs.storage",
        "jobs.intake",
        "jobs.crashpoints",
        "jobs.backoff",
        "jobs.environment",
    },
    "kernels": set(),
    "worker.worker_errors": {"jobs.schema"},
    "worker.models": {"kernels", "jobs.schema", "worker.worker_errors"},
    "worker.engine_config": {"jobs.schema", "worker.worker_errors"},
    "worker.cpu_threads": set(),
    "worker.engine": {
        "openmp_waits",
        "kernels",
        "worker.models",
        "worker.engine_config",
        "worker.cpu_threads",
        "worker.worker_errors",
        "jobs.schema",
        "parts",  # a tensor-parallel engine starts its other ranks as batchgen processes
    },
    "worker.consumer": {
        "jobs.schema",
        "jobs.redis",
        "jobs.storage",
        "jobs.ops",
        "jobs.crashpoints",
        "jobs.backoff",
    },
    "worker.loop": {
        "worker.engine_config",
        "worker.worker_errors",
        "worker.cpu_threads",
        "worker.engine",
        "jobs.schema",
        "jobs.redis",
        "jobs.storage",
        "jobs.ops",
        "worker.consumer",
        "jobs.backoff",
        "parts",
        "openmp_waits",
    },
    "worker.supervisor": {
        "worker.loop",
        "worker.engine_config",
        "worker.worker_errors",
        "worker.cpu_threads",
        "worker.engine",
        "jobs.schema",
        "jobs.redis",
        "jobs.storage",
        "jobs.ops",
        "worker.consumer",
        "jobs.backoff",
        "parts",
        "openmp_waits",
    },
    "serve": {
        "interface_errors",
        "jobs.schema",
        "jobs.redis",
        "jobs.storage",
        "jobs.intake",
        "jobs.ops",
        "jobs.crashpoints",
        "jobs.backoff",
        "jobs.environment",
    },
    "interface_errors": set(),
    "toy": set(),
    "cli": {"*"},
    "parts": set(),
    "openmp_waits": set(),
    "__init__": {"parts", "openmp_waits"},
    "__main__": {"cli"},
}
# third-party packages a part must never import
NEVER: dict[str, set[str]] = {
    "jobs": {"torch", "triton", "transformers"},
    "serve": {"torch", "triton", "transformers"},
    "jobs.schema": {"redis", "rq"},
    "worker.consumer": {"torch", "triton", "transformers"},
    "worker.engine": {"redis", "rq"},
    "worker.models": {"redis", "rq"},
    "worker.engine_config": {"redis", "rq", "torch"},
    "worker.worker_errors": {"redis", "rq", "torch"},
    "worker.cpu_threads": {"redis", "rq", "torch"},
    "kernels": {"redis", "rq", "transformers"},
}


def part_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] in (["batchgen", "jobs"], ["batchgen", "worker"]) and len(parts) > 2:
        return f"{parts[1]}.{parts[2]}"
    if parts[:2] == ["batchgen", "kernels"]:
        return "kernels"
    return parts[1] if len(parts) > 1 else "__init__"


def modules() -> dict[str, Path]:
    found = {}
    for folder, name in INSTALLED.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("")
            found[".".join([name, *rel.parts])] = path
    return found


def runtime_imports(path: Path) -> set[str]:
    """Every module an import statement names, outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for b in node.body for n in ast.walk(b)}  # fmt: skip
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_every_part_imports_only_the_parts_below_it():
    found = modules()
    assert len(found) > 100
    wrong = []
    for module, path in sorted(found.items()):
        part = part_of(module)
        assert part in MAY_IMPORT, f"{module}: part {part!r} has no row in MAY_IMPORT"
        allowed = MAY_IMPORT[part]
        never = set().union(*(v for k, v in NEVER.items() if part == k or part.startswith(k + ".")))
        for name in runtime_imports(path):
            top = name.split(".")[0]
            if top in never:
                wrong.append(f"{path.relative_to(REPO)} imports {name}")
            if (top == "batchgen" and name in found) or name in (
                "batchgen.jobs",
                "batchgen.worker",
            ):
                other = part_of(name)
                if other != part and "*" not in allowed and other not in allowed:
                    wrong.append(f"{path.relative_to(REPO)} ({part}) imports {name} ({other})")
    assert wrong == []


def test_the_engine_never_imports_redis():
    """Loading every module of the engine, its models and kernels loads no Redis client."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import batchgen.worker.engine, batchgen.worker.models, batchgen.kernels\n"
        "for pkg in (batchgen.worker.engine, batchgen.worker.models):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "importlib.import_module('batchgen.kernels.cpu.attention')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'rq')\n"
        "             or m.startswith(('batchgen.jobs.redis', 'batchgen.worker.consumer',\n"
        "                              'batchgen.worker.loop'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO / "tests", capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


def test_no_file_name_is_used_twice():
    """A name says what a file is: four files named config say nothing."""
    names = Counter(
        p.name for p in modules().values() if p.name not in ("__init__.py", "__main__.py")
    )
    assert [name for name, n in names.items() if n > 1] == []


MAX_MODULES_PER_FOLDER = 15  # a folder is read in one screen; split it by concept past that


def test_no_folder_holds_more_than_fifteen_modules():
    """Counted as the tidy-ups count: a folder's *.py files but its ``__init__.py``."""
    folders = Counter(
        path.parent.relative_to(REPO).as_posix()
        for path in modules().values()
        if path.name != "__init__.py"
    )
    assert {f: n for f, n in folders.items() if n > MAX_MODULES_PER_FOLDER} == {}
