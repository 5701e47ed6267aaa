"""Which code made a stored result: every bench JSON records it (``code``), so runs pooled
as one experiment (``kvflow bench pool``) can be checked to be of one code version.

``code_version()``: the package version and, in a git checkout, the commit and whether its
code differed from it (tracked ``*.py`` files or ``pyproject.toml``: a run made with
uncommitted code changes is not that commit's; an edited README or result file does not
count).
Taken when a bench command starts (the ``bench`` group's callback, ``cli/main.py``): the JSON
is written at the end of a run, and a commit made meanwhile is not the code the run imported.
Cheap and never fatal: a missing ``git``, a wheel install or a slow disk give ``git: None``.
"""

from __future__ import annotations

import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Optional

_TIMEOUT_S = 5.0
CODE_PATHS = ("*.py", "pyproject.toml")  # what "dirty" looks at (module doc)


def _git(root: Path, *args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                             timeout=_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


@lru_cache(maxsize=1)
def code_version() -> dict:
    """``{"package": "0.1.0", "git": "<commit>" | None, "dirty": bool | None}`` of this
    package's checkout (module doc). Cached: the code a process runs does not change under it."""
    from kvflow_agents import __version__

    return {"package": __version__, **checkout_state(Path(__file__).resolve().parents[2])}


def checkout_state(root: Path) -> dict:
    """``{"git": commit, "dirty": bool}`` of the git checkout at ``root``; None for both where
    it is not one (or git cannot say)."""
    commit = _git(root, "rev-parse", "HEAD") if (root / ".git").exists() else None
    dirty = None
    if commit:
        status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
        dirty = None if status is None else bool(status)
    return {"git": commit, "dirty": dirty}


def label(code: Optional[dict]) -> Optional[str]:
    """A short name for a recorded version (``1a2b3c4d5e``, ``+dirty`` when it was), or None
    when the result has no record (made before results recorded it) or no commit."""
    if not code or not code.get("git"):
        return None
    return code["git"][:10] + ("+dirty" if code.get("dirty") else "")
