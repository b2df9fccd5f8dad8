"""The repository stands alone: no tracked file points at notes outside it.

A person who clones batchgen has the repo and nothing beside it; what its
readers need is in docs/ and the README."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# spelled in pieces so that this file does not match itself
OUTSIDE = ["../" + "shared", "DESIGN" + ".md", "HF-" + "FACTS", "REDIS-" + "FACTS", "STYLE" + ".md"]


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot tell which files are the project's")
    return [ROOT / name for name in out.stdout.decode().split("\0") if name]


def test_no_tracked_file_points_outside_the_repository():
    files = tracked_files()
    assert len(files) > 50, "git ls-files found almost nothing"
    found = []
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except (IsADirectoryError, FileNotFoundError):
            continue
        found += [f"{path.relative_to(ROOT)}: {word}" for word in OUTSIDE if word in text]
    assert found == []
