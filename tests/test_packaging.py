"""The installed distribution claims only ``batchgen``; editable installs work."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import batchgen

REPO = Path(__file__).resolve().parents[1]
PARTS = {"worker": "batchgen/worker", "kernels": "batchgen/kernels", "jobs": "batchgen/jobs"}


def test_wheel_has_only_batchgen_at_the_top(tmp_path: Path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("batchgen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"batchgen", f"batchgen-{batchgen.__version__}.dist-info"}

    # every module of each part is in the wheel, under its batchgen.* name
    for folder, installed in PARTS.items():
        sources = sorted(p.relative_to(REPO / folder) for p in (REPO / folder).rglob("*.py"))
        assert sources, folder
        for rel in sources:
            assert f"{installed}/{rel.as_posix()}" in names, (folder, rel)

    entry_points = zipfile.ZipFile(wheel).read(
        f"batchgen-{batchgen.__version__}.dist-info/entry_points.txt"
    )
    assert b"batchgen = batchgen.cli:main" in entry_points
    # the dashboard's files ship in the package (it never loads anything from a CDN)
    static = REPO / "batchgen" / "serve" / "static"
    assert sorted(p.name for p in static.iterdir()) == ["app.js", "index.html", "login.html",
                                                        "style.css"]  # fmt: skip
    for path in static.iterdir():
        assert f"batchgen/serve/static/{path.name}" in names
        assert "http://" not in path.read_text() and "https://" not in path.read_text()
    # and the CPU path's C sources, which it compiles where it runs
    c_sources = sorted(p.name for p in (REPO / "kernels" / "cpu").glob("*.[ch]"))
    assert c_sources == ["bf16.h", "decode_attention.c", "elementwise.c", "exp8.h"]
    for name in c_sources:
        assert f"batchgen/kernels/cpu/{name}" in names


def test_editable_install_imports_from_the_repo(tmp_path: Path):
    code = (
        "import batchgen.worker.engine, batchgen.jobs.ops, batchgen.kernels.ops, os\n"
        "for m in (batchgen.worker.engine, batchgen.jobs.ops, batchgen.kernels.ops):\n"
        "    print(os.path.realpath(m.__file__))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [
        str(REPO / "worker" / "engine" / "__init__.py"),
        str(REPO / "jobs" / "ops" / "__init__.py"),
        str(REPO / "kernels" / "ops.py"),
    ]


def test_the_install_claims_no_generic_top_level_name(tmp_path: Path):
    """``worker``, ``jobs`` and ``kernels`` are not batchgen's to give: away from the
    checkout, an import of one finds another distribution's package, or nothing."""
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.find_spec(sys.argv[1])\n"
        "print(spec and (spec.origin or list(spec.submodule_search_locations)))\n"
    )
    for name in ("worker", "jobs", "kernels"):
        out = subprocess.run([sys.executable, "-c", code, name], cwd=tmp_path,
                             capture_output=True, text=True, check=True)  # fmt: skip
        assert str(REPO / name) not in out.stdout, name
        assert "site-packages" in out.stdout or out.stdout.strip() == "None", out.stdout


@pytest.mark.parametrize("part", ["jobs", "serve"])
def test_control_plane_imports_without_torch(tmp_path: Path, part: str):
    # jobs/ and serve/ must never import torch or the worker (docs/architecture.md)
    code = (
        f"import sys, pkgutil, importlib, batchgen.{part}\n"
        f"for m in pkgutil.walk_packages(batchgen.{part}.__path__, 'batchgen.{part}.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('batchgen.worker'))\n"
        "print(bad)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
