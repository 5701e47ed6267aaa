"""Import-only stand-in for ``torchvision`` in the SGLang CPU test venv.

Why: sglang 0.5.23 imports ``torchvision`` at module level in a few multimodal helpers that the
scheduler imports transitively, but never calls it for text models. PyPI's torchvision wheels
are CUDA builds: with the CPU torch they fail at import (``operator torchvision::nms does not
exist``), and installing one pulls a CUDA torch. So, in this venv only, any ``torchvision``
(sub)module import yields an empty module whose attributes are inert placeholders. A real call
into it raises, so a code path that actually needs torchvision fails loudly instead of silently.

Active only when no real torchvision is installed. Importing this module does nothing by
itself; ``install-cpu.sh`` copies it into the CPU test venv as ``_kvflow_tv_shim.py`` with a
``.pth`` line that calls :func:`install` at interpreter start. Never used in the main venv or
on a GPU machine.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Placeholder:
    """Stands for any torchvision attribute: usable as a base class, a decorator target or
    a type annotation at import time; calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> "_Placeholder":
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is shimmed in this CPU test venv")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<torchvision shim {self._name}>"


class _ShimModule(types.ModuleType):
    def __getattr__(self, item: str):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self.__name__}.{item}")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        m = _ShimModule(spec.name)
        m.__path__ = []  # a package: submodules import too
        m.__version__ = "0.0.0+kvflow-shim"
        return m

    def exec_module(self, module) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision" and not fullname.startswith("torchvision."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


def install() -> None:
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    # A real torchvision wins (e.g. someone installed a matching CPU build).
    for finder in sys.meta_path:
        try:
            if finder.find_spec("torchvision", None) is not None:
                return
        except Exception:
            continue
    sys.meta_path.append(_Finder())
