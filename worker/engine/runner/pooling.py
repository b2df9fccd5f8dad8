"""Embeddings: how a checkpoint pools its final hidden states, and the pooling itself.

A sentence-transformers checkpoint says how in ``modules.json`` (a Pooling
module whose folder's ``config.json`` picks mean, CLS or last token; a
Normalize module means L2-normalize). Without one: the last token's final
hidden state (after the final norm, HF's ``last_hidden_state``), L2-normalized.

An embedding request is computed chunk by chunk like any prefill; each step
folds its chunk's rows into the request's running state (a sum for mean, the
first row for CLS, the last row for last token), so nothing is kept per token.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchgen.worker.engine.request import EngineRequest

_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_OTHER_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_ST = "sentence_transformers.models."


class PoolingMode(str, enum.Enum):
    MEAN = "mean"  # every prompt position, averaged
    CLS = "cls"  # the first position
    LAST = "last"  # the last position


@dataclass(frozen=True, slots=True)
class Pooling:
    """How this checkpoint embeds; ``unsupported`` says why it cannot (else None)."""

    mode: PoolingMode = PoolingMode.LAST
    normalize: bool = True
    source: str = "default"  # or the modules.json path it came from
    unsupported: str | None = None

    @property
    def reads_prefix_cache(self) -> bool:
        """Only last-token pooling may skip cached head blocks: it needs the
        last position alone, and the prefix cache never covers that one."""
        return self.mode is PoolingMode.LAST


def load_pooling(root: Path) -> Pooling:
    """The checkpoint's sentence-transformers pooling, else the default.

    A config we cannot follow (another pooling mode, a Dense layer, bad JSON)
    does not stop the model loading: its embedding requests are refused with
    ``unsupported`` as the reason, generation runs as usual.
    """
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return Pooling()
    source = str(modules_file)
    try:
        modules = json.loads(modules_file.read_text())
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ValueError("expected a list of module objects")
        kinds = [str(m.get("type", "")) for m in modules]
        unknown = [k for k in kinds if k.removeprefix(_ST) not in _KNOWN_MODULES]
        if unknown:
            raise ValueError(f"module {unknown[0]!r} is not supported (only {_KNOWN_LIST})")
        pooling = [m for m in modules if str(m.get("type", "")).endswith("Pooling")]
        if len(pooling) != 1:
            raise ValueError(f"expected one Pooling module, found {len(pooling)}")
        config_file = root / str(pooling[0].get("path", "")) / "config.json"
        config: dict[str, Any] = json.loads(config_file.read_text())
        mode = _mode(config)
    except (OSError, ValueError) as exc:
        return Pooling(source=source, unsupported=f"{source}: {exc}")
    normalize = any(k.endswith("Normalize") for k in kinds)
    return Pooling(mode=mode, normalize=normalize, source=source)


_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")
_KNOWN_LIST = ", ".join(_KNOWN_MODULES)


def _mode(config: dict[str, Any]) -> PoolingMode:
    other = [k for k in _OTHER_MODES if config.get(k)]
    if other:
        raise ValueError(f"{other[0]} is not supported (mean, CLS or last token only)")
    chosen = [mode for key, mode in _MODES.items() if config.get(key)]
    if len(chosen) != 1:
        raise ValueError(f"expected exactly one pooling mode, found {len(chosen)}")
    return PoolingMode(chosen[0])


@dataclass(slots=True)
class EmbedSpan:
    """One embedding request's rows in a step: hidden rows [row, row + n) hold
    its positions [start, start + n)."""

    request: EngineRequest
    row: int
    start: int
    n: int


def pool_step(pooling: Pooling, hidden: torch.Tensor, spans: list[EmbedSpan]) -> None:
    """Folds each span's rows into its request's running state; a request whose
    prompt this step completes gets its vector (``request.embed.vector``)."""
    for span in spans:
        task = span.request.embed
        assert task is not None
        end = span.start + span.n
        rows = hidden[span.row : span.row + span.n]
        if pooling.mode is PoolingMode.MEAN:
            part = rows.float().sum(dim=0)
            task.state = part if task.state is None else task.state + part
        elif pooling.mode is PoolingMode.CLS:
            if span.start == 0:  # a copy: a view would keep the step's hidden states
                task.state = rows[0].to(torch.float32, copy=True)
        elif end == span.request.num_prompt_tokens:
            task.state = rows[-1].float()
        if end == span.request.num_prompt_tokens:
            task.vector = _finish(pooling, task.state, end, task.dimensions)
            task.state = None


def _finish(
    pooling: Pooling, state: torch.Tensor | None, num_tokens: int, dimensions: int | None
) -> list[float]:
    assert state is not None
    vector = state / num_tokens if pooling.mode is PoolingMode.MEAN else state
    if dimensions is not None:
        vector = vector[:dimensions]  # Matryoshka: the head, re-normalized below
    if pooling.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.cpu().tolist()
