"""Packaging: the top-level folders ``worker/``, ``kernels/`` and ``jobs/`` install as
``batchgen.worker``, ``batchgen.kernels`` and ``batchgen.jobs`` (batchgen/parts.py says
why they hold no ``__init__.py``; metadata: pyproject.toml)."""

import runpy

from setuptools import find_namespace_packages, setup

PARTS = runpy.run_path("batchgen/parts.py")["PARTS"]

packages = find_namespace_packages(include=["batchgen", "batchgen.*"], exclude=["*__pycache__*"])
package_dir = {"batchgen": "batchgen"}
for folder in PARTS:
    name = f"batchgen.{folder}"
    package_dir[name] = folder
    subpackages = find_namespace_packages(folder, exclude=["*__pycache__*"])
    packages += [name] + [f"{name}.{sub}" for sub in subpackages]

setup(packages=packages, package_dir=package_dir)
