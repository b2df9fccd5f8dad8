"""A checkpoint loads only if every tensor and every config switch is accounted for.

A tensor no family code reads, or a config switch the native implementation
does not honour, would run a model that differs from transformers without a
word; each is refused by name instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from batchgen import Engine
from batchgen.worker.models import UnsupportedModelError


def _copy(zoo_model, tmp_path, name="llama"):
    out = tmp_path / name
    shutil.copytree(zoo_model(name), out)
    return out


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_a_tensor_no_code_reads_is_refused_by_name(zoo_model, tmp_path):
    path = _copy(zoo_model, tmp_path)
    tensors = load_file(path / "model.safetensors")
    # an o_proj bias in a checkpoint whose config says attention_bias false
    tensors["model.layers.1.self_attn.o_proj.bias"] = tensors["model.norm.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.self_attn\.o_proj\.bias"):
        Engine.from_pretrained(path, num_kv_blocks=8)


def test_a_switch_nobody_reads_is_refused_by_name(zoo_model, tmp_path):
    path = _copy(zoo_model, tmp_path)
    _edit_config(path, attention_sink_tokens=4)
    with pytest.raises(UnsupportedModelError, match=r"sets attention_sink_tokens, which"):
        Engine.from_pretrained(path, num_kv_blocks=8, model_impl="native")
    # auto: transformers' own Llama, which reads no such key either, runs it (the backend)


def test_a_switch_llama_code_does_not_have_is_refused(zoo_model, tmp_path):
    """transformers' Llama has no sliding window: a config asking for one is not what it runs."""
    path = _copy(zoo_model, tmp_path)
    _edit_config(path, sliding_window=8)
    with pytest.raises(UnsupportedModelError, match=r"sets sliding_window"):
        Engine.from_pretrained(path, num_kv_blocks=8)


def test_a_switch_value_the_family_cannot_run_is_refused(zoo_model, tmp_path):
    path = _copy(zoo_model, tmp_path)
    _edit_config(path, hidden_act="xielu")
    with pytest.raises(UnsupportedModelError, match=r"hidden_act='xielu' is not supported"):
        Engine.from_pretrained(path, num_kv_blocks=8)


def test_null_switches_and_bookkeeping_keys_load(zoo_model, tmp_path):
    path = _copy(zoo_model, tmp_path)
    _edit_config(path, sliding_window=None, rope_scaling=None, initializer_range=0.5,
                 auto_map={"AutoModelForCausalLM": "x.Y"})  # fmt: skip
    Engine.from_pretrained(path, num_kv_blocks=8)


def test_a_qwen2_5_config_with_its_window_switched_off_loads_without_windows(zoo_model, tmp_path):
    """Qwen2.5 ships sliding_window 32768 with use_sliding_window false: transformers
    attends to everything, and so does batchgen (the keys are read, not refused)."""
    path = _copy(zoo_model, tmp_path, "qwen2")
    _edit_config(path, use_sliding_window=False, sliding_window=32768, max_window_layers=28,
                 layer_types=None)  # fmt: skip
    engine = Engine.from_pretrained(path, num_kv_blocks=8)
    assert engine.runner.model.config.windows == (None, None, None)


def test_the_docs_and_readme_name_every_native_architecture_and_only_those():
    """docs/models.md's "native" rows and the README's count are the registry's families."""
    import re

    from batchgen.worker.models.registry import native_architectures

    repo = Path(__file__).resolve().parents[1]
    rows = [line for line in (repo / "docs" / "models.md").read_text().splitlines()
            if line.startswith("| ") and "| native" in line]  # fmt: skip
    documented = sorted(
        {
            name
            for row in rows
            for name in re.findall(r"\b\w+ForCausalLM\b|GPT2LMHeadModel", row.split("|")[1])
        }
    )
    assert documented == native_architectures()
    count = re.search(r"(\d+)\s+architectures run on batchgen's own decoder",
                      " ".join((repo / "README.md").read_text().split()))  # fmt: skip
    assert count is not None and int(count.group(1)) == len(native_architectures())
