"""Every switch of config.json is honoured or refused by name, never ignored.

A family's config reader reads the switches through a ``ConfigReader``,
which notes each key it was asked for; what the family reads it honours (or
refuses, for a value it cannot run). A key of config.json that no one read
and that is not known to leave the math alone is refused by name
(``check_all_read``): a config from a newer transformers, or a variant the
family does not implement, stops at load instead of giving other tokens.
"""

from __future__ import annotations

from typing import Any

from batchgen.worker.models.hf_config import HFConfig
from batchgen.worker.worker_errors import UnsupportedModelError

# Keys no forward pass depends on: identity and bookkeeping, token ids (the
# engine reads EOS itself), training-only settings (init, dropout), task heads
# other than the LM head, and generation defaults (requests carry their own).
HARMLESS = frozenset(
    {
        "architectures", "model_type", "transformers_version", "_name_or_path",
        "torch_dtype", "dtype", "auto_map", "tokenizer_class", "_attn_implementation_autoset",
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
        "decoder_start_token_id", "initializer_range", "initializer_factor", "init_std",
        "use_cache", "output_hidden_states", "output_attentions", "return_dict",
        "use_return_dict", "torchscript", "id2label", "label2id", "num_labels",
        "problem_type", "finetuning_task", "prefix", "task_specific_params",
        "chunk_size_feed_forward", "is_decoder", "tie_encoder_decoder", "pruned_heads",
        "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
        "residual_dropout", "embedding_dropout", "classifier_dropout", "dropout",
        "hidden_dropout_prob", "attention_probs_dropout_prob", "ffn_dropout",
        "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
        "summary_first_dropout", "max_length", "min_length", "do_sample", "early_stopping",
        "num_beams", "temperature", "top_k", "top_p", "repetition_penalty",
        "length_penalty", "no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "typical_p", "diversity_penalty", "num_beam_groups", "output_scores",
        "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
        "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
        "begin_suppress_tokens", "encoder_no_repeat_ngram_size", "tf_legacy_loss",
        "use_bfloat16", "cross_attention_hidden_size", "add_cross_attention",
        "pretraining_tp",  # a training-time sharding note; transformers' forward ignores it
    }
)  # fmt: skip

# Keys that spell a switch the old way: transformers folds them into the
# standard one, so reading the standard key reads them too.
ALIASES: dict[str, tuple[str, ...]] = {
    "rope_parameters": (
        "rope_theta", "rope_scaling", "partial_rotary_factor", "rotary_pct",
        "rotary_emb_base", "rope_local_base_freq",
    ),
    "layer_types": ("use_sliding_window", "max_window_layers", "sliding_window_pattern",
                    "_sliding_window_pattern"),
}  # fmt: skip


# Keys every family's transformers code reads with getattr, whether or not its
# config class declares them (the attention modules' head_dim).
READ_BY_ALL = frozenset({"head_dim"})


class ConfigReader:
    """The transformers config, read key by key; remembers which keys were read."""

    def __init__(self, config: HFConfig, family: str) -> None:
        self.config = config
        self.family = family
        self.read: set[str] = set()
        self.attribute_map: dict[str, str] = dict(getattr(config.hf, "attribute_map", {}))
        # the keys the family's transformers config class has, and those its model
        # code reads off any config (getattr with a default); any other key in
        # config.json is an extra attribute transformers never looks at
        self.known = set(type(config.hf)().to_dict()) | set(self.attribute_map) | READ_BY_ALL

    def get(self, key: str, default: Any = None) -> Any:
        """The value, or default where unset or where the family's transformers class has
        no such key (then it stays unread: set in config.json, it is refused)."""
        if key not in self.known:
            return default
        self.read.add(key)
        self.read.update(ALIASES.get(key, ()))
        # the name config.json spells it by (GPT-2's n_embd for hidden_size)
        self.read.add(self.attribute_map.get(key, key))
        value = getattr(self.config.hf, key, None)
        return default if value is None else value

    def extra(self, key: str, default: Any = None) -> Any:
        """A key the family's transformers config class lacks but the family's own
        checkpoints carry (DeepSeek-V3's topk_method): its value as config.json writes
        it, counted as read. The family checks it names what transformers computes."""
        self.read.add(key)
        value = self.config.raw.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise UnsupportedModelError(f"config.json of {self.config.path} lacks {key!r}")
        return value

    def refuse(self, key: str, why: str) -> UnsupportedModelError:
        """The error for a switch whose value the family cannot honour."""
        value = getattr(self.config.hf, key, None)
        return UnsupportedModelError(
            f"{self.family}: config switch {key}={value!r} is not supported by batchgen's "
            f"native implementation ({why})"
        )

    def unread(self) -> list[str]:
        """Keys config.json sets (to anything but null) that nobody read."""
        return sorted(
            key
            for key, value in self.config.raw.items()
            if value is not None and key not in self.read and key not in HARMLESS
        )


def check_all_read(reader: ConfigReader) -> None:
    unread = reader.unread()
    if unread:
        raise UnsupportedModelError(
            f"config.json of {reader.config.path} sets {', '.join(unread)}, which batchgen's "
            f"native {reader.family} implementation does not read; refusing to run it rather "
            "than give tokens that may differ from transformers'"
        )
