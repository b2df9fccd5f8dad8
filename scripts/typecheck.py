"""``make typecheck``: mypy over the package as it installs, with real paths in its report.

``jobs/``, ``worker/`` and ``kernels/`` install as ``batchgen.jobs`` and so on
(setup.py's package-dir mapping), which mypy cannot follow from the source tree.
So the package is installed, as a wheel lays it out, into ``build/typecheck``
(about a second), mypy checks that copy with the tests, and every path it reports
is mapped back to the file in the repository.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "build" / "typecheck"
_COPY = re.compile(r"build/typecheck/batchgen/(?:(jobs|worker|kernels)/)?")


def real_path(line: str) -> str:
    """``build/typecheck/batchgen/jobs/<file>.py:3: ...`` -> ``jobs/<file>.py:3: ...``."""
    return _COPY.sub(lambda m: f"{m.group(1)}/" if m.group(1) else "batchgen/", line)


def main() -> int:
    shutil.rmtree(TREE, ignore_errors=True)
    # setuptools builds in build/lib and never removes a module deleted since: start clean
    shutil.rmtree(REPO / "build" / "lib", ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-qq", "--no-deps", "--no-build-isolation",
         "--no-compile", "--target", str(TREE), str(REPO)],
        check=True,
    )  # fmt: skip
    shutil.rmtree(TREE / "bin", ignore_errors=True)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", *sys.argv[1:]], cwd=REPO, capture_output=True, text=True
    )
    for line in (out.stdout + out.stderr).splitlines():
        print(real_path(line))
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())
