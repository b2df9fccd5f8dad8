"""The fenced blocks of README.md and docs/*.md, for the tests that run them as written.

A block a reader could type or paste is fenced ``sh``, ``python``, ``jsonl`` or ``lark``
and named by the line just above it, ``<!-- block: NAME -->``; ``doc_block("NAME")``
returns it, and tests/test_docs.py fails for such a block that no test names. Anything
else (diagrams, synopses, printed output) is fenced ``text`` and is not run.

Tests run a block as written, in a shell whose PATH holds this venv's ``batchgen``, in a
directory holding the files the block names; ``replace`` may swap a host-specific value
(a port) for the test's, and each one must be in the block. A block that cannot run here
(it needs a GPU, Docker, the network or minutes) says how it is checked instead, in the
marker: ``<!-- block: NAME (arguments parsed: a benchmark takes minutes) -->``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKED = ("sh", "python", "jsonl", "lark")  # a reader runs these: a test must too
FREE = ("text",)  # diagrams, synopses, printed output
MARKER = re.compile(r"^<!-- block: ([a-z0-9-]+)(?: \(([^)]*)\))? -->$")
FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(slots=True, frozen=True)
class Block:
    name: str | None  # None: no marker above it
    lang: str
    text: str
    path: Path
    line: int  # 1-based line of the opening fence

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            assert not lines[i].lstrip().startswith("```"), f"{path}:{i + 1}: indented fence"
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{path}:{i + 1}: the block never closes"
        marker = MARKER.match(lines[i - 1]) if i else None
        text = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(marker[1] if marker else None, opened[1], text, path, i + 1))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in blocks_of(path)]


def doc_block(name: str) -> Block:
    found = [b for b in all_blocks() if b.name == name]
    assert len(found) == 1, f"{len(found)} blocks named {name!r} in README.md and docs/"
    return found[0]


def replaced(text: str, replace: dict[str, str]) -> str:
    """``text`` with host-specific values swapped for the test's; each must be there."""
    for old, new in replace.items():
        assert old in text, f"{old!r} is not in the block any more"
        text = text.replace(old, new)
    return text


def shell_env(home: Path, **extra: str) -> dict[str, str]:
    """A reader's shell with batchgen on PATH (as ``. .venv/bin/activate`` puts it) and the
    embedded Redis under ``home``; nothing of the test run's own batchgen or AWS settings."""
    # nor the make that may be running this suite (MAKELEVEL makes a nested make chatty)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BATCHGEN_", "AWS_", "VIRTUAL_ENV", "MAKE", "MFLAGS"))}  # fmt: skip
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(BATCHGEN_HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_sh(
    block: Block, cwd: Path, env: dict[str, str], replace: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Runs a ``sh`` block in one bash that stops at the first failing command."""
    assert block.lang == "sh", block.where
    script = replaced(block.text, replace or {})
    out = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert out.returncode == 0, f"{block.where} failed ({out.returncode}):\n{out.stderr[-3000:]}"
    return out


def start_sh(
    block: Block, cwd: Path, env: dict[str, str], log: Path, replace: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Starts a ``sh`` block of long-running commands (each line ends in ``&``) in a session
    of its own; ``stop`` ends everything it started."""
    assert block.lang == "sh", block.where
    script = replaced(block.text, replace or {})
    with log.open("ab") as out:
        return subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd,
                                env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def stop(proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """SIGTERM to the block's session (as a reader's Ctrl-C would reach it), SIGKILL if it lingers."""
    import signal
    import time

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc.poll()  # reap the block's own bash, or it stays in the group as a zombie
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
