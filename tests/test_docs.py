"""The README and docs/ hold together: every block a reader would run has a test, every
link and named file exists, the architecture table is the tree, and the pages stay short."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click
import pytest

from tests.doc_blocks import CHECKED, FREE, REPO, all_blocks, doc_files

DOCS = REPO / "docs"
PACKAGE_ROOTS = ("batchgen", "jobs", "worker", "kernels")
README_MAX_LINES = 250
PAGE_MAX_LINES = 350  # a page is read in one sitting


def test_every_block_says_what_it_is_and_runnable_ones_have_a_test():
    blocks = all_blocks()
    assert len(blocks) > 20
    unknown = [f"{b.where}: ```{b.lang}" for b in blocks if b.lang not in CHECKED + FREE]
    assert unknown == [], f"fence each block as one of {CHECKED + FREE}"
    unnamed = [b.where for b in blocks if b.lang in CHECKED and b.name is None]
    assert unnamed == [], "a runnable block needs <!-- block: NAME --> on the line above it"
    names = [b.name for b in blocks if b.name]
    assert len(names) == len(set(names)), "block names must be unique"

    # a test names the block: a string literal in a test module that reads blocks
    named: set[str] = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        if path.name == Path(__file__).name or "doc_block" not in path.read_text():
            continue
        tree = ast.parse(path.read_text())
        named |= {n.value for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)}  # fmt: skip
    assert sorted(set(names) - named) == [], "blocks that no test runs"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())
    return {slug(m[1]) for m in re.finditer(r"(?m)^#+ (.+)$", text)}


def test_every_relative_link_points_at_a_file_that_exists():
    broken = []
    for path in doc_files():
        text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(REPO)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


def test_every_page_is_in_the_readme_table_and_short():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    listed = sorted(re.findall(r"(?m)^\| \[([\w-]+\.md)\]\(docs/\1\) \|", readme))
    assert listed == pages
    long = [f"{p.name}: {n}" for p in DOCS.glob("*.md")
            if (n := len(p.read_text().splitlines())) > PAGE_MAX_LINES]  # fmt: skip
    assert long == []
    # the README's test command is what CI runs
    assert (REPO / ".ci" / "run").read_text().rstrip().splitlines()[-1] == "make test"
    assert "make test" in readme


def package_folders() -> set[str]:
    """Every folder with an ``__init__.py``, and the three parts, which hold none."""
    return set(PACKAGE_ROOTS) | {str(init.parent.relative_to(REPO)) for root in PACKAGE_ROOTS
                                 for init in (REPO / root).rglob("__init__.py")
                                 if "__pycache__" not in init.parts}  # fmt: skip


def architecture_table() -> list[tuple[str, str]]:
    text = (DOCS / "architecture.md").read_text()
    section = text.split("## The parts, folder by folder", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    return [(folder.strip("`").rstrip("/"), installed.strip("`")) for folder, installed, _ in cells]


def test_the_architecture_table_is_the_tree():
    rows = architecture_table()
    folders = [folder for folder, _ in rows]
    assert len(folders) == len(set(folders))
    assert set(folders) == package_folders(), "one row per package folder, no more"
    for folder, installed in rows:
        parts = folder.split("/")
        expected = ".".join(parts if parts[0] == "batchgen" else ["batchgen", *parts])
        assert installed == expected, folder


PATH_IN_TEXT = re.compile(
    r"`((?:batchgen|jobs|worker|kernels|tests|benchmarks|scripts|docs)/[\w./-]*)`"
)
DOTTED = re.compile(r"`((?:batchgen\.)?(?:jobs|worker|kernels|serve|cli)\.[\w.]+)`")


def test_every_file_and_module_the_docs_name_exists():
    import importlib

    missing = []
    for path in doc_files():
        text = path.read_text()
        for name in PATH_IN_TEXT.findall(text):
            if not (REPO / name.rstrip("/")).exists():
                missing.append(f"{path.relative_to(REPO)}: {name}")
        for dotted in DOTTED.findall(text):
            full = dotted if dotted.startswith("batchgen.") else f"batchgen.{dotted}"
            module, attrs = full, list[str]()
            while True:
                try:
                    obj: object = importlib.import_module(module)
                    break
                except ModuleNotFoundError:
                    module, _, attr = module.rpartition(".")
                    attrs.insert(0, attr)
            for attr in attrs:
                obj = getattr(obj, attr, None)
            if obj is None:
                missing.append(f"{path.relative_to(REPO)}: {dotted}")
    assert missing == []


def test_every_environment_variable_the_docs_name_is_declared():
    from batchgen.jobs.environment import VARIABLES

    declared = {v.name for v in VARIABLES}
    unknown = []
    for path in doc_files():
        for name in set(re.findall(r"BATCHGEN_[A-Z0-9_]+", path.read_text())):
            if name not in declared:
                unknown.append(f"{path.relative_to(REPO)}: {name}")
    assert unknown == []


def test_the_synopsis_names_only_flags_the_commands_have():
    from batchgen.cli import main

    (synopsis,) = [b for b in all_blocks() if b.path.name == "commands.md" and b.lang == "text"]
    commands: dict[str, set[str]] = {}
    current = ""
    for line in synopsis.text.splitlines():
        if line.startswith("batchgen "):
            current = line.split()[1]
        commands.setdefault(current, set()).update(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", line))
    assert set(commands) == {"submit", "worker", "status", "jobs", "download", "cancel",
                             "finalize", "retry", "delete", "cache", "run", "redis"}  # fmt: skip
    ctx = click.Context(main)
    for name, flags in commands.items():
        command = main.get_command(ctx, name)
        assert command is not None, name
        have = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
        if isinstance(command, click.Group):  # cache stats / cache clear
            have |= {opt for sub in command.commands.values() for p in sub.params
                     for opt in (*p.opts, *p.secondary_opts)}  # fmt: skip
        assert flags - have == set(), name


def test_every_page_a_tracked_file_names_exists():
    """Code comments and help texts point readers at docs/ pages too."""
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    missing = []
    for name in out.stdout.decode().split("\0"):
        path = REPO / name
        if not name or not path.is_file() or path.suffix not in (".py", ".md", ".toml", ""):
            continue
        for page in set(re.findall(r"docs/[\w-]+\.md", path.read_text(errors="replace"))):
            if not (REPO / page).exists():
                missing.append(f"{name}: {page}")
    assert missing == []


def test_the_readme_states_the_sampling_defaults_beside_the_first_job():
    """Where the first job is shown, the README says what a line without max_tokens or
    temperature gets: the values jobs/schema/sampling.py defines."""
    from batchgen.jobs.schema.sampling import DEFAULTS, default_max_tokens

    readme = (REPO / "README.md").read_text()
    first_job = readme.index("<!-- block: first-job -->")
    said = readme.index("A line without `max_tokens` gets", first_job)
    assert said < readme.index("<!-- block: workers -->")
    stated = " ".join(readme[said : readme.index("\n\n", said)].split())
    assert default_max_tokens(chat=True) is None and (
        "a chat line runs to the end of its answer (EOS, a stop string) or of the model's "
        "context" in stated
    )
    assert f"a prompt line gets {default_max_tokens(chat=False)} tokens" in stated
    assert DEFAULTS["temperature"] == 0 and "greedy (`temperature` 0)" in stated


def section(page: str, heading: str) -> str:
    """The text under ``## heading`` of docs/PAGE, up to the next ``##``, on one line."""
    text = (DOCS / page).read_text().split(f"\n## {heading}\n", 1)[1]
    return " ".join(text.split("\n## ", 1)[0].split())


