"""EngineConfig: one typed, checked set of engine settings for the Python API, the loop and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from batchgen.jobs.schema.errors import UsageError
from batchgen.worker.engine_config import EngineConfig
from batchgen.worker.loop.loop_config import LoopConfig
from batchgen.worker.worker_errors import InvalidEngineConfig


def test_from_pretrained_takes_the_config_fields_by_name(toy_model):
    from batchgen import Engine

    engine = Engine.from_pretrained(
        toy_model("llama"), device="cpu", block_size=32, num_kv_blocks=40, max_num_seqs=3,
        max_num_batched_tokens=100, max_model_len=512, enable_prefix_caching=False, seed=5,
    )  # fmt: skip
    limits = engine.limits
    assert (limits.block_size, limits.num_kv_blocks, limits.max_num_seqs) == (32, 40, 3)
    assert (limits.max_num_batched_tokens, limits.max_model_len) == (100, 512)
    assert engine.block_manager.enable_prefix_caching is False
    with pytest.raises(TypeError, match=r"unknown engine setting 'max_num_seq' .*'max_num_seqs'"):
        Engine.from_pretrained(toy_model("llama"), max_num_seq=3)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"block_size": 0}, "block_size must be an integer >= 1, got 0"),
        ({"max_num_seqs": True}, "max_num_seqs must be an integer >= 1, got True"),
        ({"num_kv_blocks": -4}, "num_kv_blocks must be an integer >= 1, got -4"),
        ({"max_model_len": 1.5}, "max_model_len must be an integer >= 1, got 1.5"),
        ({"dtype": "float64"}, "dtype must be one of float32, bfloat16, float16, got 'float64'"),
        ({"device": "gpu"}, "device must be cpu, cuda or cuda:N, got 'gpu'"),
        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization must be a fraction in (0, 1]"),
        ({"use_cuda_graphs": "no"}, "use_cuda_graphs must be true or false, got 'no'"),
        ({"seed": -1}, "seed must be an integer from 0 to 2**63 - 1, got -1"),
        ({"model_impl": "hf"}, "model_impl must be one of auto, native, transformers, got 'hf'"),
        ({"threads": 0}, "threads must be an integer >= 1, got 0"),
    ],
)
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises(InvalidEngineConfig) as err:
        EngineConfig(**settings)
    assert str(err.value).startswith(message)
    # a ValueError for Python callers, a one-line usage error for the CLI
    assert isinstance(err.value, ValueError) and isinstance(err.value, UsageError)


def test_the_loop_config_carries_the_engine_config_through_json():
    engine = EngineConfig(device="cuda:1", dtype="bfloat16", max_num_seqs=64, num_kv_blocks=900,
                          model_impl="transformers", threads=3)  # fmt: skip
    config = LoopConfig(model="m", name="w1", burst=True, engine=engine)
    data = json.loads(json.dumps(config.to_dict()))  # what a supervisor hands its children
    assert data["engine"]["max_num_seqs"] == 64
    again = LoopConfig.from_dict(data)
    assert again == config and again.engine == engine
    assert LoopConfig.from_dict(LoopConfig(model="m", name="w").to_dict()).engine == EngineConfig()


def test_the_engine_config_the_loop_and_the_worker_cli_import_without_torch():
    code = (
        "import sys\n"
        "import batchgen.worker.engine_config, batchgen.worker.loop, batchgen.worker.supervisor.supervisor\n"
        "import batchgen.cli.worker, batchgen.cli.run\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_worker_cli_refuses_a_bad_engine_setting_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "batchgen", "worker", "--model", "m", "--device", "cpu",
         "--max-num-seqs", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == "batchgen: error: max_num_seqs must be an integer >= 1, got 0\n"
