"""Start-up hook for SGLang processes launched with this folder on ``PYTHONPATH``: installs
:mod:`sglang_shims` when ``KVFLOW_SGLANG_SHIMS`` is set, then runs the ``sitecustomize`` this
one shadows (if any), so the interpreter's own start-up stays as it was."""

import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("KVFLOW_SGLANG_SHIMS"):
    import sglang_shims

    sglang_shims.install_from_env()

# chain to the next sitecustomize on the path (e.g. a distribution's own)
for _entry in sys.path:
    if not _entry or os.path.abspath(_entry) == _here:
        continue
    _cand = os.path.join(_entry, "sitecustomize.py")
    if os.path.isfile(_cand):
        _spec = importlib.util.spec_from_file_location("_kvflow_chained_sitecustomize", _cand)
        if _spec is not None and _spec.loader is not None:
            try:
                _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
            except Exception:  # noqa: BLE001 - never break interpreter start-up
                pass
        break
