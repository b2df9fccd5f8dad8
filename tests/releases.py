"""Which transformers release the tests run on, and what needs a newer one.

The native engine, the pipeline and the toy checkpoints run on every release from
pyproject's lower bound; the transformers backend from ``BACKEND_RELEASE`` (its
tests are skipped before it, saying so; test_transformers_releases.py checks the
refusal instead). CI runs the model tests on both ends (Makefile: test-oldest).
"""

from __future__ import annotations

import pytest
import transformers

from batchgen.worker.models.hf_backend.qualify import BACKEND_RELEASE, release

INSTALLED = release(transformers.__version__)
BACKEND_RUNS = INSTALLED >= BACKEND_RELEASE

needs_backend = pytest.mark.skipif(
    not BACKEND_RUNS,
    reason=f"transformers {transformers.__version__}: the transformers backend needs "
    f"{'.'.join(map(str, BACKEND_RELEASE))} (its refusal: test_transformers_releases.py)",
)