def test_the_sizing_page_states_the_requests_a_worker_holds(toy_model):
    """A real engine's free room with nothing in it is what the page says a worker holds."""
    from batchgen.cli import main
    from batchgen.worker.engine.engine import Engine
    from batchgen.worker.engine_config import EngineConfig

    text = section("sizing.md", "Requests a worker holds")
    assert "up to `--max-num-seqs` + max(2, `--max-num-seqs` // 4) requests" in text
    assert "With the default 256 that is 256 + 64 = 320; two workers hold 640" in text
    worker = main.get_command(click.Context(main), "worker")
    assert worker is not None
    (max_num_seqs,) = [p for p in worker.params if p.name == "max_num_seqs"]
    assert max_num_seqs.default == 256
    assert "max(2, N // 4) more queued" in (max_num_seqs.help or "")
    for n, held in ((256, 320), (4, 6)):  # 4: the queue is at least 2
        engine = Engine.from_config(toy_model(), EngineConfig(device="cpu", max_num_seqs=n))
        assert engine.free_capacity() == held


def test_the_sizing_page_states_how_the_kv_cache_is_sized(toy_model):
    from batchgen.cli import main
    from batchgen.worker.engine.engine import Engine
    from batchgen.worker.engine.runner import kv_cache
    from batchgen.worker.engine_config import EngineConfig

    text = section("sizing.md", "The KV cache")
    config = EngineConfig()
    assert config.block_size == 16 and "blocks of 16 tokens" in text
    assert kv_cache.DEFAULT_CPU_KV_BYTES == 1 << 30 and "the pool is 1 GiB" in text
    assert config.gpu_memory_utilization == 0.9 and "0.9 of the GPU's memory" in text
    assert kv_cache.STEP_MARGIN_BYTES == 2 << 30 and "a 2 GiB margin" in text
    # the tiny toy's count is what a real engine on the default budget allocates
    engine = Engine.from_config(toy_model("qwen3"), EngineConfig(device="cpu"))
    assert engine.block_manager.num_blocks == 16384
    assert "64 KiB blocks make 16,384 blocks (262,144 tokens)" in text
    worker = main.get_command(click.Context(main), "worker")
    assert worker is not None
    (blocks,) = [p for p in worker.params if p.name == "num_kv_blocks"]
    said = " ".join((blocks.help or "").split())
    assert "blocks of 16 tokens" in said and "fit 1 GiB on CPU" in said
    assert "0.9 of the GPU's memory" in said and "a 2 GiB margin" in said


