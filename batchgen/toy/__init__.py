"""Random-initialised, HF-format toy checkpoints for tests, demos and benchmarks.

The weights are random: the text they generate is gibberish. They exist so
that pipelines, parity tests and speed measurements run offline; real users
point ``--model`` at a real checkpoint directory.
"""

from batchgen.toy.checkpoint import ARCHS, SIZES, TOY_WINDOW, randomise, write_toy_checkpoint

__all__ = ["ARCHS", "SIZES", "TOY_WINDOW", "randomise", "write_toy_checkpoint"]
