"""Packaging: the top-level folders ``worker/``, ``kernels/`` and ``jobs/`` install as
``batchgen.worker``, ``batchgen.kernels`` and ``batchgen.jobs`` (metadata: pyproject.toml)."""

from setuptools import find_packages, setup

PARTS = {"batchgen.worker": "worker", "batchgen.kernels": "kernels", "batchgen.jobs": "jobs"}

packages = find_packages(include=["batchgen", "batchgen.*"])
package_dir = {"batchgen": "batchgen"}
for name, folder in PARTS.items():
    package_dir[name] = folder
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
