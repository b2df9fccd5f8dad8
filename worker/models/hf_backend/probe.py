"""What a transformers model asks of its attention, learned by running it once.

Before a model serves, one forward over two tokens runs with a recording
attention function. Each call tells which module is which cache layer (the
order of the calls), the K/V shape of that layer, its scale, its window, and
every argument the module passed; anything batchgen's paged attention would
not honour (an attention mask the model built itself, soft-capping, a layer
that never calls the registry) is a refusal that names it. A checkpoint that
loads therefore runs exactly the math transformers runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchgen.kernels.batch import AttentionKind
from batchgen.worker.models.hf_backend.registered_attention import ACTIVE
from batchgen.worker.worker_errors import UnsupportedModelError

# Arguments an attention function may receive that change nothing here: how
# transformers threads its cache and positions through, and output switches.
_IGNORED_KWARGS = frozenset(
    {"position_ids", "cache", "past_key_values", "use_cache", "cache_position",
     "output_attentions", "layer_idx", "is_causal", "dropout"}
)  # fmt: skip


# Arguments the paged kernels compute (``AttentionKind``).
_HONOURED_KWARGS = frozenset({"scaling", "sliding_window", "softcap"})


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """One attention layer as the paged kernels run it."""

    index: int  # its KV cache layer, in call order
    kind: AttentionKind  # its scale, sliding window and soft-cap


@dataclass(frozen=True, slots=True)
class ProbedLayout:
    layers: dict[torch.nn.Module, LayerPlan]  # keyed by the attention module
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    hidden_size: int  # of the base model's output (OPT projects it below its own width)


class _Recorder:
    """The attention sink of the probe: records each call and returns zeros."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.nn.Module, tuple[int, ...], tuple[int, ...], dict]] = []
        self.query_heads: set[int] = set()

    def attend(self, module, query, key, value, attention_mask, kwargs) -> torch.Tensor:
        if attention_mask is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} receives an attention mask its model built itself; "
                "batchgen's paged attention masks by position and cannot honour it"
            )
        self.calls.append((module, tuple(key.shape), tuple(value.shape), dict(kwargs)))
        self.query_heads.add(int(query.shape[1]))  # (1, heads, T, D)
        return torch.zeros_like(query).transpose(1, 2)


def probe_layout(
    base_model: torch.nn.Module, num_layers: int, windows: list[int | None], device: torch.device
) -> ProbedLayout:
    """Runs ``base_model`` once on two tokens and plans each attention layer.

    ``windows`` is the sliding window of each layer as the config says
    (transformers' own reading of it); a window the module passes must agree,
    and a layer the config makes slide must say so to its attention or its model
    must build sliding masks: a config key transformers' class ignores (Llama
    given a sliding_window) leaves transformers itself of two minds (a causal
    mask over a cache that keeps only the window), with nothing exact to match.
    """
    import inspect
    import sys

    source = inspect.getsource(sys.modules[type(base_model).__module__])
    masks_slide = "create_sliding_window_causal_mask" in source
    recorder = _Recorder()
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    positions = torch.arange(2, device=device)[None]
    token = ACTIVE.set(recorder)
    try:
        with torch.inference_mode():
            out = base_model(input_ids=ids, position_ids=positions, use_cache=False)
    except UnsupportedModelError:
        raise
    except Exception as exc:  # the model's own code failed with our attention: say so
        raise UnsupportedModelError(
            f"{type(base_model).__name__} does not run with a registered attention function "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        ACTIVE.reset(token)
    calls = recorder.calls
    name = type(base_model).__name__
    if not calls:
        raise UnsupportedModelError(
            f"{name}'s layers never call transformers' attention registry (its attention is "
            "written into the model, or it has no attention); batchgen cannot page its KV"
        )
    modules = [c[0] for c in calls]
    if len(set(map(id, modules))) != len(modules) or len(calls) != num_layers:
        raise UnsupportedModelError(
            f"{len(calls)} attention calls through transformers' registry for {num_layers} layers "
            f"in {name}: the other layers keep state batchgen's paged KV cache does not hold "
            "(recurrent or linear attention, shared KV), or attend more than once"
        )
    shapes = {(c[1][1], c[1][3], c[2][1], c[2][3]) for c in calls}
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"{name}'s layers differ in K/V heads or head size; batchgen's KV cache has one shape"
        )
    ((hk, dk, hv, dv),) = shapes
    if (hk, dk) != (hv, dv):
        raise UnsupportedModelError(
            f"{name}'s values ({hv} heads of {dv}) are not shaped like its keys ({hk} of {dk})"
        )
    layers = {
        module: _plan(i, module, kwargs, windows[i], dk, masks_slide)
        for i, (module, _, _, kwargs) in enumerate(calls)
    }
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out
    return ProbedLayout(layers=layers, num_heads=max(recorder.query_heads), num_kv_heads=hk,
                        head_dim=dk, hidden_size=hidden.shape[-1])  # fmt: skip


def _plan(
    index: int,
    module: torch.nn.Module,
    kwargs: dict[str, Any],
    window: int | None,
    head_dim: int,
    masks_slide: bool,
) -> LayerPlan:
    what = f"layer {index} ({type(module).__name__})"
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
        raise UnsupportedModelError(f"{what} attends bidirectionally; batchgen attends causally")
    if kwargs.get("dropout"):
        raise UnsupportedModelError(f"{what} applies attention dropout at inference")
    passed = kwargs.get("sliding_window")
    if passed is not None and passed != window:
        raise UnsupportedModelError(
            f"{what} passes sliding_window={passed} but its config gives it {window}"
        )
    if window is not None and passed is None and not masks_slide:
        raise UnsupportedModelError(
            f"{what} has sliding_window={window} in its config, which transformers' own "
            f"{type(module).__name__} does not apply"
        )
    unknown = sorted(
        k for k, v in kwargs.items()
        if v is not None and k not in _IGNORED_KWARGS and k not in _HONOURED_KWARGS
    )  # fmt: skip
    if unknown:
        raise UnsupportedModelError(
            f"{what} passes {', '.join(unknown)} to its attention, which batchgen's paged "
            "attention does not honour"
        )
    scale = kwargs.get("scaling")
    scale = float(head_dim**-0.5 if scale is None else scale)
    softcap = kwargs.get("softcap")
    kind = AttentionKind(scale=scale, window=window,
                         softcap=None if softcap is None else float(softcap))  # fmt: skip
    return LayerPlan(index=index, kind=kind)