def test_the_sizing_page_states_how_threads_are_shared(monkeypatch):
    from batchgen.worker.cpu_threads import usable_cpus
    from batchgen.worker.supervisor.supervisor import plan_children

    text = section("sizing.md", "Workers and threads on a CPU")
    assert "`--workers` engine processes (default 1)" in text
    assert "`--threads N`: N each" in text
    assert "else `OMP_NUM_THREADS` from your environment, as you set it" in text
    assert "else the usable CPUs ÷ `--workers`, rounded down, at least 1" in text
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert len(plan_children(None, "cpu", None)) == 1
    cpus = usable_cpus()
    for workers in (1, 2, cpus + 1):
        share = str(max(1, cpus // workers))
        plan = plan_children(None, "cpu", workers)
        assert [c["env"]["OMP_NUM_THREADS"] for c in plan] == [share] * workers
    assert plan_children(None, "cpu", 2, 3)[1]["env"]["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the children inherit it
    assert "OMP_NUM_THREADS" not in plan_children(None, "cpu", 2)[0]["env"]


def test_the_gpu_section_names_the_cuda_of_the_makefiles_torch():
    makefile = (REPO / "Makefile").read_text()
    found = re.search(r'TORCH="torch==([\d.]+) --index-url \S+/whl/cu(\d+)(\d)"', makefile)
    assert found is not None
    version, major, minor = found.groups()
    text = section("install.md", "On a GPU machine")
    index = f"https://download.pytorch.org/whl/cu{major}{minor}"
    assert f'TORCH="torch=={version} --index-url {index}"' in text
    assert f"torch's `cu{major}{minor}` wheels are built with CUDA {major}.{minor}" in text
    assert f"the driver NVIDIA's CUDA Toolkit Release Notes list for CUDA {major}.{minor}" in text
    assert f"any CUDA {major}.x application" in text
    assert f"prints `{major}.{minor} True`" in text


def test_every_command_in_the_commands_table_is_one_short_sentence_with_a_link():
    text = (DOCS / "commands.md").read_text()
    table = text.split("| command | what it does |\n| --- | --- |\n", 1)[1].split("\n\n", 1)[0]
    cells = [row.strip("|").split(" | ")[1].strip() for row in table.splitlines()]
    assert len(cells) == 13
    heads = anchors(DOCS / "commands.md")
    for cell in cells:
        assert len(cell) <= 160 and cell.endswith(".") and ". " not in cell, cell
        links = re.findall(r"\]\(([^)]+)\)", cell)
        inside = [link[1:] for link in links if link.startswith("#")]
        assert links and all(anchor in heads for anchor in inside), cell


def test_make_test_compiles_the_kernels_under_the_gpu_machines_triton_that_kernels_md_names():
    """The torch pin first (its wheel from local disk), then the pinned Triton; the test
    file run in that venv with the pin as EXPECT_TRITON; kernels.md names that pin."""
    import subprocess

    plan = subprocess.run(["make", "-n", "-B", "test"], cwd=REPO, capture_output=True, text=True, check=True).stdout  # fmt: skip
    venv = ".venv-gpu-triton/bin/python"
    torch_at = plan.index(f"\n{venv} -m pip install -q torch==")
    pin = re.search(rf"\n{venv} -m pip install -q 'triton==([\d.]+)'", plan)
    assert pin is not None and torch_at < pin.start()
    run = plan.split(f"\nPYTHONPATH={REPO} EXPECT_TRITON={pin[1]} {venv} ", 1)[1]
    assert " ".join(run.split("\n", 2)[:2]).endswith("--noconftest -p no:cacheprovider tests/test_kernels_compile.py")  # fmt: skip
    assert f"`triton=={pin[1]}`, the lent GPU machines'" in section(
        "kernels.md", "How they are tested"
    )
