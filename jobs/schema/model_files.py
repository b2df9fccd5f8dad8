"""Whether ``--model`` names a checkpoint directory batchgen could load, without loading it.

Torch-free, so ``submit`` asks before anything is queued and ``worker`` before it
starts an engine process; the engine itself asks again when it loads
(worker/engine/runner/loading.py) and then reads the config with the model code, which
alone knows the architectures it runs. What this checks is what a directory as
transformers' ``save_pretrained`` writes it holds: ``config.json`` (a JSON
object), a tokenizer, and safetensors weights (one file, or shards and their
index). batchgen downloads nothing, so a Hugging Face hub id is refused with
what to do instead.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

from batchgen.jobs.schema.errors import ModelNotLoadable

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# any one of these is a tokenizer transformers can load (vocab.json: with merges.txt)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def check_checkpoint(model: str | os.PathLike[str]) -> Path:
    """The checkpoint directory ``model`` names; ModelNotLoadable (one line: what is
    wrong and what to do) when it is not one batchgen could load."""
    path = check_config(model)
    check_files(model, path)
    return path


def check_config(model: str | os.PathLike[str]) -> Path:
    """The directory ``model`` names, when it holds a readable ``config.json`` (the
    engine reads it, and refuses what the config alone rules out, before the files)."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotLoadable(_missing(str(model), path))
    if not path.is_dir():
        raise ModelNotLoadable(f"model path {model} is not a directory (a checkpoint is one)")
    config = path / "config.json"
    if not config.is_file():
        raise ModelNotLoadable(
            f"{model} has no config.json: not a checkpoint directory (one as transformers' "
            "save_pretrained writes it: config.json, tokenizer files, safetensors weights)"
        )
    try:
        value = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelNotLoadable(f"cannot read {config}: {exc}") from None
    if not isinstance(value, dict):
        raise ModelNotLoadable(f"{config} is not a JSON object")
    return path


def check_files(model: str | os.PathLike[str], path: Path) -> None:
    """A tokenizer and safetensors weights in checkpoint directory ``path``."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelNotLoadable(
            f"{model} has no tokenizer ({', '.join(TOKENIZER_FILES)}); save it beside the "
            "weights with tokenizer.save_pretrained(dir)"
        )
    weight_files(path)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, from its index when sharded."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / str(name) for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelNotLoadable(f"cannot read {index}: {exc}") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotLoadable(
                f"{path} is missing shard(s) named in its index: {', '.join(missing)}"
            )
        return files
    single = path / SINGLE
    if single.is_file():
        return [single]
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ModelNotLoadable(
            f"{path} holds PyTorch .bin weights; batchgen reads only safetensors "
            "(convert with transformers: model.save_pretrained(dir))"
        )
    raise ModelNotLoadable(f"{path} has no {SINGLE} or {INDEX}")


def _missing(model: str, path: Path) -> str:
    """What to say about a model that is not there: a typo's likely fix, or for a name
    that is no path (a hub id) where batchgen wants it."""
    parent = path.parent if str(path.parent) else Path(".")
    hint = ""
    if parent.is_dir():
        try:
            names = [e.name for e in parent.iterdir() if e.is_dir()]
        except OSError:
            names = []
        close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.5)
        if close:
            hint = f" (did you mean {os.path.join(os.path.dirname(model), close[0])}?)"
    if model.startswith(("/", "./", "../", "~")) or hint:
        return f"model path {model} does not exist{hint}"
    return (
        f"model {model!r} is not a directory here, and batchgen downloads nothing: put the "
        f"checkpoint in a directory (`hf download {model} --local-dir DIR`, say: the `hf` command comes with transformers) "
        "and pass --model DIR"
    )
