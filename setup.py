"""Package discovery for the repo layout the project's user asked for.

The top-level folders ``graph/``, ``adapters/`` and ``serving/`` read like the architecture,
but install as ``kvflow_agents.graph`` etc., so every import stays namespaced. pyproject.toml
holds the metadata; this file only computes the package list and the folder mapping, so a new
sub-package is picked up without editing a list by hand.
"""

from setuptools import find_packages, setup

ROOTS = {
    "kvflow_agents": "kvflow_agents",
    "kvflow_agents.graph": "graph",
    "kvflow_agents.adapters": "adapters",
    "kvflow_agents.serving": "serving",
}

packages = []
for package, folder in ROOTS.items():
    packages.append(package)
    packages.extend(f"{package}.{sub}" for sub in find_packages(folder))

setup(packages=packages, package_dir=ROOTS)
