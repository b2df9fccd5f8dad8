"""Which part of batchgen needs which transformers release, said by a refusal that names
it, never an ImportError (docs/models.md: "transformers releases").

CI runs this module and the model tests on the newest transformers the registry
serves and again on the oldest pyproject admits (Makefile: test-oldest).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import transformers

from batchgen import Engine
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.hf_backend import HfCausalLM
from batchgen.worker.models.hf_backend.qualify import BACKEND_RELEASE, check_release, release
from tests.family_parity import assert_matches_hf
from tests.model_zoo import VOCAB
from tests.releases import BACKEND_RUNS, INSTALLED

REPO = Path(__file__).resolve().parents[1]
# Falcon's attention modules call transformers' attention registry from this release
FALCON_IN_REGISTRY = (5, 25)
FALCONS = ["falcon", "falcon-new-decoder", "falcon-bias"]


def _refusal(path: Path, **settings) -> str:
    with pytest.raises(UnsupportedModelError) as err:
        Engine.from_pretrained(path, num_kv_blocks=8, **settings)
    return str(err.value)


def oldest_supported() -> str:
    """The lower bound of pyproject's transformers requirement."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(r"transformers\b", d)]
    bound = re.fullmatch(r"transformers>=([\d.]+)", spec)
    assert bound, spec
    return bound[1]


def test_ci_runs_the_oldest_release_pyproject_admits():
    makefile = (REPO / "Makefile").read_text()
    assert f"OLDEST_TRANSFORMERS ?= transformers=={oldest_supported()}" in makefile
    (test,) = re.findall(r"(?m)^test: (.*)$", makefile)  # what .ci/run runs
    assert "test-oldest" in test.split()


def test_a_release_older_than_the_backend_needs_is_refused_by_name():
    with pytest.raises(UnsupportedModelError) as err:
        check_release("5.17.0")
    assert str(err.value) == (
        "batchgen's transformers backend needs transformers 5.24 or later, and 5.17.0 is "
        "installed (pip install 'transformers>=5.24')"
    )
    for newer in ("5.24.0", "5.26.0.dev0", "6.0.0"):
        check_release(newer)
    assert release("5.26.0.dev0") == (5, 26) and BACKEND_RELEASE == (5, 24)


def test_the_installed_release_runs_the_native_engine_or_refuses_the_backend(zoo_model):
    """Llama runs natively on every release; GPT-J (backend only) runs through the backend
    where the release allows it, and is refused naming the release where it does not."""
    native = Engine.from_pretrained(zoo_model("llama"), num_kv_blocks=8)
    assert not isinstance(native.runner.model, HfCausalLM)
    if BACKEND_RUNS:
        backend = Engine.from_pretrained(zoo_model("gptj"), num_kv_blocks=8)
        assert isinstance(backend.runner.model, HfCausalLM)
    else:
        assert _refusal(zoo_model("gptj")) == (
            "batchgen's transformers backend needs transformers 5.24 or later, and "
            f"{transformers.__version__} is installed (pip install 'transformers>=5.24')"
        )


@pytest.mark.parametrize("name", FALCONS)
def test_falcon_runs_through_the_backend_where_its_attention_is_in_the_registry(zoo_model, name):
    path = zoo_model(name)
    if INSTALLED >= FALCON_IN_REGISTRY:
        assert isinstance(Engine.from_pretrained(path, num_kv_blocks=8).runner.model, HfCausalLM)
        assert_matches_hf(path, VOCAB)
    elif BACKEND_RUNS:
        assert _refusal(path) == (
            "transformers cannot build FalconForCausalLM with batchgen's attention (its "
            "attention does not go through transformers' attention registry)"
        )
    else:
        assert _refusal(path).startswith("batchgen's transformers backend needs transformers")
