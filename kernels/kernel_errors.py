"""The kernels' errors."""

from __future__ import annotations


class BuildFailed(Exception):
    """The compiler refused the sources with every set of flags."""
