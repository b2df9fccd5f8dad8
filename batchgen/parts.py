"""Where batchgen's parts live: the folders ``worker/``, ``kernels/`` and ``jobs/`` are
the packages ``batchgen.worker``, ``batchgen.kernels`` and ``batchgen.jobs``.

A wheel lays them out inside ``batchgen/`` (setup.py maps each folder there, from
``PARTS``). A source checkout keeps them at the top of the repository, beside
``batchgen/``; there ``find_parts_beside()`` (called when batchgen is imported) lets
their ``batchgen.*`` names find those folders, in an editable install and in a
checkout that is not installed at all.

None of the three folders holds an ``__init__.py``: each is a namespace portion,
never a package of its own, so a top-level ``import kernels`` (Hugging Face's
``kernels``, which transformers imports), ``import jobs`` or ``import worker`` finds
the installed package of that name even where the checkout's root stands first on
``sys.path`` (``python -m`` run from the root, pytest's rootdir, a script saved
there): Python takes a regular package from any entry of the path before a
namespace portion from an earlier one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

PARTS = ("worker", "kernels", "jobs")
PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent
# the folder this batchgen was imported from, its links unresolved: the checkout, or a
# folder that links to the checkout's batchgen/ only (benchmarks/gpu_check.py's children)
IMPORTED_FROM = Path(os.path.abspath(__file__)).parent.parent


class PartsBeside:
    """A meta path finder: ``batchgen.<part>`` is the checkout's ``<part>/`` folder."""

    @staticmethod
    def find_spec(fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        package, _, part = fullname.partition(".")
        if package != "batchgen" or part not in PARTS:
            return None
        return PathFinder.find_spec(fullname, [str(CHECKOUT)])


def laid_out_beside() -> bool:
    """Whether this is a source checkout: the parts beside ``batchgen/``, not inside."""
    return not any((PACKAGE / part).is_dir() for part in PARTS) and all(
        (CHECKOUT / part).is_dir() for part in PARTS
    )


def find_parts_beside() -> None:
    """In a source checkout, let ``batchgen.<part>`` find the folders beside the package."""
    if laid_out_beside() and PartsBeside not in sys.meta_path:
        sys.meta_path.append(PartsBeside)


def module_command(module: str) -> list[str]:
    """``python -P -m module`` on this interpreter, for the processes batchgen starts:
    ``-P`` keeps the working directory off the child's ``sys.path``, so a folder it
    happens to run in (the parent of a clone named ``batchgen``, say) is never
    imported in place of the package. Run it with ``child_environ()``."""
    return [sys.executable, "-P", "-m", module]


def child_environ(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment (and ``extra``) for a ``module_command`` child. From a
    source checkout the folder this batchgen was imported from goes first on the child's
    ``PYTHONPATH``: the child imports this very batchgen, installed or not, and no more
    of the checkout's root than this process has on its path."""
    env = {**os.environ, **(extra or {})}
    if laid_out_beside():
        first = str(IMPORTED_FROM)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [first, env.get("PYTHONPATH")]))
    return env
