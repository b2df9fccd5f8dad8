"""Comments and docstrings name only files that exist: a file moved or folded into
another leaves no pointer to where it used to be (test_docs.py checks docs/*.md)."""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

from batchgen.parts import PARTS

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("batchgen", "jobs", "worker", "kernels", "tests", "benchmarks", "scripts")
ANYWHERE = ("tests", "benchmarks", "scripts")  # they name files of every part by bare name
# a file name with one of these endings, after a path of folders or none; not part of a
# longer name, a dotted module name or a URL (URLs are removed before the search)
REFERENCE = re.compile(
    r"(?<![\w./*{}<>$-])((?:\.{1,2}/)?(?:[\w-]+/)*[\w-]+\.(?:py|md|lua|c))(?![\w/])"
)
URL = re.compile(r"[a-z][\w+.-]*://\S+")
# Files outside this repository that comments name on purpose, each with its reason.
ELSEWHERE: dict[str, str] = {}
Documented = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def repo_files() -> set[str]:
    """The repository's files, relative to its root: tracked ones and new ones git does not
    ignore (never a virtual environment's or a build's)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=REPO, capture_output=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):  # an unpacked sdist: walk the tree
        skip = {"build", "dist", "__pycache__"}
        return {str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file() and not any(
            part.startswith(".") or part in skip for part in p.relative_to(REPO).parts)}  # fmt: skip
    return {name for name in out.decode().split("\0") if name and (REPO / name).is_file()}


def comments_and_docstrings(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment and docstring of a Python file."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in documented(ast.parse(source)):
        doc = ast.get_docstring(node, clean=False)
        if doc is not None:
            first = node.body[0].lineno
            for offset, line in enumerate(doc.splitlines()):
                yield first + offset, line


def documented(node: ast.AST) -> Iterator[Documented]:
    """The module and every class and function in it, however nested (statements only:
    a docstring is never inside an expression; ast.walk takes several times longer)."""
    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        yield node
    for name in ("body", "orelse", "finalbody", "handlers", "cases"):
        for child in getattr(node, name, ()):
            if isinstance(child, ast.stmt | ast.excepthandler | ast.match_case):
                yield from documented(child)


def resolves(ref: str, where: str, files: set[str]) -> bool:
    """Whether ``ref``, named in the file ``where``, is a file of the repository.

    A path is one from the root, from the naming file's folder or from its part's
    (``ops/<file>.py`` written in jobs/), and ``batchgen/<part>/...`` is ``<part>/...``.
    A bare name is a file of the naming file's part or of the root; the tests,
    benchmarks and scripts name any part's files by bare name. (Any file's name would
    not do: comments in jobs/ called the result cache ``cache.py``, and since
    batchgen/cli/ has a ``cache.py`` they never failed.)"""
    if ref.startswith(tuple(f"batchgen/{part}/" for part in PARTS)):
        ref = ref.removeprefix("batchgen/")
    part = where.split("/", 1)[0]
    if "/" not in ref:
        return any(os.path.basename(f) == ref and (
            part in ANYWHERE or "/" not in f or f.startswith(f"{part}/")) for f in files)  # fmt: skip
    bases = {"", os.path.dirname(where), part}
    return any(os.path.normpath(os.path.join(base, ref)) in files for base in bases)


def stale_references() -> list[str]:
    files = repo_files()
    stale = []
    for name in sorted(files):
        if name.endswith(".py") and name.split("/", 1)[0] in SCANNED:
            for line, text in comments_and_docstrings(REPO / name):
                for ref in REFERENCE.findall(URL.sub("", text)):
                    if ref not in ELSEWHERE and not resolves(ref, name, files):
                        stale.append(f"{name}:{line}: {ref}")
    return stale


def test_every_file_a_comment_or_docstring_names_exists():
    files = repo_files()
    assert [ref for ref in ELSEWHERE if Path(ref).name in {Path(f).name for f in files}] == []
    stale = stale_references()
    assert stale == [], "point each at the file that now holds it, or reword:\n" + "\n".join(stale)


def test_the_search_finds_the_references_it_is_for():
    """The patterns the test relies on: what counts as a reference, and how one resolves."""
    found = REFERENCE.findall(URL.sub("", "see ``ops/backlog.py``, runner.py's loop, "
                                           "docs/fleet.md#peers, x.lua and foo.c; not test_*.py, "
                                           "https://example.com/a/setup.py, batchgen.jobs.py_x, "
                                           "a.pyc, {name}.py or records.pyi"))  # fmt: skip
    assert found == ["ops/backlog.py", "runner.py", "docs/fleet.md", "x.lua", "foo.c"]
    files = {"jobs/ops/backlog.py", "worker/loop/queue.py", "batchgen/cli/cache.py", "setup.py"}
    assert resolves("ops/backlog.py", "jobs/consumer/dispatch.py", files)
    assert resolves("../ops/backlog.py", "jobs/consumer/dispatch.py", files)
    assert resolves("batchgen/worker/loop/queue.py", "tests/test_x.py", files)
    assert resolves("backlog.py", "jobs/consumer/dispatch.py", files)
    assert resolves("backlog.py", "tests/test_x.py", files)
    assert resolves("setup.py", "worker/loop/queue.py", files)
    assert not resolves("ops/backlog.py", "worker/loop/queue.py", files)
    assert not resolves("runner.py", "worker/loop/queue.py", files)
    assert not resolves("cache.py", "jobs/ops/job_record.py", files)  # batchgen's, not jobs'
    assert resolves("cache.py", "batchgen/cli/run.py", files)
