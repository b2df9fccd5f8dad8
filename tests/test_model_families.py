"""Every dense architecture batchgen claims runs exactly as transformers does (``family_parity``)."""

from __future__ import annotations

import pytest

from tests.family_parity import assert_matches_hf
from tests.model_zoo import VOCAB

DENSE = ["llama", "llama-biases", "qwen3", "qwen3-bias"]


@pytest.mark.parametrize("name", DENSE)
def test_family_matches_hf(zoo_model, name):
    assert_matches_hf(zoo_model(name), VOCAB)
